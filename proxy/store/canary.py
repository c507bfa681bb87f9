"""Gate 3's rows: the canary, its sticky session assignment, and the live numbers of each arm.

A canary compares a candidate with the version serving when it began, on *new* sessions only: a
session that starts while the canary runs is assigned once, by a sticky hash of (canary, tenant,
session id), to the `candidate` arm (the hash under `fraction`, or the tenant named in `tenants`) or
to the `serving` arm; a session that had begun before is `before` (served by the serving version,
left out of the comparison). The assignment is a row of `canary_sessions`, written by the first
call that needs it, so it survives a restart and is the same on every proxy.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select, text, update
from sqlalchemy.orm import Session, sessionmaker

from proxy.store import tables as t

CANDIDATE, SERVING, BEFORE = "candidate", "serving", "before"


NO_VERSION = "none"  # a harness or memory canary's serving arm where no version of its layer served


@dataclass(frozen=True)
class CanaryRef:
    version_id: str
    candidate: str  # the candidate's name (what its replicas stamp on steps)
    serving_id: str | None  # None: a harness or memory canary against no version of its layer
    serving: str
    fraction: float
    tenants: tuple[str, ...]
    replicas: tuple[str, ...]  # public labels of the replicas that serve the candidate
    started_at: datetime
    margins: dict[str, Any] = field(default_factory=dict)


def bucket(version_id: str, tenant: str, session_id: str) -> float:
    """The session's place in [0, 1): the first 32 bits of md5(canary/tenant/session) over 2^32.
    Salted with the canary, so each canary draws its own sessions."""
    digest = hashlib.md5(f"{version_id}/{tenant}/{session_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32


def arm_of_new_session(ref: CanaryRef, tenant: str, session_id: str) -> str:
    if tenant in ref.tenants:
        return CANDIDATE
    return CANDIDATE if bucket(ref.version_id, tenant, session_id) < ref.fraction else SERVING


def _ref(s: Session, row: t.Canary) -> CanaryRef:
    names = dict(s.execute(select(t.ModelVersion.id, t.ModelVersion.name)
                           .where(t.ModelVersion.id.in_([row.version_id, row.serving_id or row.version_id]))).all())
    serving = names[row.serving_id] if row.serving_id is not None else NO_VERSION
    return CanaryRef(row.version_id, names[row.version_id], row.serving_id, serving, row.fraction,
                     tuple(row.tenants), tuple(row.replicas), row.started_at, dict(row.margins))


def active_canary(s: Session) -> CanaryRef | None:
    """The weight version's canary that runs (one at a time; harness and memory canaries: canary_of)."""
    row = s.scalars(select(t.Canary).join(t.ModelVersion, t.ModelVersion.id == t.Canary.version_id)
                    .where(t.Canary.decided_at.is_(None), t.ModelVersion.layer == "policy")
                    .order_by(t.Canary.started_at.desc()).limit(1)).first()
    return _ref(s, row) if row else None


def canary_of(s: Session, version_id: str) -> CanaryRef | None:
    """The undecided canary of this version, if it is in one."""
    row = s.scalars(select(t.Canary).where(t.Canary.version_id == version_id, t.Canary.decided_at.is_(None))).first()
    return _ref(s, row) if row else None


def start_canary(s: Session, *, version_id: str, serving_id: str | None, fraction: float, tenants: list[str],
                 replicas: list[str], margins: dict[str, Any]) -> CanaryRef:
    row = t.Canary(version_id=version_id, serving_id=serving_id, fraction=fraction, tenants=tenants, replicas=replicas,
                   margins=margins, started_at=datetime.now(UTC), numbers={})
    s.add(row)
    s.flush()
    return _ref(s, row)


def assign(s: Session, ref: CanaryRef, tenant: str, session_id: str, *, continues: bool) -> str:
    """The session's arm: the stored one, else assigned now (`before` when the call continues an
    earlier step or the session was stored before the canary began)."""
    arm = BEFORE if continues else arm_of_new_session(ref, tenant, session_id)
    s.execute(text("""
        INSERT INTO canary_sessions (version_id, tenant_id, session_id, arm, assigned_at)
        SELECT CAST(:v AS varchar), CAST(:t AS varchar), CAST(:s AS varchar),
               CASE WHEN EXISTS (SELECT 1 FROM sessions se
                                  WHERE se.tenant_id = CAST(:t AS varchar) AND se.external_id = CAST(:s AS varchar)
                                    AND se.started_at < CAST(:started AS timestamptz)) THEN 'before'
                    ELSE CAST(:arm AS varchar) END,
               now()
        ON CONFLICT (version_id, tenant_id, session_id) DO NOTHING"""),
              {"v": ref.version_id, "t": tenant, "s": session_id, "arm": arm, "started": ref.started_at})
    return s.scalar(select(t.CanarySession.arm).where(t.CanarySession.version_id == ref.version_id,
                                                       t.CanarySession.tenant_id == tenant,
                                                       t.CanarySession.session_id == session_id))


def assign_now(factory: sessionmaker[Session], ref: CanaryRef, tenant: str, session_id: str, *, continues: bool
               ) -> str:
    """`assign` in a transaction of its own (a call's first step of a canary: blocking, run on a thread)."""
    with factory() as s, s.begin():
        return assign(s, ref, tenant, session_id, continues=continues)


