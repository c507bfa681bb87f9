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
    proc = _demo(home, "--rounds", "2")
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
