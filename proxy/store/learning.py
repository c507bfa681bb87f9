"""Reward and held-out score per model version: the numbers behind the console's learning chart.

Reward: the sessions a version served (a step whose first output token it produced), each counted once
with the mean of its session-scoped rewards; the version's figure is the mean over those sessions.
Held-out score: the replay gate's numbers (`version_gates`, gate `replay_eval`): the candidate's and
the serving version's mean score on the held-out cases, their paired difference and its interval.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from proxy.store.versions import REPLAY_GATE

_REWARDS = """
WITH served AS (
    SELECT DISTINCT st.model_version AS version, st.session_id FROM steps st
     WHERE st.model_version IS NOT NULL {tenant_steps}
), rewarded AS (
    SELECT f.session_id, avg(f.reward) AS reward FROM feedback f
     WHERE f.step_id IS NULL AND f.reward IS NOT NULL {tenant_feedback}
     GROUP BY f.session_id
)
SELECT sv.version, count(*) AS sessions, count(r.reward) AS rewarded, avg(r.reward) AS mean_reward,
       stddev_samp(r.reward) AS std_reward
  FROM served sv LEFT JOIN rewarded r ON r.session_id = sv.session_id
 GROUP BY sv.version
"""

_VERSIONS = """
SELECT v.name, v.status, v.created_at, v.served_at, p.name AS parent, g.state AS gate_state, g.numbers
  FROM model_versions v
  LEFT JOIN model_versions p ON p.id = v.parent_id
  LEFT JOIN version_gates g ON g.version_id = v.id AND g.gate = :gate
 WHERE v.layer = 'policy'
 ORDER BY v.created_at, v.name
"""

HELD_OUT_KEYS = ("n", "candidate_mean", "serving_mean", "diff_mean", "ci_low", "ci_high")


@dataclass
class HeldOut:
    state: str
    n: int
    candidate_mean: float
    serving_mean: float
    diff_mean: float
    ci_low: float
    ci_high: float


@dataclass
class VersionPoint:
    name: str
    status: str
    parent: str | None
    created_at: str
    served_at: str | None
    sessions: int  # sessions this version served (within the tenant asked for)
    rewarded_sessions: int
    mean_reward: float | None
    reward_se: float | None  # standard error of the mean (None under two rewarded sessions)
    held_out: HeldOut | None


def _held_out(state: str | None, numbers: dict[str, Any] | None, tenant: str | None) -> HeldOut | None:
    """The replay gate's comparison: overall, or the tenant's own entry when one tenant is asked for."""
    if state is None or not numbers:
        return None
    block = numbers.get("overall") if tenant is None else (numbers.get("tenants") or {}).get(tenant)
    if not isinstance(block, dict) or any(not isinstance(block.get(k), int | float) for k in HELD_OUT_KEYS):
        return None
    return HeldOut(state=state, n=int(block["n"]), **{k: round(float(block[k]), 6) for k in HELD_OUT_KEYS[1:]})


def _iso(when: datetime | None) -> str | None:
    return when.isoformat() if when is not None else None


def learning(s: Session, tenant: str | None) -> list[dict[str, Any]]:
    """Every version, oldest first, with its reward and held-out score (one tenant's, or everyone's)."""
    where = ("AND st.tenant_id = :tenant", "AND f.tenant_id = :tenant") if tenant is not None else ("", "")
    params = {"tenant": tenant} if tenant is not None else {}
    rewards = {r["version"]: r for r in s.execute(
        text(_REWARDS.format(tenant_steps=where[0], tenant_feedback=where[1])), params).mappings()}
    out: list[dict[str, Any]] = []
    for v in s.execute(text(_VERSIONS), {"gate": REPLAY_GATE}).mappings():
        r = rewards.get(v["name"])
        rewarded = int(r["rewarded"]) if r else 0
        std = r["std_reward"] if r else None
        out.append(asdict(VersionPoint(
            name=v["name"], status=v["status"], parent=v["parent"], created_at=v["created_at"].isoformat(),
            served_at=_iso(v["served_at"]), sessions=int(r["sessions"]) if r else 0, rewarded_sessions=rewarded,
            mean_reward=round(float(r["mean_reward"]), 6) if r and r["mean_reward"] is not None else None,
            reward_se=round(float(std) / rewarded ** 0.5, 6) if std is not None and rewarded >= 2 else None,
            held_out=_held_out(v["gate_state"], v["numbers"], tenant),
        )))
    return out
