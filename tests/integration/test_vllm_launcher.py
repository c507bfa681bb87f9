"""The launcher's own mechanics, without paying for a vLLM start-up (test_engine.py does that)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from proxy.demo.vllm import VLLMServer, VLLMStartError, default_vllm_venv, find_vllm_python, free_port

REPO = Path(__file__).resolve().parents[2]


def test_default_venv_matches_the_bootstrap_script(monkeypatch):
    monkeypatch.delenv("ATDP_VLLM_VENV", raising=False)
    env = {k: v for k, v in os.environ.items() if k != "ATDP_VLLM_VENV"}
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "vllm_env.sh"), "--path"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(default_vllm_venv() / "bin" / "python")


def test_find_vllm_python_honours_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ATDP_VLLM_PYTHON", sys.executable)
    assert find_vllm_python() == sys.executable
    monkeypatch.setenv("ATDP_VLLM_PYTHON", str(tmp_path / "missing"))
    assert find_vllm_python() is None
    # A venv without the ready marker is an unfinished build: not offered.
    monkeypatch.delenv("ATDP_VLLM_PYTHON")
    monkeypatch.setenv("ATDP_VLLM_VENV", str(tmp_path / "venv"))
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").symlink_to(sys.executable)
    assert find_vllm_python() is None
    (tmp_path / "venv" / ".atdp-ready").write_text("spec\n")
    assert find_vllm_python() == str(tmp_path / "venv" / "bin" / "python")


def test_failed_start_reports_the_log_tail(tmp_path):
    # This interpreter has no vllm: the server exits at once, and the error must say why.
    server = VLLMServer(python=sys.executable, model_dir=tmp_path, log_path=tmp_path / "vllm.log")
    server.start()
    with pytest.raises(VLLMStartError) as err:
        server.wait_ready(timeout=30)
    message = str(err.value)
    assert "exited with code 1" in message
    assert str(tmp_path / "vllm.log") in message
    assert "No module named 'vllm'" in message
    server.stop()


def test_a_dead_engine_report_shows_the_engine_core_traceback_above_the_api_servers(tmp_path):
    # vLLM logs the engine core's traceback first; the API server's EngineDeadError traceback ("see the
    # stack trace above") follows and fills the tail. The report must carry the first one.
    log = tmp_path / "vllm.log"
    core = "(EngineCore_DP0 pid=7) ERROR 12-03 17:27:33 [core.py:1512]"
    api = "(APIServer pid=5) ERROR 12-03 17:27:33 [vllm_error.py:54]"
    log.write_text("\n".join([
        "(APIServer pid=5) INFO 12-03 17:20:00 [api_server.py:1] Application startup complete.",
        "(EngineCore_DP0 pid=7) INFO 12-03 17:21:00 [core.py:1] Aborted request chatcmpl-1.",
        f"{core} EngineCore encountered a fatal error.",
        f"{core} Traceback (most recent call last):",
        f"{core} RuntimeError: the root cause",
        *(f"{api}   frame {i}" for i in range(120)),
        f"{api} vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
    ]) + "\n")
    server = VLLMServer(python=sys.executable, model_dir=tmp_path, log_path=log)
    server.start()
    with pytest.raises(VLLMStartError) as err:
        server.wait_ready(timeout=30)
    message = str(err.value)
    account = message.split("--- the engine's account ---", 1)[1].split("--- last lines ---", 1)[0]
    assert "EngineCore encountered a fatal error" in account and "RuntimeError: the root cause" in account
    assert "Aborted request" not in account
    assert "No module named 'vllm'" in message.split("--- last lines ---", 1)[1]  # the tail is still there
    server.stop()


ENGINE = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(sys.argv[1] + ".tmp", "w").write(str(os.getpid()))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])  # announce only once SIGTERM is ignored
time.sleep(600)
"""

FAKE_SERVER = """
import http.server, os, subprocess, sys, time

# Stands in for vLLM's API server: forks an engine process that ignores SIGTERM into the same
# process group (as vLLM forks its EngineCore), waits until it is set up, then answers /health.
port = int(sys.argv[sys.argv.index("--port") + 1])
pid_file = sys.argv[sys.argv.index("--model") + 1] + "/engine.pid"
subprocess.Popen([sys.executable, "-c", os.environ["FAKE_ENGINE"], pid_file])
while not os.path.exists(pid_file):
    time.sleep(0.01)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_stop_ends_the_whole_process_group(tmp_path):
    # vLLM itself cannot be made to leave a SIGTERM-deaf engine behind on demand; a stand-in can.
    package = tmp_path / "fake" / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for folder in (package, package.parent, package.parent.parent):
        (folder / "__init__.py").write_text("")
    (package / "api_server.py").write_text(textwrap.dedent(FAKE_SERVER))
    model_dir = tmp_path / "model"
    model_dir.mkdir()

    server = VLLMServer(
        python=sys.executable,
        model_dir=model_dir,
        port=free_port(),
        env={"PYTHONPATH": str(tmp_path / "fake"), "FAKE_ENGINE": ENGINE},
        log_path=tmp_path / "fake.log",
    )
    with server:
        assert server.base_url.endswith(f":{server.port}")
        engine_pid = int((model_dir / "engine.pid").read_text())
        os.kill(engine_pid, 0)  # alive while the server runs
        grace = 1.0
        started = time.monotonic()
        server.stop(grace=grace)
    # stop() waits at most grace for the leader, grace for the group, then 5 s after SIGKILL; the
    # rest is slack for a loaded machine. Without the SIGKILL step it would wait the default 20 s grace.
    assert time.monotonic() - started < 2 * grace + 5 + 5
    assert not _running(engine_pid)
    server.stop()  # idempotent


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed orphan stays a zombie until init reaps it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
