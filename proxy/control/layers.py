"""Harness and memory versions: registering them, proposals from the diagnosis, rolling them back.

- `POST /atdp/v1/versions` with `"layer": "harness"`: `{"layer", "overlay": {...}, "tenant"?, "name"?,
  "reason"?, "wait"?}` (proxy.layers.overlay describes the overlay; no tenant: every tenant). With
  `"layer": "memory"`: `{"layer", "tenant"?, "facts": [text, ...], "name"?, "wait"?}`: the facts are
  redacted, then added to the tenant's serving memory as a candidate. 202 with the version; its gates
  run in the background (proxy.rollout.layer_gates); `"wait": true` answers when they are done.
- `POST /atdp/v1/evolve/proposals` `{"tenant"?, "wait"?}`: the diagnosis's harness and memory findings
  as candidates (proxy.evolve.proposals), each gated; 200 with the versions and what each answers.
- `GET /atdp/v1/memory/facts?tenant=`: the tenant's facts (the admin key).
- Rollback of a harness or memory version: `POST /atdp/v1/versions/{id}/rollback` (proxy.control.versions
  hands it here): it is `rolled_back`, the version of its layer and scope that served before it serves
  again (or none: no overlay, no memory); one in its canary ends the canary (its arm gets the serving
  version again).
"""

from __future__ import annotations

import asyncio
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from starlette.requests import Request
from starlette.responses import Response

from atdp_schema.models import VersionStatus
from proxy.auth import Principal
from proxy.control.diagnosis import _rules
from proxy.control.feedback import redact_texts
from proxy.errors import ApiError
from proxy.evolve.diagnose import diagnose
from proxy.evolve.gather import gather
from proxy.evolve.proposals import Proposal, propose
from proxy.http import Endpoint, Route, json_response, read_json, run_db
from proxy.layers.overlay import OverlayError
from proxy.layers.register import NothingNew, pending_of, register_harness, register_memory
from proxy.rollout import layer_canary
from proxy.rollout.layer_gates import LayerGates, LayerTarget, run_layer_gates
from proxy.shapes import id_problem
from proxy.state import AppState
from proxy.store import tables as t
from proxy.store.layers import HARNESS, rollback
from proxy.store.versions import version_detail

FIELDS = {"layer", "overlay", "facts", "tenant", "name", "reason", "wait"}
SHAPE = ('body must be {"layer": "harness", "overlay": {...}, "tenant"?: str, "name"?: str, "wait"?: bool} or '
         '{"layer": "memory", "facts": [str, ...], "tenant"?: str, "name"?: str, "wait"?: bool}')
MAX_FACTS = 200
MAX_FACT_CHARS = 2000


def routes(state: AppState, lg: LayerGates) -> list[Route]:
    return [Route("/atdp/v1/evolve/proposals", _proposals_route(state, lg), ("POST",)),
            Route("/atdp/v1/memory/facts", _facts_route(state), ("GET",))]


def _string(body: dict[str, Any], key: str) -> str | None:
    """A name (printable ASCII: it is echoed in a response header) or a tenant (an identifier)."""
    value = body.get(key)
    ascii_only = key == "name"
    if value is not None and (not isinstance(value, str) or id_problem(value, 128)
                              or (ascii_only and not (value.isascii() and value.isprintable()))):
        raise ApiError(422, f"'{key}' must be {'printable ASCII' if ascii_only else 'an identifier'} of 1 to 128 "
                            "characters", param=key)
    return value


def _gate(state: AppState, lg: LayerGates, row: t.ModelVersion, actor: str) -> asyncio.Task[None]:
    target = LayerTarget(row.id, row.name, row.layer, row.tenant_id)
    return lg.start(target, lambda: run_layer_gates(state, lg, target, actor=actor))


async def create(state: AppState, lg: LayerGates, principal: Principal, body: dict[str, Any]) -> Response:
    """POST /atdp/v1/versions for a harness or memory version (the admin key)."""
    if not principal.is_admin:
        raise ApiError(403, "harness and memory versions need the admin key", type="permission_error")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise ApiError(422, f"unknown fields {unknown}; {SHAPE}")
    layer = body["layer"]
    name, tenant = _string(body, "name"), _string(body, "tenant")
    if not isinstance(body.get("wait", False), bool):
        raise ApiError(422, "'wait' must be true or false", param="wait")
    actor = principal.actor
    if layer == HARNESS:
        if "facts" in body or not isinstance(body.get("overlay"), dict):
            raise ApiError(422, SHAPE, param="overlay")

        def register(s: Session) -> t.ModelVersion:
            return register_harness(s, tenant=tenant, overlay=body["overlay"], name=name, trigger="operator",
                                    actor=actor, on_serving=False, evidence={"reason": body.get("reason")})
    else:
        facts = body.get("facts")
        if ("overlay" in body or not isinstance(facts, list) or not facts or len(facts) > MAX_FACTS
                or not all(isinstance(f, str) and 0 < len(f.strip()) <= MAX_FACT_CHARS for f in facts)):
            raise ApiError(422, f"'facts' must be 1 to {MAX_FACTS} non-empty strings of at most {MAX_FACT_CHARS} "
                                f"characters; {SHAPE}", param="facts")
        tenant = tenant or principal.tenant
        redacted = await asyncio.to_thread(redact_texts, state.redactor, tenant, [f.strip() for f in facts])
        source = {"operator": actor}

        def register(s: Session) -> t.ModelVersion:
            return register_memory(s, tenant=tenant, facts=[(text, source) for text, _ in redacted], name=name,
                                   trigger="operator", actor=actor,
                                   evidence={"redacted": sum(sum(c.values()) for _, c in redacted)})
    try:
        row = await run_db(state, register)
    except OverlayError as e:
        raise ApiError(422, str(e), param="overlay") from None
    except NothingNew as e:
        raise ApiError(409, str(e)) from None
    except IntegrityError:
        raise ApiError(409, f"version name '{name}' is taken") from None
    task = _gate(state, lg, row, actor)
    if body.get("wait"):
        await asyncio.shield(task)
    detail = await run_db(state, lambda s: version_detail(s, row.id))
    return json_response(detail, 202 if detail["status"] in (VersionStatus.candidate, VersionStatus.evaluating) else 200)


