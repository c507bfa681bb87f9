#!/usr/bin/env bash
# The test command: sets up what the tests need (both environments, the tiny model is built by the
# fixtures), checks style and the import rules (import-linter contracts in pyproject.toml), and runs
# the suite against a real PostgreSQL, a real vLLM and a real browser (Debian's chromium).
#
#   scripts/test.sh                  # everything
#   scripts/test.sh -k chat -x       # pytest arguments pass through
#
# Database: ATDP_TEST_DATABASE_URL (a server where the tests may create databases); unset, the
# tests start an embedded PostgreSQL in a temporary folder.
set -euo pipefail
cd "$(dirname "$0")/.."

python=$(scripts/bootstrap.sh)
scripts/system_packages.sh  # Debian's chromium and haproxy for the browser and load balancer tests
ATDP_VLLM_PYTHON=$(scripts/vllm_env.sh)
export ATDP_VLLM_PYTHON
"$(dirname "$python")/ruff" check .
"$(dirname "$python")/lint-imports" --no-cache
"$python" -m atdp_schema.generate --check
exec "$python" -m pytest "$@"