def finish_canary(s: Session, version_id: str, decision: str, numbers: dict[str, Any]) -> None:
    s.execute(update(t.Canary).where(t.Canary.version_id == version_id)
              .values(decided_at=datetime.now(UTC), decision=decision, numbers=numbers))


# --- what each arm did (the decision's inputs and the live metrics) --------------------------------

ARM_SESSIONS = """
    SELECT cs.arm, se.id AS sid
      FROM canary_sessions cs
      JOIN sessions se ON se.tenant_id = cs.tenant_id AND se.external_id = cs.session_id
     WHERE cs.version_id = :v AND cs.arm IN ('candidate', 'serving')
"""


def rewards_in_order(s: Session, version_id: str) -> list[tuple[str, str, float]]:
    """(arm, tenant, reward) per rewarded session, in the order the sessions' first rewards arrived. A
    session's observation is its first reward (fixed once seen: the stream never changes behind the test)."""
    rows = s.execute(text(f"""
        WITH a AS ({ARM_SESSIONS})
        SELECT arm, tenant_id, reward FROM (
            SELECT DISTINCT ON (a.sid) a.arm, f.tenant_id, f.reward, f.created_at, f.id
              FROM a JOIN feedback f ON f.session_id = a.sid AND f.reward IS NOT NULL
             ORDER BY a.sid, f.created_at, f.id) first
         ORDER BY created_at, id"""), {"v": version_id}).all()
    return [(arm, tenant, float(r)) for arm, tenant, r in rows]


def step_outcomes(s: Session, version_id: str) -> list[tuple[str, float]]:
    """(arm, 1 if the call failed else 0) per finished call (aborted calls, the client's doing, are left out)."""
    rows = s.execute(text(f"""
        WITH a AS ({ARM_SESSIONS})
        SELECT a.arm, (st.status = 'error')::int FROM a JOIN steps st ON st.session_id = a.sid
         WHERE st.status IN ('ok', 'error')"""), {"v": version_id}).all()
    return [(arm, float(x)) for arm, x in rows]


def tool_outcomes(s: Session, version_id: str) -> list[tuple[str, float]]:
    """(arm, 1 if the tool's result was an error else 0) per tool call whose result came back."""
    rows = s.execute(text(f"""
        WITH a AS ({ARM_SESSIONS})
        SELECT a.arm, tc.is_error::int FROM a JOIN tool_calls tc ON tc.session_id = a.sid
         WHERE tc.is_error IS NOT NULL"""), {"v": version_id}).all()
    return [(arm, float(x)) for arm, x in rows]


def arm_metrics(s: Session, version_id: str) -> dict[str, dict[str, Any]]:
    """Per arm: sessions, steps, the versions its steps were served by, error rate, p99 latency (ms),
    tokens per session."""
    rows = s.execute(text(f"""
        WITH a AS ({ARM_SESSIONS}),
             per AS (SELECT a.arm, a.sid, sum(st.prompt_tokens + st.completion_tokens) AS tokens
                       FROM a JOIN steps st ON st.session_id = a.sid GROUP BY a.arm, a.sid)
        SELECT a.arm,
               count(DISTINCT a.sid) AS sessions,
               count(st.id) AS steps,
               avg((st.status = 'error')::int) FILTER (WHERE st.status IN ('ok', 'error')) AS error_rate,
               percentile_cont(0.99) WITHIN GROUP (ORDER BY st.total_ms) AS p99_ms,
               (SELECT avg(tokens) FROM per WHERE per.arm = a.arm) AS tokens_per_session
          FROM a
          LEFT JOIN steps st ON st.session_id = a.sid
         GROUP BY a.arm"""), {"v": version_id}).mappings().all()
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        out[r["arm"]] = {"sessions": r["sessions"], "steps": r["steps"],
                         "error_rate": _f(r["error_rate"]), "p99_ms": _f(r["p99_ms"]),
                         "tokens_per_session": _f(r["tokens_per_session"])}
    for arm, versions in served_versions(s, version_id).items():
        out.setdefault(arm, {})["served_by"] = versions
    return out


def served_versions(s: Session, version_id: str) -> dict[str, dict[str, int]]:
    """Per arm, how many steps each version served (a sticky canary has one version per arm)."""
    rows = s.execute(text(f"""
        WITH a AS ({ARM_SESSIONS})
        SELECT a.arm, coalesce(st.model_version, '?'), count(*) FROM a JOIN steps st ON st.session_id = a.sid
         GROUP BY 1, 2"""), {"v": version_id}).all()
    out: dict[str, dict[str, int]] = {}
    for arm, version, n in rows:
        out.setdefault(arm, {})[version] = n
    return out


def _f(x: Any) -> float | None:
    return None if x is None else round(float(x), 4)


def mark_rolled_back(s: Session, version_id: str, reasons: list[str], *, actor: str) -> int:
    """The canary was rolled back: status `rolled_back` with the reasons. It never served everyone, so
    like a rejected candidate its steps are released for a later update; returns how many."""
    s.execute(update(t.ModelVersion).where(t.ModelVersion.id == version_id)
              .values(status="rolled_back", error="; ".join(reasons)[:4000], retired_at=datetime.now(UTC)))
    released = s.execute(update(t.Step).where(t.Step.trained_version_id == version_id)
                         .values(trained_version_id=None)).rowcount
    s.add(t.AuditEvent(actor=actor, action="version.canary_rollback", target=version_id,
                       details={"reasons": reasons[:20], "released_steps": released}))
    return released