async def rollback_layer(state: AppState, principal: Principal, version: t.ModelVersion) -> Response:
    if version.status not in (VersionStatus.serving, VersionStatus.canary):
        raise ApiError(409, f"version '{version.name}' is {version.status}; only a serving version can be rolled back")
    restored = None
    # A canary ends (its arm gets the serving version again); one its monitor decided meanwhile, or a
    # serving version, is rolled back as a serving version.
    if version.status != VersionStatus.canary or await layer_canary.rollback_now(
            state, version.id, actor=principal.actor) is None:
        def serving_rollback(s: Session) -> str | None:
            v = s.get(t.ModelVersion, version.id, populate_existing=True)
            if v is None or v.status != VersionStatus.serving:
                raise ApiError(409, f"version '{version.name}' is {v.status if v else 'gone'}; only a serving "
                                    "version can be rolled back")
            return rollback(s, version.id, actor=principal.actor)

        restored = await run_db(state, serving_rollback)
        await asyncio.to_thread(state.layers.reload)
    detail = await run_db(state, lambda s: version_detail(s, version.id))
    detail["restored"] = restored
    return json_response(detail)


def _register_proposal(s: Session, p: Proposal, actor: str) -> tuple[t.ModelVersion | None, str | None]:
    """The candidate a proposal becomes (or the pending one of its scope it joins), or why none."""
    pending = pending_of(s, p.layer, p.tenant)
    if pending is not None:
        return pending, "a candidate of this layer and scope is already before its gates"
    evidence = {"findings": p.findings, "why": p.why}
    try:
        if p.layer == HARNESS:
            return register_harness(s, tenant=p.tenant, overlay=p.spec["overlay"], name=None,  # type: ignore[arg-type]
                                    trigger="diagnosis proposal", actor=actor, on_serving=True, evidence=evidence), None
        assert p.tenant is not None
        return register_memory(s, tenant=p.tenant, facts=p.facts, name=None, trigger="diagnosis proposal",
                               actor=actor, evidence=evidence), None
    except (NothingNew, OverlayError) as e:
        return None, str(e)


def _proposals_route(state: AppState, lg: LayerGates) -> Endpoint:
    async def proposals(request: Request) -> Response:
        principal = await state.authenticate(request, admin=True)
        body: dict[str, Any] = {}
        if await request.body():
            body = await read_json(request, 16 * 1024)
        if not isinstance(body, dict) or set(body) - {"tenant", "wait"} or not isinstance(body.get("wait", False), bool):
            raise ApiError(422, 'body must be {"tenant"?: str, "wait"?: bool}')
        tenant = _string(body, "tenant")
        rules = _rules(state, request)

        def make(s: Session) -> list[dict[str, Any]]:
            d = diagnose(s, rules, tenant=tenant)
            g = gather(s, since=d.since, tenant=tenant, limit=rules.max_rows)
            out = []
            for p in propose(g, d.findings):
                row, note = _register_proposal(s, p, principal.actor)
                out.append({"layer": p.layer, "scope": p.tenant, "findings": p.findings, "note": note,
                            "version": None if row is None else {"id": row.id, "name": row.name}})
            return out

        made = await run_db(state, make)
        tasks = []
        for m in made:
            if m["version"] is not None:
                row = await run_db(state, lambda s, i=m["version"]["id"]: s.get(t.ModelVersion, i))
                tasks.append(_gate(state, lg, row, principal.actor))
        if body.get("wait") and tasks:
            await asyncio.gather(*(asyncio.shield(x) for x in tasks))
        for m in made:
            if m["version"] is not None:
                m["version"] = await run_db(state, lambda s, i=m["version"]["id"]: version_detail(s, i))
        return json_response({"proposals": made})

    return proposals


def _facts_route(state: AppState) -> Endpoint:
    async def facts(request: Request) -> Response:
        principal = await state.authenticate(request, admin=True)
        tenant = _string(dict(request.query_params), "tenant") or principal.tenant

        def read(s: Session) -> list[dict[str, Any]]:
            rows = s.scalars(select(t.MemoryFact).where(t.MemoryFact.tenant_id == tenant)
                             .order_by(t.MemoryFact.created_at, t.MemoryFact.id))
            return [{"id": f.id, "text": f.text, "source": f.source, "created_by": f.created_by,
                     "created_at": f.created_at.isoformat()} for f in rows]

        return json_response({"tenant": tenant, "facts": await run_db(state, read)})

    return facts

