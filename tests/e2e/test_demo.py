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

from proxy.demo.agent import BREVITY_WORDS, WRONG_NUMBER, Task, make_tasks, score
from proxy.demo.home import MARKER, prepare_home

ROOT = Path(__file__).resolve().parents[2]


# --- tasks and reward ----------------------------------------------------------------------------


def test_tasks_are_deterministic_distinct_and_grouped_by_round():
    a = make_tasks(8, seed=0, round_no=1)
    assert a == make_tasks(8, seed=0, round_no=1)
    assert a != make_tasks(8, seed=0, round_no=2)
    assert len({t.id for t in a}) == 8
    for t in a:
        x, y = (int(v) for v in t.id.rsplit("-", 1)[1].split("+"))
        assert 1 <= x <= 20 and 1 <= y <= 20
        assert t.answer == x + y
        assert t.prompt == f"What is {x} + {y}? Reply with only the number."
        assert t.id.startswith("demo-r01-")


def test_reward_rule():
    task = Task(id="t", prompt="What is 12 + 7? Reply with only the number.", answer=19)

    def r(reply: str, truncated: bool = False) -> float:
        return score(task, reply, truncated=truncated).reward

    assert r("19") == 1.0
    assert r(" 19.\n") == 1.0
    assert r("20") == WRONG_NUMBER
    assert score(task, "20", truncated=False).bare_number and not score(task, "20", truncated=False).correct
    assert r("19", truncated=True) == 0.0  # cut by max_tokens: the model was still talking
    # Not a bare number: brevity only, always below any bare number.
    assert r("The answer is 19.") == pytest.approx(0.5 * (1 - 4 / BREVITY_WORDS))
    assert r("12 + 7 = 19") == pytest.approx(0.5 * (1 - 5 / BREVITY_WORDS))
    assert r(" ".join(["word"] * BREVITY_WORDS)) == 0.0
    assert r("") == 0.5  # an empty reply is short, but never as good as a number
    assert max(r("19 is it"), r("nineteen")) < WRONG_NUMBER
    assert score(task, "The answer is 19.", truncated=False).words == 4


# --- the gates' evaluation set ---------------------------------------------------------------------


def test_gate_suite_and_evaluator_score_replays_with_the_reward_rule(tmp_path):
    from proxy.demo.gates import EVALUATOR, EvalSuite
    from proxy.evaluation.cases import Answer, load_suites
    from proxy.evaluation.evaluators import Registry

    round_tasks = make_tasks(3, seed=0, round_no=0)
    suite = EvalSuite.create(tmp_path, n_cases=5, seed=0, max_tokens=24, exclude=round_tasks)
    suite.add_rules(round_tasks)
    loaded = load_suites(tmp_path, max_tokens=128)
    assert len(loaded.cases) == 5 and {c.tenant for c in loaded.cases} == {"demo"}
    assert not {c.request["messages"][0]["content"] for c in loaded.cases} & {t.prompt for t in round_tasks}
    assert all(c.request["max_tokens"] == 24 and c.evaluator == EVALUATOR for c in loaded.cases)
    assert sorted(loaded.rules) == sorted(t.id for t in round_tasks)
    assert not list(tmp_path.glob("*.tmp"))

    case = loaded.cases[0]
    answer = case.expected["answer"]
    r = Registry()
    assert r.score(case, Answer(f"{answer}.", finish_reason="stop")) == 1.0
    assert r.score(case, Answer(f"{answer + 1}", finish_reason="stop")) == WRONG_NUMBER
    assert r.score(case, Answer(f"{answer}", finish_reason="length")) == 0.0  # cut at max_tokens
    assert r.score(case, Answer("The answer is 3.")) == pytest.approx(0.5 * (1 - 4 / BREVITY_WORDS))


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
    proc = _demo(home, "--rounds", "2", "--eval-cases", "4", "--eval-holdout", "0.4")
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
    assert all(v["sessions"] == 8 for v in summary["versions"])
    # The store agrees: every session's reward, grouped by the version stamped on its tokens.
    assert [(s["version"], s["sessions"]) for s in summary["stored"]] == [("base", 8), ("v1", 8), ("v2", 8)]
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
    assert card["rollback"]["restores"] == "v1" and card["affected"]["sessions"] == 8
    assert (home / "demo" / "card.md").read_text().startswith("# Version v2 (serving)")
    assert "replay [passed]" in out and "# Version v2 (serving)" in out
    png = home / "demo" / "reward_per_version.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "reward per version" in out and "atdp demo --psql" in out and "SELECT" in out
    _assert_all_stopped(home)

    # What the demo printed can be run: psql on the stored demo database.
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATDP_")}
    q = subprocess.run([sys.executable, "-m", "proxy.cli", "demo", "--home", str(home), "--psql",
                        "SELECT count(*) FROM feedback"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert q.returncode == 0, q.stderr
    assert "24" in q.stdout
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
def test_ctrl_c_stops_every_process_the_demo_started(tmp_path):
    home = tmp_path / "home"
    proc = _demo(home, "--rounds", "3")
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
