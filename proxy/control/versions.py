"""Model versions: the routes that register, swap in and roll back versions.

Routes (admin key; POST also a key scoped `versions:write`, the trainer's):
- `GET /atdp/v1/versions`: every version, newest first, and what each replica serves now.
- `POST /atdp/v1/versions` `{"checkpoint": DIR, "name"?, "parent"?, "promote"?: "now", "reason"?,
  "wait"?: bool}`: registers the checkpoint as a `candidate` (or finds it by name) and starts its gates
  in the background (proxy.rollout.gates): 202 with the version; gates passed -> `canary` (when the
  canary is on; then `serving` or `rolled_back`) or `serving`, failed -> `rejected`. `"wait": true` answers when the gates (and the swap) are done.
  `"promote": "now"` is the operator override: audited (`version.promote_override`: who, when, why),
  shown on the card, and swaps at once as before the gates existed; also how a retired version is
  served again.
- `GET /atdp/v1/versions/{id}` (id or name): status, every gate's state and numbers, the override.
- `GET /atdp/v1/versions/{id}/card`: the version card (proxy.store.cards).
- `POST /atdp/v1/versions/{id}/rollback`: the serving version is left (`rolled_back`) and the one
  that served before it is restored (`serving`), by the same swap. On a version in `canary`, ends
  its canary: its replica group gets the serving weights back (proxy.rollout.canary).

The swap itself (gate, drain, reload, restore on failure) is `proxy.rollout.swap`; the version rows
it moves are `proxy.store.versions`.

Who writes what: a trainer inserts its version row (`candidate`) together with its lineage and the
steps' `trained_version_id` in one transaction, then calls POST; the proxy only moves statuses. A
checkpoint posted by hand becomes a new `candidate` row here. When a candidate's swap fails it is
marked `failed` with the error, its lineage rows stay (what was tried), and its steps are released
(`trained_version_id` back to NULL) so a later update can train on them.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from starlette.requests import Request
from starlette.responses import Response

from atdp_schema.models import VersionStatus
from proxy.control import layers
from proxy.errors import ApiError
from proxy.http import Endpoint, Route, json_response, path_id, read_json, run_db
from proxy.rollout.canary import rollback_now
from proxy.rollout.gates import run_gates
from proxy.rollout.layer_gates import LayerGates
from proxy.rollout.swap import Versions
from proxy.shapes import id_problem, text_problem
from proxy.state import AppState
from proxy.store import tables as t
from proxy.store.cards import version_card
from proxy.store.ids import new_id
from proxy.store.layers import LAYERS
from proxy.store.versions import (
    POLICY,
    VersionRef,
    find_version,
    next_name,
    record_override,
    record_swap,
    swap_result,
    version_detail,
    version_json,
)

log = logging.getLogger("atdp.versions")


def routes(state: AppState, versions: Versions, lg: LayerGates) -> list[Route]:
    return [
        Route("/atdp/v1/versions", _list_route(state, versions), ("GET",)),
        Route("/atdp/v1/versions", _create_route(state, versions, lg), ("POST",)),
        Route("/atdp/v1/versions/{version_id}", _show_route(state, versions), ("GET",)),
        Route("/atdp/v1/versions/{version_id}/card", _card_route(state), ("GET",)),
        Route("/atdp/v1/versions/{version_id}/rollback", _rollback_route(state, versions), ("POST",)),
        *layers.routes(state, lg),
    ]


def _list_route(state: AppState, versions: Versions) -> Endpoint:
    async def list_versions(request: Request) -> Response:
        await state.authenticate(request, admin=True)

        def read(s: Session) -> list[dict]:
            rows = s.scalars(select(t.ModelVersion).order_by(t.ModelVersion.created_at.desc())).all()
            return [version_json(s, v, lineage=False) for v in rows]

        rows = await run_db(state, read)
        return json_response({
            "data": rows,
            "serving": versions.current.name if versions.current else None,
            "canary": state.canary.active.candidate if state.canary.active else None,
            "replicas": [{"url": r.label, "version": r.version, "open": r.is_open, "alive": r.alive}
                         for r in state.pool.replicas],
        })

    return list_versions


PENDING = (VersionStatus.candidate, VersionStatus.evaluating)
CREATE_FIELDS = {"checkpoint", "name", "parent", "promote", "reason", "wait"}
CREATE_SHAPE = ('body must be {"checkpoint": DIR, "name"?: str, "parent"?: str, "promote"?: "now", '
                '"reason"?: str, "wait"?: bool}')


def checkpoint_problem(checkpoint: str, roots: list[Path]) -> str | None:
    """Why `checkpoint` may not be registered, or None: it must be an absolute path that, with `..`
    and symbolic links resolved, lies inside one of `roots` (ATDP_CHECKPOINT_ROOTS)."""
    path = Path(checkpoint)
    if not path.is_absolute():
        return "must be an absolute path"
    try:
        real = path.resolve()
    except (OSError, RuntimeError):
        return "cannot be resolved"
    if not any(real.is_relative_to(root.resolve()) for root in roots):
        return "is outside the configured checkpoint roots (ATDP_CHECKPOINT_ROOTS)"
    return None


def _create_route(state: AppState, versions: Versions, lg: LayerGates) -> Endpoint:
    async def create(request: Request) -> Response:
        principal = await state.authenticate(request, admin=True, scope="versions:write")
        body = await read_json(request, 64 * 1024)
        if isinstance(body, dict) and body.get("layer") in LAYERS:  # harness and memory (proxy.control.layers)
            return await layers.create(state, lg, principal, body)
        if isinstance(body, dict) and body.get("layer") not in (None, POLICY):
            raise ApiError(422, "'layer' must be \"policy\" (a checkpoint), \"harness\" or \"memory\"", param="layer")
        body = {k: v for k, v in body.items() if k != "layer"} if isinstance(body, dict) else body
        if not isinstance(body, dict) or not isinstance(body.get("checkpoint"), str) or not body["checkpoint"]:
            raise ApiError(422, CREATE_SHAPE)
        unknown = sorted(set(body) - CREATE_FIELDS)
        if unknown:
            raise ApiError(422, f"unknown fields {unknown}; {CREATE_SHAPE}")
        for key in ("name", "parent", "reason"):
            if body.get(key) is not None and (not isinstance(body[key], str) or not 0 < len(body[key]) <= 128
                                              or id_problem(body[key])):
                raise ApiError(422, f"'{key}' must be a string of 1 to 128 characters without control characters",
                               param=key)
        if body.get("name") is not None and not (body["name"].isascii() and body["name"].isprintable()):
            raise ApiError(422, "'name' must be printable ASCII (it is echoed in the x-atdp-model-version header)",
                           param="name")
        if problem := text_problem(body["checkpoint"], 4096):
            raise ApiError(422, f"'checkpoint' {problem}", param="checkpoint")
        if body.get("promote") not in (None, "now"):
            raise ApiError(422, "'promote' must be \"now\" (the operator override that skips the gates) or absent",
                           param="promote")
        if not isinstance(body.get("wait", False), bool):
            raise ApiError(422, "'wait' must be true or false", param="wait")
        await versions.wait_ready()
        checkpoint, name, parent = body["checkpoint"], body.get("name"), body.get("parent")
        override = body.get("promote") == "now"
        if override and not principal.is_admin:  # a scoped (trainer's) key never skips the gates
            raise ApiError(403, "\"promote\": \"now\" needs the admin key", type="permission_error")
        if override and (running := state.canary.active) is not None:  # before anything is registered
            raise ApiError(409, f"a canary of '{running.candidate}' is running; roll it back "
                                f"(POST /atdp/v1/versions/{running.candidate}/rollback) or wait for its decision")

        def register(s: Session) -> tuple[VersionRef, str]:
            row = find_version(s, name) if name else None
            if row is not None:
                if row.checkpoint != checkpoint:
                    raise ApiError(409, f"version '{name}' exists with another checkpoint ({row.checkpoint})")
                if row.status in (VersionStatus.failed, VersionStatus.rejected):
                    raise ApiError(409, f"version '{name}' is {row.status}; register the checkpoint under a new name")
                if not override and row.status not in (*PENDING, VersionStatus.serving):
                    raise ApiError(409, f"version '{name}' is {row.status}; serve it again with \"promote\": \"now\" "
                                        "or roll back to it")
                if override and row.status != VersionStatus.serving:
                    record_override(s, row.id, actor=principal.actor, reason=body.get("reason"))
                return VersionRef(row.id, row.name, row.checkpoint), row.status
            # A checkpoint new to the proxy must lie under a configured root (a known version's
            # was vetted when it was registered, or is the engine's own model).
            if problem := checkpoint_problem(checkpoint, state.settings.allowed_checkpoint_roots):
                raise ApiError(400, f"'checkpoint' {problem}", param="checkpoint")
            parent_row = find_version(s, parent) if parent else None
            if parent and parent_row is None:
                raise ApiError(404, f"parent version '{parent}' not found")
            row = t.ModelVersion(
                id=new_id(), name=name or next_name(s), checkpoint=checkpoint, status=VersionStatus.candidate,
                parent_id=parent_row.id if parent_row else (versions.current.id if versions.current else None),
                metrics={}, created_at=datetime.now(UTC),
            )
            s.add(row)
            s.flush()
            s.add(t.AuditEvent(actor=principal.actor, action="version.register", target=row.id,
                               details={"name": row.name, "checkpoint": checkpoint}))
            if override:
                record_override(s, row.id, actor=principal.actor, reason=body.get("reason"))
            return VersionRef(row.id, row.name, row.checkpoint), row.status

        try:
            target, status = await run_db(state, register)
        except IntegrityError:
            raise ApiError(409, f"version name '{name}' was just taken; retry") from None
        if status == VersionStatus.serving or not override:
            if status in PENDING:  # joins the gates already running, or (after a restart) runs them again
                task = versions.start_gates(target, lambda: run_gates(state, versions, target, actor=principal.actor))
                outcome = await asyncio.shield(task) if body.get("wait") else None
            detail = await run_db(state, lambda s: version_detail(s, target.id))
            if status in PENDING and outcome is not None:  # the promotion's swap, as the override reports it
                detail["swap"] = {k: outcome.get(k) for k in ("ok", "error", "seconds", "replicas")}
            pending = detail["status"] in PENDING
            return json_response(detail, 202 if pending else 502 if detail["status"] == VersionStatus.failed else 200)
        async with versions.lock:  # the operator override: swap now, as before the gates existed
            if versions.current is not None and versions.current.id == target.id:
                return json_response(await run_db(state, lambda s: swap_result(s, target.id, {"ok": True, "seconds": 0.0})))
            outcome = await versions.swap(target)
            await run_db(state, lambda s: record_swap(s, target, outcome, actor=principal.actor, left_status=VersionStatus.retired,
                                                candidate=status == VersionStatus.candidate))
            body = await run_db(state, lambda s: swap_result(s, target.id, outcome))
        return json_response(body, 200 if outcome["ok"] else 502)

    return create


def _show_route(state: AppState, versions: Versions) -> Endpoint:
    async def show(request: Request) -> Response:
        await state.authenticate(request, admin=True)
        key = request.path_params["version_id"]

        def read(s: Session) -> dict:
            row = find_version(s, key)
            if row is None:
                raise ApiError(404, f"version '{key}' not found")
            return version_detail(s, row.id)

        return json_response(await run_db(state, read))

    return show


def _card_route(state: AppState) -> Endpoint:
    async def card(request: Request) -> Response:
        await state.authenticate(request, admin=True)
        key = request.path_params["version_id"]

        def read(s: Session) -> dict:
            found = version_card(s, key)
            if found is None:
                raise ApiError(404, f"version '{key}' not found")
            return found

        return json_response(await run_db(state, read))

    return card


def _rollback_route(state: AppState, versions: Versions) -> Endpoint:
    async def rollback(request: Request) -> Response:
        principal = await state.authenticate(request, admin=True)
        await versions.wait_ready()
        key = path_id(request, "version_id")
        row = await run_db(state, lambda s: find_version(s, key))
        if row is not None and row.layer in LAYERS:
            return await layers.rollback_layer(state, principal, row)
        if row is not None and row.status == VersionStatus.canary:  # ends the canary (gate 3)
            outcome = await rollback_now(state, versions, row.id, actor=principal.actor)
            if outcome is None:
                raise ApiError(409, f"version '{row.name}' is canary but its canary is not running on this proxy")
            detail = await run_db(state, lambda s: version_detail(s, row.id))
            detail["swap"] = {k: outcome.get(k) for k in ("ok", "error", "seconds", "replicas")}
            return json_response(detail, 200 if outcome["ok"] else 502)
        if (running := state.canary.active) is not None:
            raise ApiError(409, f"a canary of '{running.candidate}' is running; roll it back first")

        def plan(s: Session) -> tuple[str, VersionRef]:
            row = find_version(s, key)
            if row is None:
                raise ApiError(404, f"version '{key}' not found")
            if row.status != VersionStatus.serving:
                raise ApiError(409, f"version '{row.name}' is {row.status}; only the serving version can be rolled back")
            prev = s.scalars(
                select(t.ModelVersion)
                .where(t.ModelVersion.id != row.id, t.ModelVersion.status == VersionStatus.retired,
                       t.ModelVersion.served_at.is_not(None), t.ModelVersion.layer == POLICY)
                .order_by(t.ModelVersion.served_at.desc()).limit(1)
            ).first()
            if prev is None:
                raise ApiError(409, f"no earlier version to roll back to from '{row.name}'")
            return row.id, VersionRef(prev.id, prev.name, prev.checkpoint)

        async with versions.lock:
            left_id, target = await run_db(state, plan)
            outcome = await versions.swap(target)
            await run_db(state, lambda s: record_swap(s, target, outcome, actor=principal.actor, left_status=VersionStatus.rolled_back,
                                                candidate=False, left_id=left_id))
            body = await run_db(state, lambda s: swap_result(s, target.id, outcome, left_id=left_id))
        return json_response(body, 200 if outcome["ok"] else 502)

    return rollback


