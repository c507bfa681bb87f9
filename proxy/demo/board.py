"""What the demo shows: live progress per version, the reward table, the plot and the closing report."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.demo.home import libpq_url, psql_path


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
