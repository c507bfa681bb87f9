"""Governance control routes: tenant policy, forget, retention, audit trail; the retention task.

    GET    /atdp/v1/tenants/{tenant}/policy    the effective policy (admin, or the tenant's own key)
    PUT    /atdp/v1/tenants/{tenant}/policy    change keys of it (admin; validated; audited)
    DELETE /atdp/v1/sessions/{session_id}      forget a session (its tenant's key; admin: ?tenant=)
    DELETE /atdp/v1/tenants/{tenant}           forget all of a tenant's recorded data (admin)
    POST   /atdp/v1/retention/run              run the retention job now (admin)
    GET    /atdp/v1/audit                      audit rows, newest first (admin)

`retention_loop` is the periodic retention job (every `ATDP_RETENTION_INTERVAL_S`), started by the app.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.requests import Request
from starlette.responses import Response

from proxy.config import Settings, spool_folders
from proxy.errors import ApiError
from proxy.governance import forget
from proxy.governance.policies import Policies
from proxy.governance.policy import PolicyError, TenantPolicy
from proxy.http import DB_UNAVAILABLE, Route, check_id, json_response, path_id, read_json, run_db
from proxy.record import deadletters
from proxy.record.spool import adoptable
from proxy.shapes import text_problem
from proxy.state import AppState
from proxy.store import tables as t

log = logging.getLogger("atdp.admin")


def _after_forget(state: AppState, report: forget.Forgotten, *, whole_tenant: bool = False,
                  sessions: list[str] = ()) -> None:
    """Caches and the spool let go of what was forgotten: no later call links to a forgotten
    session, and its pending spooled records go (the tombstone refuses any that still arrive).
    Every other proxy on the database does the same when the forget's notes reach it (`ForgetFollower`)."""
    forget_here(state, report.tenant, report.step_ids, None if whole_tenant else report.content_hashes,
                sorted({*report.external_ids, *sessions}), whole_tenant=whole_tenant,
                forgets=[] if report.forgets is None else [report.forgets])


def forget_here(state: AppState, tenant: str, step_ids: list[str], content_hashes: list[str] | None,
                sessions: list[str], *, whole_tenant: bool, forgets: list[int] = ()) -> None:
    """This proxy's memory of forgotten steps, contents and sessions goes: continuation keys, token
    memory, the doors' caches, the writer's caches (a content it believed stored would be referred to,
    not written again; `forgets`: the forgets' counts, proxy.store.forgets) and its spool's pending
    records. Runs on the event loop (the caches are its own)."""
    steps = set(step_ids)
    state.index.forget(steps)
    state.tokens.forget(steps)
    for hook in state.forget_hooks:
        hook(tenant, steps, whole_tenant)
    state.recorder.forget(tenant, step_ids=list(step_ids), content_hashes=content_hashes, sessions=sessions,
                          whole_tenant=whole_tenant, forgets=list(forgets))


class ForgetFollower:
    """Forgets run elsewhere (another proxy, `atdp forget`, another proxy's retention), applied here;
    and policy changes made elsewhere, which the writer reads again at once (`on_policy`).

    A forget announces itself in notes of under 8 KB each (proxy.governance.forget.announce), all
    delivered at its commit; notes that arrive within `coalesce_s` of each other are applied as one
    (a tenant's forget of 100,000 steps is a few hundred notes, and the continuation index is walked
    once per application). Then this proxy's dead letters of those sessions go too.
    """

    def __init__(self, state: AppState, coalesce_s: float = 0.02) -> None:
        self.state = state
        self.coalesce_s = coalesce_s
        self._notes: list[dict[str, Any]] = []
        self._task: asyncio.Task[None] | None = None
        self._connected = False

    async def on_connect(self) -> None:
        """The listener (re)connected: forgets announced while it was away were missed, so the writer
        stops believing any content stored (each is scanned and written once more: a cost, not a loss)
        and reads the tenants' forget counts again (proxy.store.forgets)."""
        if self._connected:
            self.state.recorder.catch_up()
            log.info("notes listener reconnected: the writer's stored-contents cache was cleared")
        self._connected = True

    async def on_policy(self, msg: dict[str, Any]) -> None:
        """A tenant's policy changed (any proxy, or `atdp policy set`): the writer reads it again now."""
        if isinstance(tenant := msg.get("tenant"), str):
            self.state.recorder.forget(tenant, content_hashes=[])

    async def on_note(self, msg: dict[str, Any]) -> None:
        self._notes.append(msg)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._apply_soon(), name="atdp-forget-follow")

    async def _apply_soon(self) -> None:
        await asyncio.sleep(self.coalesce_s)  # the rest of the forget's notes arrive meanwhile
        notes, self._notes = self._notes, []
        for tenant, (whole, sessions, steps, contents, forgets) in _merged(notes).items():
            try:
                forget_here(self.state, tenant, sorted(steps), None if whole else sorted(contents), sorted(sessions),
                            whole_tenant=whole, forgets=sorted(forgets))
                letters = await asyncio.to_thread(_purge_letters, self.state.settings, tenant, whole, sessions)
                log.info("forget from another proxy applied: tenant %s, %d sessions, %d steps, %d contents%s, "
                         "%d dead letters", tenant, len(sessions), len(steps), len(contents),
                         " (whole tenant)" if whole else "", len(letters))
            except Exception as e:
                log.error("a forget from another proxy was not applied here (%s: %s)", type(e).__name__, e)


