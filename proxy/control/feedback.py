"""Rewards, comments and corrections on sessions, and reading sessions back as ATDP JSON.

Routes (session ids are the *public* ids, scoped to the caller's tenant; the admin key sees every
tenant and may narrow with `?tenant=` or `X-ATDP-Tenant`):

- `POST /atdp/v1/sessions/{id}/feedback`: a reward for the session or one step, and/or a comment
  or a correction. Idempotent by `idempotency_key`. Comments and corrections are redacted before
  they are stored; every post is audited.
- `POST /atdp/v1/sessions/{id}/close`: the session ends (it may still receive feedback).
- `GET /atdp/v1/sessions/{id}`: the session as ATDP JSON.
- `GET /atdp/v1/sessions`: the caller's sessions, filtered, newest first, cursor-paginated.

The functions below the routes take a SQLAlchemy session and are called in a worker thread: the
event loop never waits on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import base64
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
from sqlalchemy import and_, exists, func, select, tuple_
from sqlalchemy.exc import IntegrityError, InterfaceError, OperationalError
from sqlalchemy.orm import Session
from starlette.requests import Request
from starlette.responses import Response

from atdp_schema.models import FeedbackSource
from proxy import tables as t
from proxy.auth import Principal
from proxy.content import content_hash
from proxy.errors import ApiError
from proxy.governance import combine_rewards
from proxy.ids import new_id
from proxy.records import feedback_model, session_document
from proxy.tenants import policy_for

FEEDBACK_FIELDS = ("reward", "step_id", "source", "comment", "correction", "idempotency_key")
SOURCES = tuple(s.value for s in FeedbackSource)
MAX_TEXT = 64 * 1024
MAX_LIMIT = 500


# --- routes ----------------------------------------------------------------------------------------


def install(app, state) -> None:
    app.add_api_route("/atdp/v1/sessions", _list_route(state), methods=["GET"])
    app.add_api_route("/atdp/v1/sessions/{session_id}", _get_route(state), methods=["GET"])
    app.add_api_route("/atdp/v1/sessions/{session_id}/feedback", _feedback_route(state), methods=["POST"])
    app.add_api_route("/atdp/v1/sessions/{session_id}/close", _close_route(state), methods=["POST"])


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def _scope_tenant(request: Request, principal: Principal) -> str | None:
    """The tenant a call may see: its own; for the admin key, the one it names (None = all)."""
    if principal.is_admin:
        return request.query_params.get("tenant") or request.headers.get("x-atdp-tenant") or None
    return principal.tenant


async def run_db(state, fn: Callable[[Session], Any]) -> Any:
    """Run `fn(session)` in a worker thread, in one transaction; database trouble becomes a 503."""
    factory = state.factory
    if factory is None:
        raise ApiError(503, "the database is unavailable; try again shortly")

    def work():
        with factory() as s, s.begin():
            return fn(s)

    try:
        return await asyncio.to_thread(work)
    except (OperationalError, InterfaceError):
        raise ApiError(503, "the database is unavailable; try again shortly") from None


def _feedback_route(state):
    async def post_feedback(request: Request) -> Response:
        principal = await state.authenticate(request)
        body = await _read_body(request, state)
        fb = parse_feedback(body)
        tenant = _scope_tenant(request, principal)
        external_id = request.path_params["session_id"]
        # Fail fast (404/422) before paying for redaction.
        session_tenant = await run_db(state, lambda s: find_session(s, external_id, tenant).tenant_id)
        fb.body_hash = content_hash(state.settings.secret, fb.canonical())
        texts = [x for x in (fb.comment, fb.correction) if x is not None]
        if texts:
            redacted = await asyncio.to_thread(redact_texts, state.redactor, session_tenant, texts)
            fb.apply_redaction(redacted)
        try:
            result = await run_db(state, lambda s: create_feedback(s, principal, external_id, tenant, fb))
        except IntegrityError:
            # A concurrent post with the same idempotency key won the race: answer as a replay.
            result = await run_db(state, lambda s: create_feedback(s, principal, external_id, tenant, fb))
        return _json(result)

    return post_feedback


def _close_route(state):
    async def close(request: Request) -> Response:
        principal = await state.authenticate(request)
        tenant = _scope_tenant(request, principal)
        external_id = request.path_params["session_id"]
        return _json(await run_db(state, lambda s: close_session(s, principal, external_id, tenant)))

    return close


def _get_route(state):
    async def get_session(request: Request) -> Response:
        principal = await state.authenticate(request)
        tenant = _scope_tenant(request, principal)
        external_id = request.path_params["session_id"]

        def read(s: Session) -> bytes:
            return session_document(s, find_session(s, external_id, tenant)).model_dump_json().encode()

        return Response(await run_db(state, read), media_type="application/json")

    return get_session


def _list_route(state):
    async def list_route(request: Request) -> Response:
        principal = await state.authenticate(request)
        q = parse_list_query(request.query_params, _scope_tenant(request, principal), all_tenants=principal.is_admin)
        return _json(await run_db(state, lambda s: list_sessions(s, q)))

    return list_route


async def _read_body(request: Request, state) -> Any:
    from proxy.app import read_json

    return await read_json(request, min(state.settings.max_body_bytes, 1024 * 1024))


# --- feedback --------------------------------------------------------------------------------------


@dataclass
class FeedbackIn:
    reward: float | None
    step_id: str | None
    source: str
    comment: str | None
    correction: str | None
    idempotency_key: str | None
    body_hash: str | None = None
    redaction: dict[str, int] | None = None

    def canonical(self) -> dict[str, Any]:
        """What idempotency compares: the request as understood (raw texts, resolved source)."""
        return {"reward": self.reward, "step_id": self.step_id, "source": self.source, "comment": self.comment,
                "correction": self.correction}

    def apply_redaction(self, redacted: list[tuple[str, dict[str, int]]]) -> None:
        counts: dict[str, int] = {}
        it = iter(redacted)
        if self.comment is not None:
            self.comment, c = next(it)
            _add(counts, c)
        if self.correction is not None:
            self.correction, c = next(it)
            _add(counts, c)
        self.redaction = counts


def _add(into: dict[str, int], counts: dict[str, int]) -> None:
    for k, v in counts.items():
        into[k] = into.get(k, 0) + int(v)


def parse_feedback(body: Any) -> FeedbackIn:
    """Validate a feedback body (shape only; range and ids are checked against the store)."""
    if not isinstance(body, dict):
        raise ApiError(422, "feedback body must be a JSON object")
    unknown = sorted(set(body) - set(FEEDBACK_FIELDS))
    if unknown:
        raise ApiError(422, f"unknown feedback fields {unknown}; known: {list(FEEDBACK_FIELDS)}")
    reward = body.get("reward")
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise ApiError(422, f"'reward' must be a finite number, not {reward!r}")
        reward = float(reward)
    for name in ("step_id", "source", "comment", "correction", "idempotency_key"):
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            raise ApiError(422, f"'{name}' must be a string")
        if isinstance(value, str) and len(value) > MAX_TEXT:
            raise ApiError(422, f"'{name}' is longer than {MAX_TEXT} characters")
    key = body.get("idempotency_key")
    if key is not None and not 0 < len(key) <= 256:
        raise ApiError(422, "'idempotency_key' must be 1 to 256 characters")
    comment, correction = body.get("comment"), body.get("correction")
    if reward is None and comment is None and correction is None:
        raise ApiError(422, "feedback needs at least one of 'reward', 'comment', 'correction'")
    source = body.get("source") or ("user_correction" if correction is not None else "human")
    if source not in SOURCES:
        raise ApiError(422, f"'source' must be one of {list(SOURCES)}, not {source!r}")
    return FeedbackIn(reward=reward, step_id=body.get("step_id"), source=source, comment=comment,
                      correction=correction, idempotency_key=key)


def redact_texts(redactor, tenant: str, texts: list[str]) -> list[tuple[str, dict[str, int]]]:
    if hasattr(redactor, "redact_many"):
        return redactor.redact_many([(tenant, x) for x in texts])
    return [redactor.redact_value(x, tenant) for x in texts]


def find_session(s: Session, external_id: str, tenant: str | None) -> t.Session:
    """The session with this public id, in `tenant` (None: any tenant, if the id is unambiguous)."""
    q = select(t.Session).where(t.Session.external_id == external_id)
    if tenant is not None:
        q = q.where(t.Session.tenant_id == tenant)
    rows = s.scalars(q.limit(2)).all()
    if not rows:
        raise ApiError(404, f"session '{external_id}' not found", code="session_not_found")
    if len(rows) > 1:
        raise ApiError(409, f"session id '{external_id}' exists in several tenants; pass ?tenant=")
    return rows[0]


def create_feedback(s: Session, principal: Principal, external_id: str, tenant: str | None, fb: FeedbackIn) -> dict:
    """Store one feedback (or return the earlier one with the same idempotency key) and audit it."""
    session = find_session(s, external_id, tenant)
    if fb.idempotency_key is not None:
        earlier = s.scalar(select(t.Feedback).where(
            t.Feedback.tenant_id == session.tenant_id, t.Feedback.session_id == session.id,
            t.Feedback.idempotency_key == fb.idempotency_key))
        if earlier is not None:
            if earlier.body_hash != fb.body_hash:
                raise ApiError(409, f"idempotency key '{fb.idempotency_key}' was already used with a different body",
                               code="idempotency_conflict")
            _audit(s, principal, session, earlier, replay=True)
            return feedback_model(earlier, session.external_id).model_dump(mode="json")

    policy = policy_for(s, session.tenant_id)
    if fb.reward is not None and not policy.reward_min <= fb.reward <= policy.reward_max:
        raise ApiError(422, f"reward {fb.reward} is outside this tenant's range [{policy.reward_min}, {policy.reward_max}]",
                       code="reward_out_of_range")
    if fb.step_id is not None:
        step = s.get(t.Step, fb.step_id)
        if step is None or step.session_id != session.id:
            raise ApiError(404, f"step '{fb.step_id}' is not a step of session '{external_id}'", code="step_not_found")
        late = step.trained_version_id is not None
    else:
        # A session reward reaches every step: it is late once any of them was trained on.
        late = bool(s.scalar(select(exists().where(t.Step.session_id == session.id,
                                                   t.Step.trained_version_id.is_not(None)))))
    row = t.Feedback(
        id=new_id(), session_id=session.id, step_id=fb.step_id, tenant_id=session.tenant_id, reward=fb.reward,
        comment=fb.comment, correction=fb.correction, source=fb.source, posted_by=principal.key_id,
        idempotency_key=fb.idempotency_key, body_hash=fb.body_hash, late=late, redaction=fb.redaction or {},
        created_at=datetime.now(UTC),
    )
    s.add(row)
    s.flush()
    _audit(s, principal, session, row, replay=False)
    return feedback_model(row, session.external_id).model_dump(mode="json")


def _audit(s: Session, principal: Principal, session: t.Session, fb: t.Feedback, *, replay: bool) -> None:
    s.add(t.AuditEvent(
        actor=principal.actor, tenant_id=session.tenant_id, action="feedback.create", target=fb.id,
        details={"session": session.external_id, "step": fb.step_id, "reward": fb.reward, "source": fb.source,
                 "late": fb.late, "idempotent_replay": replay, "redacted": fb.redaction or {}},
    ))


def close_session(s: Session, principal: Principal, external_id: str, tenant: str | None) -> dict:
    session = find_session(s, external_id, tenant)
    if session.status != "closed":
        session.status = "closed"
        session.ended_at = datetime.now(UTC)
        s.add(t.AuditEvent(actor=principal.actor, tenant_id=session.tenant_id, action="session.close",
                           target=session.external_id, details={}))
    s.flush()
    return summarize(s, [session])[0]


# --- listing ---------------------------------------------------------------------------------------


@dataclass
class ListQuery:
    tenant: str | None
    since: datetime | None = None
    until: datetime | None = None
    task_id: str | None = None
    status: str | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    eligibility: str | None = None
    limit: int = 50
    cursor: tuple[datetime, str] | None = None


def _time(name: str, value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ApiError(422, f"'{name}' must be an ISO 8601 time, not {value!r}") from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def _number(name: str, value: str | None) -> float | None:
    if value is None or value == "":
        return None
    try:
        x = float(value)
    except ValueError:
        raise ApiError(422, f"'{name}' must be a number, not {value!r}") from None
    if not math.isfinite(x):
        raise ApiError(422, f"'{name}' must be finite")
    return x


def encode_cursor(started_at: datetime, session_id: str) -> str:
    return base64.urlsafe_b64encode(orjson.dumps([started_at.isoformat(), session_id])).decode().rstrip("=")


def decode_cursor(value: str) -> tuple[datetime, str]:
    try:
        when, sid = orjson.loads(base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)))
        return datetime.fromisoformat(when), str(sid)
    except Exception:
        raise ApiError(422, "invalid 'cursor' (pass back the next_cursor of the previous page)") from None


def parse_list_query(params, tenant: str | None, *, all_tenants: bool = False) -> ListQuery:
    known = {"since", "until", "task_id", "status", "min_reward", "max_reward", "eligibility", "limit", "cursor", "tenant"}
    unknown = sorted(set(params.keys()) - known)
    if unknown:
        raise ApiError(422, f"unknown query parameters {unknown}; known: {sorted(known)}")
    try:
        limit = int(params.get("limit") or 50)
    except ValueError:
        raise ApiError(422, "'limit' must be an integer") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise ApiError(422, f"'limit' must be between 1 and {MAX_LIMIT}")
    return ListQuery(
        tenant=tenant, since=_time("since", params.get("since")), until=_time("until", params.get("until")),
        task_id=params.get("task_id") or None, status=params.get("status") or None,
        min_reward=_number("min_reward", params.get("min_reward")),
        max_reward=_number("max_reward", params.get("max_reward")),
        eligibility=params.get("eligibility") or None, limit=limit,
        cursor=decode_cursor(params["cursor"]) if params.get("cursor") else None,
    )


def session_rewards(s: Session, sessions: list[t.Session]) -> dict[str, float | None]:
    """Each session's combined session-scoped reward, by its tenant's `reward_combine`."""
    if not sessions:
        return {}
    values: dict[str, list[float]] = defaultdict(list)
    rows = s.execute(
        select(t.Feedback.session_id, t.Feedback.reward)
        .where(t.Feedback.session_id.in_([x.id for x in sessions]), t.Feedback.step_id.is_(None),
               t.Feedback.reward.is_not(None))
        .order_by(t.Feedback.created_at, t.Feedback.id)
    )
    for sid, reward in rows:
        values[sid].append(reward)
    policies: dict[str, Any] = {}
    out: dict[str, float | None] = {}
    for x in sessions:
        if x.tenant_id not in policies:
            policies[x.tenant_id] = policy_for(s, x.tenant_id)
        out[x.id] = combine_rewards(values[x.id], policies[x.tenant_id].reward_combine) if values[x.id] else None
    return out


def summarize(s: Session, sessions: list[t.Session]) -> list[dict]:
    if not sessions:
        return []
    ids = [x.id for x in sessions]
    counts = dict(s.execute(select(t.Step.session_id, func.count()).where(t.Step.session_id.in_(ids))
                            .group_by(t.Step.session_id)).all())
    rewards = session_rewards(s, sessions)
    originals = {x.replay_of for x in sessions if x.replay_of}
    original_ext = dict(s.execute(select(t.Session.id, t.Session.external_id).where(t.Session.id.in_(originals))).all()) if originals else {}
    return [{
        "id": x.external_id, "tenant": x.tenant_id, "client": x.client, "task_id": x.task_id, "status": x.status,
        "started_at": x.started_at.isoformat(), "last_step_at": x.last_step_at.isoformat() if x.last_step_at else None,
        "ended_at": x.ended_at.isoformat() if x.ended_at else None, "steps": counts.get(x.id, 0),
        "reward": rewards.get(x.id), "replay_of": original_ext.get(x.replay_of) if x.replay_of else None,
        "labels": x.labels or {},
    } for x in sessions]


def list_sessions(s: Session, q: ListQuery) -> dict:
    """A page of session summaries, newest first. Reward filters apply to the combined reward, which
    depends on each tenant's policy, so they are applied here while scanning, not in SQL."""
    conds = []
    if q.tenant is not None:
        conds.append(t.Session.tenant_id == q.tenant)
    if q.since:
        conds.append(t.Session.started_at >= q.since)
    if q.until:
        conds.append(t.Session.started_at < q.until)
    if q.task_id:
        conds.append(t.Session.task_id == q.task_id)
    if q.status:
        conds.append(t.Session.status == q.status)
    if q.eligibility:
        conds.append(exists().where(t.Step.session_id == t.Session.id, t.Step.eligibility == q.eligibility))
    if q.min_reward is not None or q.max_reward is not None:
        conds.append(exists().where(t.Feedback.session_id == t.Session.id, t.Feedback.step_id.is_(None),
                                    t.Feedback.reward.is_not(None)))
    after = q.cursor
    page: list[t.Session] = []
    more = False
    batch = max(q.limit * 2, 50)
    while len(page) <= q.limit:
        stmt = select(t.Session).where(and_(*conds)) if conds else select(t.Session)
        if after is not None:
            stmt = stmt.where(tuple_(t.Session.started_at, t.Session.id) < tuple_(after[0], after[1]))
        rows = s.scalars(stmt.order_by(t.Session.started_at.desc(), t.Session.id.desc()).limit(batch)).all()
        if not rows:
            break
        rewards = session_rewards(s, rows) if q.min_reward is not None or q.max_reward is not None else {}
        for row in rows:
            r = rewards.get(row.id)
            if q.min_reward is not None and (r is None or r < q.min_reward):
                continue
            if q.max_reward is not None and (r is None or r > q.max_reward):
                continue
            page.append(row)
            if len(page) > q.limit:
                break
        after = (rows[-1].started_at, rows[-1].id)
        if len(rows) < batch:
            break
    if len(page) > q.limit:
        more = True
        page = page[: q.limit]
    next_cursor = encode_cursor(page[-1].started_at, page[-1].id) if more and page else None
    return {"data": summarize(s, page), "next_cursor": next_cursor}


__all__ = [
    "FeedbackIn", "ListQuery", "close_session", "create_feedback", "find_session", "install", "list_sessions",
    "parse_feedback", "parse_list_query", "session_rewards", "summarize",
]
