"""`atdp demo`: the task family and reward rule (deterministic), the home it owns, and two runs of the
whole orchestration on the tiny model (real embedded PostgreSQL, vLLM, proxy, trainer, swaps): one to
the end, one stopped with SIGINT after the first swap, which must leave no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from proxy.demo.home import MARKER, prepare_home
from proxy.demo.skill import (
    SPLITS,
    TABLE,
    Task,
    make_tasks,
    outcome,
    parse_call,
    split_tasks,
    tool_result,
    wilson,
)

ROOT = Path(__file__).resolve().parents[2]


# --- tasks and reward ----------------------------------------------------------------------------


def test_splits_are_disjoint_and_tasks_deterministic():
    assert not set(SPLITS["heldout"]) & set(SPLITS["train"]) and not set(SPLITS["dev"]) & set(SPLITS["train"])
    assert not set(SPLITS["heldout"]) & set(SPLITS["dev"])
    assert len(SPLITS["heldout"]) == 96 and len(SPLITS["train"]) > 1000
    a = make_tasks(8, seed=0, round_no=1)
    assert a == make_tasks(8, seed=0, round_no=1)
    assert a != make_tasks(8, seed=0, round_no=2)
    assert len({t.id for t in a}) == 8 and all(t.id.startswith("demo-r01-") for t in a)
    assert all(t.item in SPLITS["train"] and t.code == TABLE[t.item] for t in a)
    held = split_tasks("heldout", 64)
    assert held == split_tasks("heldout", 64) and {t.item for t in held} <= set(SPLITS["heldout"])
    # The codes are spread out: guessing one is not a strategy.
    assert len(set(TABLE.values())) > 500


def test_correctness_is_the_only_reward():
    task = Task(id="t", item="tarimo", code=583)
    call = 'lookup("tarimo")'

    def solved(first: str, second: str | None, truncated: bool = False) -> float:
        return outcome(task, first, second, truncated=truncated).reward

    assert solved(call, "583") == 1.0
    assert solved(f"Sure. {call}", "The code is 583.") == 1.0  # text around the call and the code is fine
    assert solved("lookup('TARIMO')", "583") == 1.0
    assert solved(call, "584") == 0.0
    assert solved(call, "583 or 584") == 0.0  # more than one number: not a report of the result
    assert solved(call, "583", truncated=True) == 0.0  # cut at max_tokens
    assert solved(call, "") == 0.0
    assert solved('lookup("tarim")', "583") == 0.0  # the wrong item: the tool could not have said 583
    assert solved("The code is 583.", None) == 0.0  # no tool call: a guess, even a right one, scores 0
    assert solved("", None) == 0.0
    assert solved("lookup(tarimo", None) == 0.0
    o = outcome(task, 'lookup("tarim")', "12")
    assert o.valid_call and not o.right_item and not o.solved
    assert parse_call('x lookup( "Kavo" ) y lookup("mi")') == "kavo"
    assert tool_result("tarimo") == 'lookup("tarimo") returned: no such item. Reply with only the code.'
    item = SPLITS["train"][0]
    assert str(TABLE[item]) in tool_result(item)


def test_wilson_interval():
    lo, hi = wilson(0, 96)
    assert lo == 0.0 and 0.03 < hi < 0.05
    lo, hi = wilson(48, 96)
    assert lo == pytest.approx(0.401, abs=0.002) and hi == pytest.approx(0.599, abs=0.002)
    assert wilson(0, 0) == (0.0, 1.0)


# --- the gates' evaluation set ---------------------------------------------------------------------


def test_gate_suite_and_evaluator_score_replays_with_the_task_rule(tmp_path):
    from proxy.demo.gates import EVALUATOR, EvalSuite
    from proxy.evaluation.cases import Answer, load_suites
    from proxy.evaluation.evaluators import Registry

    round_tasks = make_tasks(3, seed=0, round_no=0)
    suite = EvalSuite.create(tmp_path, n_cases=5, seed=0, max_tokens=16, exclude=round_tasks)
    suite.add_rules(round_tasks)
    loaded = load_suites(tmp_path, max_tokens=128)
    assert len(loaded.cases) == 5 and {c.tenant for c in loaded.cases} == {"demo"}
    items = {c.expected["item"] for c in loaded.cases}
    assert len(items) == 3 and not items & {t.item for t in round_tasks}
    assert all(c.request["max_tokens"] == 16 and c.evaluator == EVALUATOR for c in loaded.cases)
    assert sorted(loaded.rules) == sorted(t.id for t in round_tasks)
    assert not list(tmp_path.glob("*.tmp"))

    first, second = loaded.cases[0], loaded.cases[1]  # both turns of one item
    assert first.expected == second.expected
    assert second.request["messages"][:-2] == first.request["messages"]  # then the call and its result
    item, code = first.expected["item"], first.expected["code"]
    r = Registry()
    assert r.score(first, Answer(f'lookup("{item}")', finish_reason="stop")) == 1.0
    assert r.score(first, Answer('lookup("nobody")', finish_reason="stop")) == 0.0
    assert r.score(first, Answer(str(code), finish_reason="stop")) == 0.0  # turn 1 needs the call
    assert r.score(second, Answer(f"{code}.", finish_reason="stop")) == 1.0
    assert r.score(second, Answer(f"{code}", finish_reason="length")) == 0.0  # cut at max_tokens
    assert r.score(second, Answer(f"{code + 1}")) == 0.0


# --- the home --------------------------------------------------------------------------------------


def test_home_is_created_reset_and_foreign_homes_refused(tmp_path):
    home = tmp_path / "demo-home"
    prepare_home(home)
    assert (home / MARKER).exists() and (home / "demo").is_dir()
    for name in ("checkpoints/v1", "spool", "demo"):
        (home / name).mkdir(parents=True, exist_ok=True)
    (home / "demo" / "old.png").write_bytes(b"x")
    (home / "secret").write_text("kept")
    prepare_home(home)
    assert not (home / "checkpoints").exists() and not (home / "spool").exists()
    assert list((home / "demo").iterdir()) == []
    assert (home / "secret").read_text() == "kept"

    foreign = tmp_path / "real-store"
    foreign.mkdir()
    (foreign / "secret").write_text("someone else's")
    with pytest.raises(SystemExit, match="not a demo home"):
        prepare_home(foreign)
    assert (foreign / "secret").read_text() == "someone else's"


# --- the whole loop on the tiny model --------------------------------------------------------------


def _demo(home: Path, *args: str) -> subprocess.Popen:
    from proxy.demo.vllm import find_vllm_python

    vllm_python = find_vllm_python()
    if vllm_python is None:
        pytest.fail("no vLLM environment: run scripts/vllm_env.sh (or set ATDP_VLLM_PYTHON)", pytrace=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATDP_") or k == "ATDP_VLLM_VENV"}
    env.update(ATDP_VLLM_PYTHON=vllm_python, COLUMNS="160")
    cmd = [sys.executable, "-m", "proxy.cli", "demo", "--model", "tiny", "--sessions-per-round", "8",
           "--group-size", "4", "--concurrency", "8", "--home", str(home), *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _assert_all_stopped(home: Path) -> None:
    from proxy.demo.vllm import _group_alive

    pids = json.loads((home / "demo" / "processes.json").read_text())
    assert {"proxy", "vllm", "trainer-1"} <= set(pids)
    deadline = time.monotonic() + 10
    alive = {name: pid for name, pid in pids.items() if name != "demo" and _group_alive(pid)}
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = {name: pid for name, pid in alive.items() if _group_alive(pid)}
    assert not alive, f"still running: {alive}"
    assert not (home / "pg" / "postmaster.pid").exists(), "the embedded PostgreSQL still runs"


@pytest.mark.vllm
@pytest.mark.slow
def test_demo_runs_to_the_end_on_the_tiny_model(tmp_path):
    home = tmp_path / "home"
    # 40% held out: the second gate draws on 16 sessions, none of them held out with odds 0.6^16.
    # How many of a round's 8 sessions are held out is a draw (2 to 5 seen), so a run this small
    # cannot promise the gates' default minimum of 20 cases: the minimum is the demo's option, as it
    # is an operator's setting, and 4 (the suite's cases alone) lets both gates run on any draw.
    proc = _demo(home, "--rounds", "2", "--eval-cases", "4", "--eval-holdout", "0.4", "--heldout-tasks", "16",
                 "--eval-min-cases", "4", "--memory-services", "16")
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(60)
    assert proc.returncode == 0, out
    summary = json.loads((home / "demo" / "summary.json").read_text())
    versions = [v["version"] for v in summary["versions"]]
    assert versions == ["base", "v1", "v2"], out
    # 8 per round; a round whose rewarded sessions all fell in the held-out share works its tasks again.
    sessions = [v["sessions"] for v in summary["versions"]]
    assert all(n >= 8 and n % 8 == 0 for n in sessions) and sessions[-1] == 8, out
    # The store agrees: every session's reward, grouped by the version stamped on its tokens.
    assert [(s["version"], s["sessions"]) for s in summary["stored"]] == list(zip(versions, sessions, strict=True))
    for live, stored in zip(summary["versions"], summary["stored"], strict=True):
        assert live["mean_reward"] == pytest.approx(stored["mean_reward"])
    assert [s["status"] for s in summary["swaps"]] == ["serving", "serving"]
    # Each candidate went through the gates: replay (suite + held-out cases) and safety ran, the
    # canary was asked for and skipped (one replica); the last promoted version's card is filled.
    assert [g["version"] for g in summary["gates"]] == ["v1", "v2"], out
    for g in summary["gates"]:
        assert g["replay_state"] == "passed" and g["safety_state"] == "passed", g
        assert g["suite_cases"] == 4 and g["cases"] == g["suite_cases"] + g["held_out_cases"]
        assert g["canary_state"] == "skipped" and g["status"] == "serving"
    assert summary["gates"][-1]["held_out_cases"] > 0
    assert summary["card"] == {"version": "v2", "filled": dict.fromkeys(
        ("changed", "why", "gates", "affected", "rollback"), True)}, out
    card = json.loads((home / "demo" / "card.json").read_text())
    assert card["version"]["name"] == "v2" and card["changed"]["parent"] == "v1"
    # v2's weights served its round and the memory round's sessions (8 taught, 16 questions to each tenant).
    assert card["rollback"]["restores"] == "v1" and card["affected"]["sessions"] == sessions[-1] + 8 + 2 * 16, out
    assert (home / "demo" / "card.md").read_text().startswith("# Version v2 (serving)")
    assert "replay [passed]" in out and "# Version v2 (serving)" in out
    png = home / "demo" / "reward_per_version.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "held-out success" in out and "atdp demo --psql" in out and "SELECT" in out
    # One round of each other layer: a memory version proposed from 8 users' corrections and a harness
    # version from an operator's overlay, each through the replay and safety gates; with the demo's
    # canary share set, one that passes serves half of its tenant's new sessions. (Whether the tiny
    # model gains from either is not the point: bench/memory_learning.py measures memory on SmolLM2.)
    layers = {r["layer"]: r for r in summary["layers"]}
    assert set(layers) == {"memory", "harness"}, summary["layers"]
    assert layers["memory"]["version"] == "m1" and layers["harness"]["version"] == "h1"
    for r in layers.values():
        g = r["gates"]
        assert g["replay_state"] in ("passed", "failed") and g["cases"] >= 4 and g["safety_state"], r
        if g["replay_state"] == "failed":
            assert r["status"] == "rejected" and g["canary_state"] is None, r
        else:  # in its canary, or decided by the users' rewards (the memory round posts them)
            canary = {"canary": "running", "serving": "passed", "rolled_back": "failed"}
            assert g["canary_state"] == canary[r["status"]], r
    assert layers["memory"]["gates"]["suite_cases"] == 8
    m = layers["memory"]["measured"]
    assert m["asked"] == 16 and m["taught"]["memory"]["n"] + m["taught"]["without_memory"]["n"] == 8
    assert m["memory_applied"] == (m["taught"]["memory"]["n"] + m["untaught"]["memory"]["n"])
    assert "m1 (memory) replay [" in out and "h1 (harness) replay [" in out and "with memory" in out
    # demo-results.json: every version (base included) was evaluated on the same held-out tasks, with
    # its interval and tool-call validity, next to its training reward. (Whether the tiny random model
    # learns is not the point here: the learning figures are the SmolLM2 demo's, docs/demo.md.)
    results = json.loads((home / "demo" / "demo-results.json").read_text())
    assert results["heldout"]["tasks"] == 16 and results["heldout"]["split"] == "heldout"
    assert [v["version"] for v in results["versions"]] == ["base", "v1", "v2"]
    for v in results["versions"]:
        h = v["heldout"]
        assert h["tasks"] == 16 and h["errors"] == 0, v
        assert 0 <= h["solved"] <= h["valid_calls"] <= 16 and h["success"] == h["solved"] / 16
        lo, hi = h["ci95"]
        assert 0.0 <= lo <= h["success"] <= hi <= 1.0 and hi - lo > 0.1
        assert h["tool_call_validity"] == h["valid_calls"] / 16
        assert v["training_reward"] == pytest.approx(next(x["mean_reward"] for x in summary["versions"]
                                                          if x["version"] == v["version"]))
    assert set(results["gain"]) == {"base", "best", "points", "intervals_overlap"}
    assert {"heldout_base", "round0_heldout", "round1_heldout"} <= set(results["timings_s"])
    assert out.count("held-out: solved") == 3
    _assert_all_stopped(home)

    # What the demo printed can be run: psql on the stored demo database.
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATDP_")}
    q = subprocess.run([sys.executable, "-m", "proxy.cli", "demo", "--home", str(home), "--psql",
                        "SELECT count(*) FROM feedback f JOIN sessions s ON s.id = f.session_id "
                        "WHERE s.tenant_id = 'demo'"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert q.returncode == 0, q.stderr
    assert str(sum(sessions)) in q.stdout.split()
    # The gate rows in the store: each candidate's replay and safety gates finished as passed, the
    # canary skipped.
    q = subprocess.run([sys.executable, "-m", "proxy.cli", "demo", "--home", str(home), "--psql",
                        "SELECT v.name || ':' || g.gate || ':' || g.state || ':' || (g.finished_at IS NOT NULL) "
                        "FROM version_gates g JOIN model_versions v ON v.id = g.version_id ORDER BY 1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert q.returncode == 0, q.stderr
    rows = [x.strip() for x in q.stdout.splitlines() if x.strip().startswith("v")]
    assert rows == [f"{v}:{g}:{s}:true" for v in ("v1", "v2")
                    for g, s in (("canary", "skipped"), ("replay_eval", "passed"), ("safety", "passed"))], q.stdout
    assert not (home / "pg" / "postmaster.pid").exists()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(900)  # the wait below fails first, with the demo's output
def test_ctrl_c_stops_every_process_the_demo_started(tmp_path):
    home = tmp_path / "home"
    # The small evaluations of the full run: the default 96 held-out tasks (sampled and greedy) before
    # round 1 took a slow 2-core CI machine past ten minutes before the first swap.
    proc = _demo(home, "--rounds", "3", "--eval-cases", "4", "--heldout-tasks", "16")
    lines: list[str] = []
    swapped = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "swap -> v1" in line:
                swapped.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert swapped.wait(600), "".join(lines)
        time.sleep(1.0)  # into round 2: vLLM, proxy and agent busy
        proc.send_signal(signal.SIGINT)
        assert proc.wait(90) == 130, "".join(lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(5)
    assert any("interrupted" in line for line in lines), "".join(lines)
    _assert_all_stopped(home)
