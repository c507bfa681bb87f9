"""`atdp train --when diagnosed`: update only while the diagnosis recommends a policy update.

The diagnosis (proxy.evolve.diagnose) says where a problem is best fixed. A tool that keeps failing
is fixed in the harness and facts users keep supplying belong in memory; training on that traffic
would teach the model around a broken tool. So under this gate the trainer waits until a finding
names the policy layer (failures spread across tenants, tasks and tools, a reward decline, drift).
The diagnosis is re-read at most every `recheck_s` while the trainer polls.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from sqlalchemy.orm import Session

from proxy.evolve.diagnose import diagnose
from proxy.evolve.rules import Rules

log = logging.getLogger("atdp.trainer")


@dataclass
class DiagnosisGate:
    rules: Rules
    recheck_s: float = 60.0
    checked_at: float | None = None  # monotonic time of the last diagnosis
    held: str | None = None  # why training waits (None: a policy update is recommended)

    def __call__(self, s: Session) -> str | None:
        """None when training may go ahead, else the reason it waits."""
        now = time.monotonic()
        if self.checked_at is None or now - self.checked_at >= self.recheck_s:
            d = diagnose(s, self.rules)
            policy = [f for f in d.findings if f.layer == "policy"]
            self.held = None if policy else (
                f"diagnosis recommends no policy update (top layer: {d.recommendation or 'none, nothing to fix'})")
            self.checked_at = now
            log.info("diagnosis gate: %s", f"train ({policy[0].title})" if policy else self.held)
        return self.held
