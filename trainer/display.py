"""The trainer's progress display: a one-line `rich` status on a terminal, log lines otherwise."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("atdp.trainer")


class Display:
    """A one-line progress display on a terminal (rich); plain log lines otherwise."""

    def __init__(self, *, enabled: bool) -> None:
        self.progress = None
        if enabled:
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
            self.task = self.progress.add_task("starting", total=None)
            self.progress.start()

    def phase(self, text: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, description=text)

    def update(self, update: int, version: str, status: str, m: Mapping[str, Any]) -> None:
        line = (f"update {update} -> {version} [{status}] reward {m.get('reward_mean', float('nan')):.3f}"
                f"±{m.get('reward_std', float('nan')):.3f} loss {m['loss']:.4f} clip {m['clip_frac']:.3f} "
                f"masked {m['masked_frac']:.3f} |Δlogp| {m['mean_abs_logp_diff']:.4f} "
                f"tok/s {m['tokens_per_s']:.0f} steps {m['steps']} stale {m['stale']}")
        log.info(line)
        if self.progress is not None:
            self.progress.console.print(line)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