def _purge_letters(settings: Settings, tenant: str, whole: bool, sessions: set[str]) -> list[deadletters.DeadLetter]:
    return deadletters.purge(settings.spool_dir, lambda d: d.tenant == tenant and (whole or d.session in sessions),
                             _others(settings))


def _others(settings: Settings) -> list[Path]:
    """The spool folders on this home besides this process's own, whose dead letters it purges while no
    live process holds them (a replica scaled away left them; proxy.record.spool.adoptable)."""
    return adoptable(spool_folders(settings.home), settings.spool_dir)


def _merged(notes: list[dict[str, Any]]) -> dict[str, tuple[bool, set[str], set[str], set[str], set[int]]]:
    """Notes by tenant: (whole tenant?, sessions, steps, contents, forget counts); a malformed note is
    skipped."""
    out: dict[str, tuple[bool, set[str], set[str], set[str], set[int]]] = {}
    for msg in notes:
        tenant, lists = msg.get("tenant"), [msg.get(k) or [] for k in ("sessions", "steps", "contents")]
        if not isinstance(tenant, str) or not all(isinstance(x, list) and all(isinstance(i, str) for i in x)
                                                  for x in lists):
            log.warning("a forget note of an unknown shape was ignored")
            continue
        whole, sessions, steps, contents, forgets = out.get(tenant, (False, set(), set(), set(), set()))
        n = msg.get("forgets")
        out[tenant] = (whole or bool(msg.get("whole")), sessions | set(lists[0]), steps | set(lists[1]),
                       contents | set(lists[2]), forgets | ({n} if type(n) is int else set()))
    return out


def _reason(request: Request) -> str | None:
    """The optional `?reason=` kept in the audit row (JSONB: no NUL)."""
    reason = request.query_params.get("reason")
    if reason is not None and (problem := text_problem(reason, 1000)):
        raise ApiError(400, f"reason {problem}", param="reason")
    return reason


def _policy_response(tenant: str, policy: TenantPolicy) -> Response:
    return json_response({"tenant": tenant, "policy": policy.to_dict()})


