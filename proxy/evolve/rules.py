"""The diagnosis rules: every threshold `atdp diagnose` applies, with its documented default.

Operators change them in a TOML file named by `ATDP_DIAGNOSIS_FILE` (or `atdp diagnose --rules FILE`):
top-level keys with the field names below. Unknown keys and values out of range are refused, so a
typo never silently leaves a default in force. docs/diagnosis.md explains each rule.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path

LAYERS = ("harness", "memory", "policy")


class RulesError(ValueError):
    pass


@dataclass(frozen=True)
class Rules:
    # Scope: the traffic diagnosed (sessions started in the last `window_days`), and how much is read.
    window_days: float = 7.0
    max_rows: int = 50_000  # per signal: a bound on what one diagnosis reads
    examples: int = 5  # example session ids per finding
    # Tool failures. A cluster is (tool, error signature); below `min_failures` it is noise.
    min_failures: int = 3
    # harness: one tool holds at least this share of all tool failures, and fails this often.
    concentration_share: float = 0.5
    min_failure_rate: float = 0.2
    # policy: failures spread over at least this many tools, tasks and tenants, none concentrated.
    spread_min_tools: int = 2
    spread_min_tasks: int = 2
    spread_min_tenants: int = 2
    # Tool-call arguments that violate the declared JSON schema (harness when at least this many).
    min_schema_violations: int = 3
    # User corrections: a finding from this rate of sessions corrected (and at least `min_corrections`);
    # memory when at least `fact_share` of the corrections supply facts, else policy.
    min_correction_rate: float = 0.1
    min_corrections: int = 3
    fact_share: float = 0.5
    # Reward trend per tenant and task: a drop of at least `min_reward_drop` between the earlier and
    # the later half of the window (or the previous and the latest version), each with enough sessions.
    min_reward_drop: float = 0.2
    min_trend_sessions: int = 4
    # Cost: tokens per session above this budget (0: no budget), or grown by this share window-on-window.
    max_tokens_per_session: int = 0
    max_cost_growth: float = 0.5
    min_cost_sessions: int = 4
    # harness rather than policy when prompt tokens are at least this share of a session's tokens.
    prompt_share_harness: float = 0.8
    # Drift: population stability index of recent traffic against the last training window.
    drift_psi: float = 0.2
    min_drift_steps: int = 20

    def check(self) -> Rules:
        for name in ("concentration_share", "min_failure_rate", "fact_share", "prompt_share_harness",
                     "min_correction_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise RulesError(f"{name} must be within [0, 1]")
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise RulesError(f"{f.name} must not be negative")
        if self.window_days <= 0 or self.max_rows < 1:
            raise RulesError("window_days and max_rows must be positive")
        return self


def rules_from_mapping(values: dict[str, object], base: Rules | None = None) -> Rules:
    """Rules with `values` over `base` (default: the defaults), checked."""
    base = base or Rules()
    known = {f.name: f for f in fields(Rules)}
    changes: dict[str, float | int] = {}
    for key, value in values.items():
        if key not in known:
            raise RulesError(f"unknown diagnosis rule {key!r}")
        want = type(getattr(base, key))
        if isinstance(value, bool) or not isinstance(value, int | float) or (want is int and not isinstance(value, int)):
            raise RulesError(f"{key} must be a{'n integer' if want is int else ' number'}")
        changes[key] = want(value)
    return replace(base, **changes).check()


def load_rules(path: Path | None) -> Rules:
    """The rules of a TOML file (None: the defaults)."""
    if path is None:
        return Rules()
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise RulesError(f"cannot read diagnosis rules {path}: {e}") from None
    return rules_from_mapping(data.get("diagnosis", data))
