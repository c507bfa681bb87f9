#!/usr/bin/env bash
# The negated-reward gate test (tests/integration/test_negated_rewards_vllm.py) over other sampling
# seeds and trainer settings, on the real engine: how often, and by how much, one `atdp train --once`
# on negated rewards makes the held-out greedy answers score lower. The test's trainer settings come
# from this measurement (offsets 1 and up; the test itself runs offset 0), not from the test's outcome.
#
#   bench/negated_gate.sh [OFFSETS] [TRAIN ARGS...]
#   bench/negated_gate.sh 1,2,3,4,5,6,7,8 --lr 1e-2 --ppo-epochs 8 --clip-low 0.9
#
# Needs PostgreSQL (ATDP_TEST_DATABASE_URL) and the vLLM environment (scripts/vllm_env.sh); about
# 40 s per offset after vLLM's start on 2 cores. Prints one JSON line per run and a summary.
set -euo pipefail
cd "$(dirname "$0")/.."
offsets="${1:-1,2,3,4,5,6,7,8}"
shift || true
export ATDP_NEGATED_SEED_OFFSETS="$offsets" ATDP_NEGATED_TRAIN_ARGS="$*"
export ATDP_VLLM_PYTHON="${ATDP_VLLM_PYTHON:-$(scripts/vllm_env.sh)}"
out="$(mktemp)"
trap 'rm -f "$out" "$out.runs"' EXIT
# Failed runs are part of the measurement: keep going and count them.
.venv/bin/python -m pytest -s -p no:cacheprovider tests/integration/test_negated_rewards_vllm.py > "$out" 2>&1 || true
grep '^negated-gate-run ' "$out" | cut -d' ' -f2- > "$out.runs" || true
.venv/bin/python - "$out.runs" <<'PY'
import json
import statistics
import sys

runs = [json.loads(line) for line in open(sys.argv[1])]
for r in runs:
    print(json.dumps({k: r[k] for k in ("offset", "status", "n", "serving_mean", "candidate_mean", "diff_mean",
                                        "ci_low", "ci_high", "update")}))
if not runs:
    sys.exit("no run finished; see the pytest output")
diffs = [r["diff_mean"] for r in runs]
print(f"{len(runs)} runs, trainer {' '.join(runs[0]['train_args'])}: "
      f"rejected {sum(r['status'] == 'rejected' for r in runs)}, "
      f"candidate lower {sum(r['candidate_mean'] < r['serving_mean'] for r in runs)}, "
      f"interval below 0 {sum(r['ci_high'] < 0 for r in runs)}; held-out difference median "
      f"{statistics.median(diffs):+.3f}, min {min(diffs):+.3f}, max {max(diffs):+.3f}")
PY
