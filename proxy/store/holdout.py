"""The evaluation split: a deterministic share of sessions, per tenant and task, the trainer never sees.

A session is held out when the first 32 bits of md5(tenant / task / session id), as a fraction of
2^32, fall below the tenant's `eval_holdout` share. The same rule is written twice: in Python (to
list the held-out sessions for the replay gate) and in SQL (so the trainer's lease query excludes
them); a test checks the two agree. md5 here is a bucketing hash, not a security measure.
"""

from __future__ import annotations

import hashlib

from sqlalchemy import BigInteger, ColumnElement, Float, and_, case, cast, false, func, literal
from sqlalchemy.dialects.postgresql import BIT

from proxy.store import tables as t

BUCKETS = 2**32


def bucket_key(tenant: str, task: str | None, session_id: str) -> str:
    return f"{tenant}/{task or ''}/{session_id}"


def bucket(tenant: str, task: str | None, session_id: str) -> float:
    """The session's place in [0, 1)."""
    digest = hashlib.md5(bucket_key(tenant, task, session_id).encode()).hexdigest()
    return int(digest[:8], 16) / BUCKETS


def held_out(tenant: str, task: str | None, session_id: str, share: float) -> bool:
    return share > 0 and bucket(tenant, task, session_id) < share


def _sql_bucket() -> ColumnElement[float]:
    key = func.concat(t.Session.tenant_id, "/", func.coalesce(t.Session.task_id, ""), "/", t.Session.id)
    bits = cast(literal("x").concat(func.substr(func.md5(key), 1, 8)), BIT(32))
    return cast(cast(bits, BigInteger), Float) / BUCKETS


def held_out_sql(shares: dict[str, float], default: float) -> ColumnElement[bool]:
    """True for sessions (`t.Session` in the query) held out under per-tenant `shares`, else `default`."""
    share = case(*((t.Session.tenant_id == tenant, literal(v)) for tenant, v in shares.items()),
                 else_=literal(default)) if shares else literal(default)
    if default <= 0 and not any(v > 0 for v in shares.values()):
        return false()
    return and_(share > 0, _sql_bucket() < share)


