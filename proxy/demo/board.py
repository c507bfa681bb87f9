"""What the demo shows: live progress per version, the reward table, the plot and the closing report."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.demo.agent import Evaluation
from proxy.demo.home import libpq_url, psql_path
from proxy.demo.skill import wilson


@dataclass
class VersionStats:
    """One version: the training sessions it served (sampled, through the proxy) and its held-out
    evaluation (greedy, straight against vLLM)."""

    name: str
    sessions: int = 0
    errors: int = 0
    rewards: list[float] = field(default_factory=list)
    valid: int = 0  # turn 1 held a well-formed lookup(...) call
    right: int = 0  # ...naming the task's item
    solved: int = 0
    last_reply: str = ""
    heldout: Evaluation | None = None  # sampled at the demo's temperature, fixed seeds (the headline)
    heldout_greedy: Evaluation | None = None

    def add(self, attempt) -> None:
        if attempt.outcome is None:
            self.errors += 1
            return
        self.sessions += 1
        self.rewards.append(attempt.outcome.reward)
        self.valid += attempt.outcome.valid_call
        self.right += attempt.outcome.right_item
        self.solved += attempt.outcome.solved
        self.last_reply = attempt.call_reply + (" | " + attempt.answer if attempt.answer is not None else "")

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

    def heldout_dict(self, greedy: bool = False) -> dict[str, Any] | None:
        h = self.heldout_greedy if greedy else self.heldout
        if h is None:
            return None
        lo, hi = wilson(h.solved, h.tasks)
        return {"tasks": h.tasks, "solved": h.solved, "success": h.solved / h.tasks if h.tasks else None,
                "ci95": [lo, hi], "valid_calls": h.valid_calls, "tool_call_validity": h.valid_calls / max(h.tasks, 1),
                "right_item": h.right_items, "errors": h.errors, "seconds": round(h.seconds, 1)}

    def as_dict(self) -> dict[str, Any]:
        n = max(self.sessions, 1)
        return {"version": self.name, "sessions": self.sessions, "training_reward": self.mean if self.rewards else None,
                "training_reward_stderr": self.stderr, "training_tool_call_validity": self.valid / n,
                "training_right_item": self.right / n, "training_solved": self.solved / n, "heldout": self.heldout_dict(),
                "heldout_greedy": self.heldout_dict(greedy=True)}


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
            self.note(f"{version}: {st.sessions} training sessions, reward {st.mean:.3f}, "
                      f"valid tool calls {st.valid}/{st.sessions}, right item {st.right}/{st.sessions}"
                      + (f", {st.errors} failed" if st.errors else ""))

    def heldout(self, version: str, ev: Evaluation, *, greedy: bool = False) -> None:
        st = self.versions.setdefault(version, VersionStats(version))
        if greedy:
            st.heldout_greedy = ev
        else:
            st.heldout = ev
        lo, hi = wilson(ev.solved, ev.tasks)
        self.note(f"{version} held-out{' (greedy)' if greedy else ''}: solved {ev.solved}/{ev.tasks} ({ev.solved / max(ev.tasks, 1):.0%}, 95% "
                  f"[{lo:.0%}, {hi:.0%}]), valid tool calls {ev.valid_calls}/{ev.tasks}, {ev.seconds:.0f} s"
                  + (f", {ev.errors} failed" if ev.errors else ""))

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

    table = Table(title=None if live else "per version: training reward and held-out success", show_edge=not live)
    for col in ("version", "sessions", "training reward", "valid calls", "held-out solved", "95% interval",
                "held-out valid calls", "held-out greedy"):
        table.add_column(col, justify="left" if col == "version" else "right")
    if live:
        table.add_column("last attempt", overflow="ellipsis", no_wrap=True, max_width=40)
    for st in rows:
        n = max(st.sessions, 1)
        h = st.heldout_dict()
        cells = [st.name, str(st.sessions), f"{st.mean:.3f} ± {st.stderr:.3f}" if st.rewards else "-",
                 f"{100 * st.valid / n:.0f}%" if st.sessions else "-",
                 f"{h['solved']}/{h['tasks']} ({100 * h['success']:.0f}%)" if h else "-",
                 f"[{100 * h['ci95'][0]:.0f}%, {100 * h['ci95'][1]:.0f}%]" if h else "-",
                 f"{100 * h['tool_call_validity']:.0f}%" if h else "-",
                 f"{st.heldout_greedy.solved}/{st.heldout_greedy.tasks}" if st.heldout_greedy else "-"]
        if live:
            cells.append(escape(repr(st.last_reply[:60])))
        table.add_row(*cells)
    return table


# One row per session (its first step's version): a two-turn attempt has two steps but one reward.
SQL_REWARD_PER_VERSION = """\
SELECT x.version, count(*) AS sessions, avg(x.reward) AS mean_reward
FROM (SELECT DISTINCT ON (st.session_id) st.model_version AS version, f.reward, st.started_at
      FROM steps st
      JOIN sessions se ON se.id = st.session_id AND se.tenant_id = 'demo'
      JOIN feedback f ON f.session_id = st.session_id AND f.step_id IS NULL AND f.reward IS NOT NULL
      ORDER BY st.session_id, st.started_at) x
GROUP BY x.version
ORDER BY min(x.started_at)"""


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

    from proxy.store import db

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
    evaluated = [(x, r.heldout_dict()) for x, r in zip(xs, rows, strict=True) if r.heldout is not None]
    if evaluated:
        ex = [x for x, _ in evaluated]
        ys = [h["success"] for _, h in evaluated]
        err = [[y - h["ci95"][0] for y, (_, h) in zip(ys, evaluated, strict=True)],
               [h["ci95"][1] - y for y, (_, h) in zip(ys, evaluated, strict=True)]]
        ax.errorbar(ex, ys, yerr=err, marker="o", capsize=4, label="held-out success, sampled (95% Wilson interval)")
    greedy = [(x, r.heldout_dict(greedy=True)) for x, r in zip(xs, rows, strict=True) if r.heldout_greedy is not None]
    if greedy:
        ax.plot([x for x, _ in greedy], [h["success"] for _, h in greedy], marker="^", linestyle=":",
                label="held-out success, greedy")
    trained = [(x, r) for x, r in zip(xs, rows, strict=True) if r.rewards]
    ax.errorbar([x for x, _ in trained], [r.mean for _, r in trained], yerr=[r.stderr for _, r in trained],
                marker="s", linestyle="--", capsize=3, label="training reward (sampled, ± s.e.)")
    ax.set_xticks(xs, [r.name for r in rows])
    ax.set_xlabel("model version (each one trainer update)")
    ax.set_ylim(0, 1.05)
    ax.set_title("atdp demo: lookup-tool task, held-out success per version")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")  # the greedy line runs along the top
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def merge_stats(live: dict[str, VersionStats], stored: list[dict[str, Any]]) -> list[VersionStats]:
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


def last_update(url: str) -> dict[str, Any]:
    """The newest training update's metrics (written by the trainer)."""
    from sqlalchemy import select

    from proxy.store import db
    from proxy.store import tables as t

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

    from proxy.store import db

    engine = db.make_engine(url, pool_size=1, max_overflow=0)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text(SQL_REWARD_PER_VERSION)).mappings().all()
            return [dict(r) for r in rows]
    finally:
        engine.dispose()
