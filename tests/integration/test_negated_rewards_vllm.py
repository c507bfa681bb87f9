"""A version trained on negated rewards is rejected by replay evaluation: real vLLM (tiny model, CPU),
the proxy, PostgreSQL and an `atdp train --once` subprocess.

The task is close to the learning e2e's (tests/e2e/test_learning_e2e.py): one-turn sessions
"Question i: say something." answered with 6 tokens at temperature 1 (seeded), rewarded with the
fraction of output tokens in S. Here S is the 16 tokens the base model's **greedy** answers to the
same prompts use most (asked of the engine directly, nothing recorded), because greedy answers are
what the replay gate compares. The tenant's policy holds out a quarter of the rewarded sessions
(`eval_holdout = 0.25`), and an operator suite holds the task rule that scores them: the same reward
rule on the replayed answer's text (tests/token_rule.py). Every session's reward is posted
**negated** (-r: the behaviour the task rewards is punished), so the trainer, which never sees the
held-out sessions, learns the opposite of the task. Its version goes through the gates when the
trainer posts it, and the replay gate must reject it: the held-out prompts, answered greedily by both
versions, score lower under it.

How the set-up was chosen (bench/negated_gate.sh: this test's pipeline over other sampling seeds,
offsets 1 and up; the test runs offset 0; figures in docs/control-plane.md):
- The trainer settings (lr 1e-2, 8 PPO epochs, clip-low 0.9). Under the default clip a punished
  token may fall only to 0.8 of its probability in one update, and the negated update often left
  the greedy answers nearly unchanged.
- S from the greedy answers. With S from the sampled answers, the held-out interval was not below 0
  in 5 of 40 reported runs on one 2-core EPYC (lr 1e-2 or 2e-2, 8 or 16 epochs; a 41st ended without
  its report): the greedy answers of those runs used few tokens of S and stayed nearly as they were,
  and one CI run served the version. With S from the greedy answers, 24 of 24 runs (offsets 1-24)
  had the whole interval below 0.

The tenant's policy tolerates no regression (`max_regression = 0`, the strictest setting): under the
default 0.05 a negated update that moved the tiny model's greedy answers only a little passed the
gate in one CI run (the sessions are sampled, so each run trains on other data).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from proxy.store import db
from proxy.store import tables as t

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
ADMIN = {"authorization": "Bearer admin-test-key"}
SESSIONS = 128
MAX_TOKENS = 6
TASK = "say"
# bench/negated_gate.sh runs this test over other sampling seeds (session i of offset k is sampled
# with seed k * SESSIONS + i) and other trainer settings; CI runs offset 0 with TRAIN_ARGS.
TRAIN_ARGS = ["--lr", "1e-2", "--ppo-epochs", "8", "--clip-low", "0.9"]
OFFSETS = [int(k) for k in os.environ.get("ATDP_NEGATED_SEED_OFFSETS", "0").split(",")]


def _prompt(i: int) -> list[dict]:
    """Session i's one user turn: recorded sampled, and asked greedily for S."""
    return [{"role": "user", "content": f"Question {i}: say something."}]


