"""Reading sessions: `GET /atdp/v1/sessions/{id}` (ATDP JSON) and `GET /atdp/v1/sessions` (a filtered,
keyset-paginated listing). A tenant key sees its own sessions; the admin key any tenant's."""

from __future__ import annotations

import base64
import math
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime

import orjson
from sqlalchemy import and_, exists, func, select, tuple_
from sqlalchemy.orm import Session
from starlette.requests import Request
from starlette.responses import Response

from atdp_schema import models as m
from proxy.errors import ApiError
from proxy.governance.policies import Policies
from proxy.governance.policy import TenantPolicy
from proxy.http import Endpoint, Route, json_response, path_id, run_db, scope_tenant
from proxy.shapes import MAX_ID, MAX_TENANT, id_problem
from proxy.state import AppState
from proxy.store import tables as t
from proxy.store.read import find_session, session_document
from proxy.store.rewards import combine_rewards


def routes(state: AppState) -> list[Route]:
    return [
        Route("/atdp/v1/sessions", _list_route(state), ("GET",)),
        Route("/atdp/v1/sessions/{session_id}", _get_route(state), ("GET",)),
    ]


def document(s: Session, policies: Policies, session: t.Session) -> m.Session:
    """A session as ATDP JSON, its reward combined by its tenant's policy."""
    return session_document(s, session, reward_combine=policies.policy_for(s, session.tenant_id).reward_combine)


def session_or_error(s: Session, external_id: str, tenant: str | None) -> t.Session:
    """The session a route names (`find_session`), or the 404 / 409 the caller gets."""
    try:
        row = find_session(s, external_id, tenant)
    except LookupError:
        raise ApiError(409, "this session id exists in several tenants; pass ?tenant=") from None
    if row is None:
        raise ApiError(404, "session not found", code="session_not_found")
    return row


MAX_LIMIT = 500
SESSION_STATUSES = tuple(x.value for x in m.SessionStatus)
ELIGIBILITIES = tuple(e.value for e in m.Eligibility)


def _get_route(state: AppState) -> Endpoint:
    async def get_session(request: Request) -> Response:
        principal = await state.authenticate(request)
        tenant = scope_tenant(request, principal)
        external_id = path_id(request, "session_id")

        def read(s: Session) -> bytes:
            return document(s, state.policies, session_or_error(s, external_id, tenant)).model_dump_json().encode()

        return Response(await run_db(state, read), media_type="application/json")

    return get_session


def _list_route(state: AppState) -> Endpoint:
    async def list_route(request: Request) -> Response:
        principal = await state.authenticate(request)
        q = parse_list_query(request.query_params, scope_tenant(request, principal), all_tenants=principal.is_admin)
        return json_response(await run_db(state, lambda s: list_sessions(s, state.policies, q)))

    return list_route


@dataclass
class ListQuery:
    tenant: str | None
    since: datetime | None = None
    until: datetime | None = None
    task_id: str | None = None
    client: str | None = None
    version: str | None = None
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
        raise ApiError(422, f"'{name}' must be an ISO 8601 time", param=name) from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def _number(name: str, value: str | None) -> float | None:
    if value is None or value == "":
        return None
    try:
        x = float(value)
    except ValueError:
        raise ApiError(422, f"'{name}' must be a number", param=name) from None
    if not math.isfinite(x):
        raise ApiError(422, f"'{name}' must be finite")
    return x


def encode_cursor(started_at: datetime, session_id: str) -> str:
    return base64.urlsafe_b64encode(orjson.dumps([started_at.isoformat(), session_id])).decode().rstrip("=")


def decode_cursor(value: str) -> tuple[datetime, str]:
    try:
        when, sid = orjson.loads(base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)))
        at = datetime.fromisoformat(when)
    except Exception:
        at, sid = None, None
    if at is None or id_problem(sid):
        raise ApiError(422, "invalid 'cursor' (pass back the next_cursor of the previous page)", param="cursor")
    return at if at.tzinfo else at.replace(tzinfo=UTC), sid


