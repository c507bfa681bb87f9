"""Rewards, comments and corrections on sessions, and closing them.

Routes (session ids are the *public* ids, scoped to the caller's tenant; the admin key sees every
tenant and may narrow with `?tenant=` or `X-ATDP-Tenant`):

- `POST /atdp/v1/sessions/{id}/feedback`: a reward for the session or one step, and/or a comment
  or a correction. Idempotent by `idempotency_key`. Comments and corrections are redacted before
  they are stored; every post is audited.
- `POST /atdp/v1/sessions/{id}/close`: the session ends (it may still receive feedback).

The functions below the routes take a SQLAlchemy session and are called in a worker thread: the
event loop never waits on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from sqlalchemy import exists, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from starlette.requests import Request
from starlette.responses import Response

from atdp_schema.models import FeedbackSource
from proxy.auth import Principal
from proxy.control.sessions import session_or_error, summarize
from proxy.errors import ApiError
from proxy.governance.policies import Policies
from proxy.governance.redaction import TextRedactor
from proxy.http import Endpoint, Route, json_response, path_id, read_json, run_db, scope_tenant
from proxy.shapes import id_problem, text_problem
from proxy.state import AppState
from proxy.store import tables as t
from proxy.store.content import content_hash
from proxy.store.ids import new_id
from proxy.store.read import feedback_model

FEEDBACK_FIELDS = ("reward", "step_id", "source", "comment", "correction", "idempotency_key")
SOURCES = tuple(s.value for s in FeedbackSource)
MAX_TEXT = 64 * 1024
DURABLE_WAIT_S = 30.0  # how long feedback waits for a just-answered step to be written
T = TypeVar("T")


# --- routes ----------------------------------------------------------------------------------------


def routes(state: AppState) -> list[Route]:
    return [
        Route("/atdp/v1/sessions/{session_id}/feedback", _feedback_route(state), ("POST",)),
        Route("/atdp/v1/sessions/{session_id}/close", _close_route(state), ("POST",)),
    ]


def _feedback_route(state: AppState) -> Endpoint:
    async def post_feedback(request: Request) -> Response:
        principal = await state.authenticate(request)
        body = await _read_body(request, state)
        fb = parse_feedback(body)
        tenant = scope_tenant(request, principal)
        external_id = path_id(request, "session_id")
        # Fail fast (404/422) before paying for redaction.
        session_tenant = await once_durable(state, external_id, fb.step_id, lambda: run_db(
            state, lambda s: session_or_error(s, external_id, tenant).tenant_id))
        fb.body_hash = content_hash(state.settings.secret, fb.canonical())
        texts = [x for x in (fb.comment, fb.correction) if x is not None]
        if texts:
            redacted = await asyncio.to_thread(redact_texts, state.redactor, session_tenant, texts)
            fb.apply_redaction(redacted)

        async def create() -> dict:
            try:
                return await run_db(state, lambda s: create_feedback(s, state.policies, principal, external_id, tenant, fb))
            except IntegrityError:
                # A concurrent post with the same idempotency key won the race: answer as a replay.
                return await run_db(state, lambda s: create_feedback(s, state.policies, principal, external_id, tenant, fb))

        body = await once_durable(state, external_id, fb.step_id, create)
        if fb.reward is not None:
            state.canary.nudge()  # a running canary checks its sequential test now (gate 3)
        return json_response(body)

    return post_feedback


def _close_route(state: AppState) -> Endpoint:
    async def close(request: Request) -> Response:
        principal = await state.authenticate(request)
        tenant = scope_tenant(request, principal)
        external_id = path_id(request, "session_id")
        return json_response(await run_db(state, lambda s: close_session(s, state.policies, principal, external_id, tenant)))

    return close


async def once_durable(state: AppState, external_id: str, step_id: str | None, look: Callable[[], Awaitable[T]]) -> T:
    """`look()`; when it is a 404 for a session or step the proxy has answered but its writer has not
    written yet, wait for that write (bounded) and look again: feedback posted right after a
    response must not miss the step it is about."""
    inflight = state.recorder.inflight
    # Asked before looking: a write that commits while the lookup runs leaves the lookup's snapshot
    # without the row and the in-flight set without the step, so asking only afterwards misses it.
    held = inflight.holds(external_id, step_id)
    try:
        return await look()
    except ApiError as e:
        if e.status != 404 or not (held or inflight.holds(external_id, step_id)):
            raise
    await asyncio.to_thread(inflight.wait, external_id, step_id, DURABLE_WAIT_S)
    return await look()


async def _read_body(request: Request, state: AppState) -> Any:
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
            raise ApiError(422, "'reward' must be a finite number", param="reward")
        reward = float(reward)
    for name in ("source", "comment", "correction"):
        value = body.get(name)
        if value is not None and (problem := text_problem(value, MAX_TEXT)):
            raise ApiError(422, f"'{name}' {problem}", param=name)
    for name in ("step_id", "idempotency_key"):  # ids: the store holds 256 characters, no NUL
        value = body.get(name)
        if value is not None and (problem := id_problem(value)):
            raise ApiError(422, f"'{name}' {problem}", param=name)
    key = body.get("idempotency_key")
    comment, correction = body.get("comment"), body.get("correction")
    if reward is None and comment is None and correction is None:
        raise ApiError(422, "feedback needs at least one of 'reward', 'comment', 'correction'")
    source = body.get("source") or ("user_correction" if correction is not None else "human")
    if source not in SOURCES:
        raise ApiError(422, f"'source' must be one of {list(SOURCES)}", param="source")
    return FeedbackIn(reward=reward, step_id=body.get("step_id"), source=source, comment=comment,
                      correction=correction, idempotency_key=key)


def redact_texts(redactor: TextRedactor, tenant: str, texts: list[str]) -> list[tuple[str, dict[str, int]]]:
    return redactor.redact_many([(tenant, x) for x in texts])


def create_feedback(s: Session, policies: Policies, principal: Principal, external_id: str, tenant: str | None, fb: FeedbackIn) -> dict:
    """Store one feedback (or return the earlier one with the same idempotency key) and audit it."""
    session = session_or_error(s, external_id, tenant)
    if fb.idempotency_key is not None:
        earlier = s.scalar(select(t.Feedback).where(
            t.Feedback.tenant_id == session.tenant_id, t.Feedback.session_id == session.id,
            t.Feedback.idempotency_key == fb.idempotency_key))
        if earlier is not None:
            if earlier.body_hash != fb.body_hash:
                raise ApiError(409, "this idempotency key was already used with a different body",
                               code="idempotency_conflict")
            _audit(s, principal, session, earlier, replay=True)
            return feedback_model(earlier, session.external_id).model_dump(mode="json")

    policy = policies.policy_for(s, session.tenant_id)
    if fb.reward is not None and not policy.reward_min <= fb.reward <= policy.reward_max:
        raise ApiError(422, f"reward {fb.reward} is outside this tenant's range [{policy.reward_min}, {policy.reward_max}]",
                       code="reward_out_of_range")
    if fb.step_id is not None:
        step = s.get(t.Step, (fb.step_id, session.id))  # the whole key: one partition's index
        if step is None:
            raise ApiError(404, "step_id is not a step of session session_id (ids not echoed)", code="step_not_found",
                           param="step_id")
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


def close_session(s: Session, policies: Policies, principal: Principal, external_id: str, tenant: str | None) -> dict:
    session = session_or_error(s, external_id, tenant)
    if session.status != "closed":
        session.status = "closed"
        session.ended_at = datetime.now(UTC)
        s.add(t.AuditEvent(actor=principal.actor, tenant_id=session.tenant_id, action="session.close",
                           target=session.external_id, details={}))
    s.flush()
    return summarize(s, policies, [session])[0]


# --- listing ---------------------------------------------------------------------------------------