def routes(state: AppState) -> list[Route]:
    # The token guard (ATDP_TOKENIZER) is built with the recorder: proxy.record.writer_child.build_recorder.

    async def get_policy(request: Request) -> Response:
        tenant = path_id(request, "tenant")
        principal = await state.authenticate(request)
        if not principal.is_admin and principal.tenant != tenant:
            raise ApiError(403, "a tenant may read only its own policy", type="permission_error")
        policy = await run_db(state, lambda s: state.policies.policy_for(s, tenant))
        return _policy_response(tenant, policy)

    async def put_policy(request: Request) -> Response:
        tenant = path_id(request, "tenant")
        principal = await state.authenticate(request, admin=True)
        changes = await read_json(request, 1 << 20)
        if not isinstance(changes, dict) or not changes:
            raise ApiError(400, "send a JSON object of policy keys to change")
        try:
            policy = await run_db(state, lambda s: state.policies.set_policy(s, tenant, changes, actor=principal.actor))
        except PolicyError as e:
            raise ApiError(400, f"invalid policy: {e}") from None
        state.recorder.forget(tenant, content_hashes=[])  # drops the writer's cached policy
        return _policy_response(tenant, policy)

    async def delete_session(request: Request) -> Response:
        session_id = path_id(request, "session_id")
        principal = await state.authenticate(request)
        tenant = request.query_params.get("tenant") if principal.is_admin else principal.tenant
        if tenant is not None:
            check_id("tenant", tenant)
        reason = _reason(request)
        await asyncio.to_thread(state.recorder.flush, 10.0)  # a step still queued must not outlive the forget
        try:
            report = await run_db(state, lambda s: forget.forget_session(
                s, session_id, tenant=tenant, actor=principal.actor, reason=reason, origin=state.bus_id))
        except LookupError:
            raise ApiError(409, "this session id exists in several tenants; pass ?tenant=") from None
        # Its dead letters too (a session whose every step was refused has no row, only those).
        letters = await asyncio.to_thread(lambda: deadletters.purge_session(
            state.settings.spool_dir, session_id, report.tenant if report else tenant, _others(state.settings)))
        if report is None and not letters:
            raise ApiError(404, "session not found", code="session_not_found")
        if report is None:
            report = forget.Forgotten(tenant=letters[0].tenant)
            # Only dead letters: no session row, but its steps may still be spooled or re-sent.
            def tombstone(s: Session, report: forget.Forgotten = report) -> None:
                forget.tombstone(s, report.tenant, session_id)
                forget.announce(s, report, sessions=[session_id], origin=state.bus_id)

            await run_db(state, tombstone)
        _after_forget(state, report, sessions=[session_id])
        return json_response({"forgotten": "session", "session_id": session_id, "tenant": report.tenant,
                              **report.counts(), "dead_letters": len(letters)})

    async def delete_tenant(request: Request) -> Response:
        tenant = path_id(request, "tenant")
        principal = await state.authenticate(request, admin=True)
        reason = _reason(request)
        await asyncio.to_thread(state.recorder.flush, 10.0)
        report = await run_db(state, lambda s: forget.forget_tenant(s, tenant, actor=principal.actor, reason=reason,
                                                                           origin=state.bus_id))
        letters = await asyncio.to_thread(lambda: deadletters.purge_tenant(state.settings.spool_dir, tenant,
                                                                           _others(state.settings)))
        _after_forget(state, report, whole_tenant=True)
        return json_response({"forgotten": "tenant", "tenant": tenant, **report.counts(), "dead_letters": len(letters)})

    async def run_retention(request: Request) -> Response:
        principal = await state.authenticate(request, admin=True)
        reports = await asyncio.to_thread(retention_once, state, principal.actor)
        return json_response({"tenants": [{"tenant": r.tenant, **r.counts()} for r in reports]})

    async def audit(request: Request) -> Response:
        await state.authenticate(request, admin=True)
        q = request.query_params
        try:
            limit = min(max(int(q.get("limit", "100")), 1), 1000)
            before = int(q["before"]) if q.get("before") else None
            since = datetime.fromisoformat(q["since"]) if q.get("since") else None
            until = datetime.fromisoformat(q["until"]) if q.get("until") else None
        except ValueError:
            raise ApiError(400, "bad query parameter: limit and before are integers, since and until ISO 8601 times"
                           ) from None
        for name in ("tenant", "actor", "action"):
            if q.get(name):
                check_id(name, q[name])

        def rows(s: Session) -> list[dict[str, Any]]:
            stmt = select(t.AuditEvent).order_by(t.AuditEvent.id.desc()).limit(limit + 1)
            if q.get("tenant"):
                stmt = stmt.where(t.AuditEvent.tenant_id == q["tenant"])
            if q.get("actor"):
                stmt = stmt.where(t.AuditEvent.actor == q["actor"])
            if q.get("action"):  # exact, or a prefix ending in '.': "forget."
                a = q["action"]
                stmt = stmt.where(t.AuditEvent.action.startswith(a) if a.endswith(".") else t.AuditEvent.action == a)
            if before is not None:
                stmt = stmt.where(t.AuditEvent.id < before)
            if since is not None:
                stmt = stmt.where(t.AuditEvent.at >= since)
            if until is not None:
                stmt = stmt.where(t.AuditEvent.at < until)
            return [
                {"id": r.id, "at": r.at.isoformat(), "actor": r.actor, "tenant": r.tenant_id, "action": r.action,
                 "target": r.target, "details": r.details}
                for r in s.scalars(stmt)
            ]

        found = await run_db(state, rows)
        more = len(found) > limit
        found = found[:limit]
        return json_response({"data": found, "next_before": found[-1]["id"] if more else None})

    return [
        Route("/atdp/v1/tenants/{tenant}/policy", get_policy, ("GET",)),
        Route("/atdp/v1/tenants/{tenant}/policy", put_policy, ("PUT",)),
        Route("/atdp/v1/sessions/{session_id}", delete_session, ("DELETE",)),
        Route("/atdp/v1/tenants/{tenant}", delete_tenant, ("DELETE",)),
        Route("/atdp/v1/retention/run", run_retention, ("POST",)),
        Route("/atdp/v1/audit", audit, ("GET",)),
    ]


def retention_once(state: AppState, actor: str = "system") -> list[forget.Forgotten]:
    """One retention pass on the proxy's database, then the writer's caches are told."""
    if state.factory is None:
        raise ApiError(503, DB_UNAVAILABLE)
    with state.factory() as s, s.begin():
        reports = forget.run_retention(s, policy_for=state.policies.policy_for, actor=actor,
                                       quiet_s=state.settings.session_ttl_s, origin=state.bus_id)
        expire_dead_letters(s, state.settings, state.policies)
    for r in reports:
        _after_forget(state, r)
    return reports


def expire_dead_letters(s: Session, settings: Settings, policies: Policies) -> int:
    """Retention covers dead letters too: those past their tenant's retention go (logged by count)."""
    gone = deadletters.purge_expired(settings.spool_dir, lambda tenant: policies.policy_for(s, tenant).retention_days,
                                     others=_others(settings))
    if gone:
        log.info("retention purged %d dead letters", len(gone))
    return len(gone)


async def retention_loop(state: AppState, interval: float) -> None:
    """The proxy's retention job, every `interval` seconds (ATDP_RETENTION_INTERVAL_S)."""
    while True:
        await asyncio.sleep(interval)
        if state.factory is None:
            continue
        try:
            reports = await asyncio.to_thread(retention_once, state)
        except Exception:
            log.exception("retention job failed; retrying in %.0fs", interval)
            continue
        if reports:
            log.info("retention forgot %d sessions", sum(r.sessions for r in reports))