def parse_list_query(params, tenant: str | None, *, all_tenants: bool = False) -> ListQuery:
    known = {"since", "until", "task_id", "client", "version", "status", "min_reward", "max_reward", "eligibility", "limit", "cursor", "tenant"}
    unknown = sorted(set(params.keys()) - known)
    if unknown:
        raise ApiError(422, f"unknown query parameters {unknown}; known: {sorted(known)}")
    try:
        limit = int(params.get("limit") or 50)
    except ValueError:
        raise ApiError(422, "'limit' must be an integer") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise ApiError(422, f"'limit' must be between 1 and {MAX_LIMIT}")
    for name, longest in (("task_id", MAX_ID), ("client", 64), ("version", 64), ("tenant", MAX_TENANT)):
        if params.get(name) and (problem := id_problem(params[name], longest)):
            raise ApiError(422, f"'{name}' {problem}", param=name)
    for name, allowed in (("status", SESSION_STATUSES), ("eligibility", ELIGIBILITIES)):
        if params.get(name) and params[name] not in allowed:
            raise ApiError(422, f"'{name}' must be one of {list(allowed)}", param=name)
    return ListQuery(
        tenant=tenant, since=_time("since", params.get("since")), until=_time("until", params.get("until")),
        task_id=params.get("task_id") or None, client=params.get("client") or None,
        version=params.get("version") or None, status=params.get("status") or None,
        min_reward=_number("min_reward", params.get("min_reward")),
        max_reward=_number("max_reward", params.get("max_reward")),
        eligibility=params.get("eligibility") or None, limit=limit,
        cursor=decode_cursor(params["cursor"]) if params.get("cursor") else None,
    )


def session_rewards(s: Session, policies: Policies, sessions: list[t.Session]) -> dict[str, float | None]:
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
    by_tenant: dict[str, TenantPolicy] = {}
    out: dict[str, float | None] = {}
    for x in sessions:
        if x.tenant_id not in by_tenant:
            by_tenant[x.tenant_id] = policies.policy_for(s, x.tenant_id)
        out[x.id] = combine_rewards(values[x.id], by_tenant[x.tenant_id].reward_combine) if values[x.id] else None
    return out


def summarize(s: Session, policies: Policies, sessions: list[t.Session]) -> list[dict]:
    if not sessions:
        return []
    ids = [x.id for x in sessions]
    counts = dict(s.execute(select(t.Step.session_id, func.count()).where(t.Step.session_id.in_(ids))
                            .group_by(t.Step.session_id)).all())
    rewards = session_rewards(s, policies, sessions)
    originals = {x.replay_of for x in sessions if x.replay_of}
    original_ext = dict(s.execute(select(t.Session.id, t.Session.external_id).where(t.Session.id.in_(originals))).all()) if originals else {}
    return [{
        "id": x.external_id, "tenant": x.tenant_id, "client": x.client, "task_id": x.task_id, "status": x.status,
        "started_at": x.started_at.isoformat(), "last_step_at": x.last_step_at.isoformat() if x.last_step_at else None,
        "ended_at": x.ended_at.isoformat() if x.ended_at else None, "steps": counts.get(x.id, 0),
        "reward": rewards.get(x.id), "replay_of": original_ext.get(x.replay_of) if x.replay_of else None,
        "labels": x.labels or {},
    } for x in sessions]


def list_sessions(s: Session, policies: Policies, q: ListQuery) -> dict:
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
    if q.client:
        conds.append(t.Session.client == q.client)
    if q.version:  # sessions with a step served by this version (the version of its first output token)
        conds.append(exists().where(t.Step.session_id == t.Session.id, t.Step.model_version == q.version))
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
    # A reward filter is applied while scanning (below): read more per round trip, as many rows fail it.
    rewarded = q.min_reward is not None or q.max_reward is not None
    batch = max(q.limit * 2, 1000 if rewarded else 50)
    while len(page) <= q.limit:
        stmt = select(t.Session).where(and_(*conds)) if conds else select(t.Session)
        if after is not None:
            stmt = stmt.where(tuple_(t.Session.started_at, t.Session.id) < tuple_(after[0], after[1]))
        rows = s.scalars(stmt.order_by(t.Session.started_at.desc(), t.Session.id.desc()).limit(batch)).all()
        if not rows:
            break
        rewards = session_rewards(s, policies, rows) if rewarded else {}
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
    return {"data": summarize(s, policies, page), "next_cursor": next_cursor}