def _record(proxy, model: str, offset: int) -> None:
    errors: list[str] = []

    def one(i: int) -> None:
        body = {"model": model, "messages": _prompt(i),
                "temperature": 1.0, "max_tokens": MAX_TOKENS, "seed": offset * SESSIONS + i}
        r = httpx.post(proxy.v1 + "/chat/completions", json=body, timeout=120,
                       headers={"x-atdp-session-id": f"s{i}", "x-atdp-task-id": TASK})
        if r.status_code != 200:
            errors.append(r.text)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(SESSIONS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[:2]
    proxy.flush()


def _greedy_tokens(vllm_server) -> collections.Counter:
    """The tokens of the base model's greedy answers to the task's prompts, asked of the engine
    directly (nothing recorded): what the replay gate will see the serving version answer."""
    def one(i: int) -> list[int]:
        body = {"model": vllm_server.model, "messages": _prompt(i),
                "temperature": 0.0, "max_tokens": MAX_TOKENS, "return_token_ids": True}
        r = httpx.post(vllm_server.base_url + "/v1/chat/completions", json=body, timeout=120)
        r.raise_for_status()
        return r.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(16) as pool:
        return collections.Counter(tok for ids in pool.map(one, range(SESSIONS)) for tok in ids)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("offset", OFFSETS)
def test_a_version_trained_on_negated_rewards_is_rejected_by_replay_evaluation(start_proxy, vllm_server, new_database,
                                                                               tmp_path, offset):
    from tests.vllm_fixtures import swap_weights

    url = new_database("atdp_negated")
    db.upgrade(url)
    policy = tmp_path / "policy.toml"
    policy.write_text("[default]\ntraining_consent = true\neval_holdout = 0.25\nmax_regression = 0.0\n")
    suites = tmp_path / "suites"
    suites.mkdir()
    proxy = start_proxy([vllm_server.base_url], database_url=url, policy_file=policy, eval_suites=suites,
                        eval_concurrency=1)
    assert proxy.versions.ready.wait(60)
    engine = db.make_engine(url)
    factory = db.session_factory(engine)
    try:
        _record(proxy, vllm_server.model, offset)
        with factory() as s:
            rows = s.execute(select(t.Session.external_id, t.Step.output_token_ids)
                             .join(t.Step, t.Step.session_id == t.Session.id)).all()
        assert len(rows) == SESSIONS
        subset = {tok for tok, _ in _greedy_tokens(vllm_server).most_common(16)}
        # The task rule: how the gate scores held-out sessions of this task (written before the gates run).
        (suites / "ops.jsonl").write_text(json.dumps({
            "task": TASK, "evaluator": "tests.token_rule:score",
            "expected": {"tokenizer": str(vllm_server.model_dir), "tokens": sorted(subset)}}) + "\n")
        rewards = {sid: sum(tok in subset for tok in ids) / len(ids) for sid, ids in rows}
        for sid, reward in rewards.items():
            r = httpx.post(f"{proxy.url}/atdp/v1/sessions/{sid}/feedback", timeout=10,
                           json={"reward": -reward, "comment": "negated on purpose: the gate test"})
            assert r.status_code == 200, r.text

        env = {**os.environ, "ATDP_DATABASE_URL": url, "ATDP_ADMIN_KEY": "admin-test-key", "ATDP_PROXY_URL": proxy.url,
               "ATDP_UPSTREAM_URL": vllm_server.base_url, "ATDP_HOME": str(tmp_path / "home"),
               "ATDP_POLICY_FILE": str(policy), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        # A clearly harmful update (TRAIN_ARGS, chosen with bench/negated_gate.sh): the gate's bar is unchanged.
        train_args = os.environ.get("ATDP_NEGATED_TRAIN_ARGS", "").split() or TRAIN_ARGS
        proc = subprocess.run([sys.executable, "-m", "proxy.cli", "train", "--once", *train_args, "--seed", "0"],
                              env=env, capture_output=True, text=True, timeout=400, cwd=REPO)
        # The trainer exits 1 when its version is not served.
        assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-6000:]

        detail = httpx.get(proxy.url + "/atdp/v1/versions/v1", headers=ADMIN, timeout=10).json()
        gates = {g["gate"]: g for g in detail["gates"]}
        n = gates["replay_eval"]["numbers"]
        report = {"offset": offset, "train_args": train_args, "status": detail["status"], **n.get("overall", {}),
                  "update": next((ln.split("INFO ")[-1] for ln in proc.stderr.splitlines() if "update 0 ->" in ln), "")}
        print(f"\nnegated-gate-run {json.dumps(report)}")
        print(f"negated-reward version: {detail['status']}; held-out cases {n.get('held_out_cases')}, "
              f"overall {json.dumps(n.get('overall'))}; trained on "
              f"{len(rewards) - n.get('held_out_sessions', 0)} sessions; gate {n.get('seconds')} s\n"
              f"trainer: {proc.stderr[-2000:]}")
        assert detail["status"] == "rejected", detail
        assert gates["replay_eval"]["state"] == "failed", gates
        assert n["suite_cases"] == 0 and n["held_out_cases"] == n["held_out_sessions"] > 0
        assert n["overall"]["candidate_mean"] < n["overall"]["serving_mean"], proc.stderr[-4000:]
        with factory() as s:
            trained = set(s.scalars(select(t.VersionLineage.session_id)))
            released = s.scalar(select(t.Step.id).where(t.Step.trained_version_id.is_not(None)).limit(1))
        assert trained and released is None  # a rejected version's steps are released for a later update
        # The engine serves the base weights again.
        assert httpx.get(vllm_server.base_url + "/weight_info", timeout=10).json()["weight_version"] == "base"
    finally:
        if httpx.get(vllm_server.base_url + "/weight_info", timeout=10).json().get("weight_version") != "base":
            swap_weights(vllm_server.base_url, vllm_server.model_dir, "base")
        engine.dispose()
