"""Model versions: the routes that register, swap in and roll back versions.

Routes (admin key):
- `GET /atdp/v1/versions`: every version, newest first, and what each replica serves now.
- `POST /atdp/v1/versions` `{"checkpoint": DIR, "name": str?, "parent": str?}`: registers the
  checkpoint as a version (or finds it by name) and swaps every replica to it.
- `POST /atdp/v1/versions/{id}/rollback`: the serving version is left (`rolled_back`) and the one
  that served before it is restored (`serving`), by the same swap.

The swap itself (gate, drain, reload, restore on failure) is `proxy.control.swap`; the version rows
it moves are `proxy.store.versions`.

Who writes what: a trainer inserts its version row (`candidate`) together with its lineage and the
steps' `trained_version_id` in one transaction, then calls POST; the proxy only moves statuses. A
checkpoint posted by hand becomes a new `candidate` row here. When a candidate's swap fails it is
marked `failed` with the error, its lineage rows stay (what was tried), and its steps are released
(`trained_version_id` back to NULL) so a later update can train on them.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from starlette.requests import Request
from starlette.responses import Response

from atdp_schema.models import VersionStatus
from proxy.control.swap import Versions
from proxy.errors import ApiError
from proxy.http import Endpoint, Route, json_response, read_json, run_db
from proxy.state import AppState
from proxy.store import tables as t
from proxy.store.ids import new_id
from proxy.store.versions import VersionRef, find_version, next_name, record_swap, swap_result, version_json

log = logging.getLogger("atdp.versions")


def routes(state: AppState, versions: Versions) -> list[Route]:
    return [
        Route("/atdp/v1/versions", _list_route(state, versions), ("GET",)),
        Route("/atdp/v1/versions", _create_route(state, versions), ("POST",)),
        Route("/atdp/v1/versions/{version_id}/rollback", _rollback_route(state, versions), ("POST",)),
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
            "replicas": [{"url": r.label, "version": r.version, "open": r.is_open, "alive": r.alive}
                         for r in state.pool.replicas],
        })

    return list_versions


def _create_route(state: AppState, versions: Versions) -> Endpoint:
    async def create(request: Request) -> Response:
        principal = await state.authenticate(request, admin=True)
        body = await read_json(request, 64 * 1024)
        if not isinstance(body, dict) or not isinstance(body.get("checkpoint"), str) or not body["checkpoint"]:
            raise ApiError(422, "body must be {\"checkpoint\": DIR, \"name\"?: str, \"parent\"?: str}")
        unknown = sorted(set(body) - {"checkpoint", "name", "parent"})
        if unknown:
            raise ApiError(422, f"unknown fields {unknown}")
        for key in ("name", "parent"):
            if body.get(key) is not None and (not isinstance(body[key], str) or not 0 < len(body[key]) <= 128):
                raise ApiError(422, f"'{key}' must be a string of 1 to 128 characters")
        await versions.wait_ready()
        checkpoint, name, parent = body["checkpoint"], body.get("name"), body.get("parent")

        def register(s: Session) -> VersionRef:
            row = find_version(s, name) if name else None
            if row is not None:
                if row.checkpoint != checkpoint:
                    raise ApiError(409, f"version '{name}' exists with another checkpoint ({row.checkpoint})")
                if row.status == VersionStatus.failed:
                    raise ApiError(409, f"version '{name}' failed to swap in; register the checkpoint under a new name")
                return VersionRef(row.id, row.name, row.checkpoint)
            parent_row = find_version(s, parent) if parent else None
            if parent and parent_row is None:
                raise ApiError(404, f"parent version '{parent}' not found")
            row = t.ModelVersion(
                id=new_id(), name=name or next_name(s), checkpoint=checkpoint, status=VersionStatus.candidate,
                parent_id=parent_row.id if parent_row else (versions.current.id if versions.current else None),
                metrics={}, created_at=datetime.now(UTC),
            )
            s.add(row)
            s.add(t.AuditEvent(actor=principal.actor, action="version.register", target=row.id,
                               details={"name": row.name, "checkpoint": checkpoint}))
            return VersionRef(row.id, row.name, row.checkpoint)

        async with versions.lock:
            try:
                target = await run_db(state, register)
            except IntegrityError:
                raise ApiError(409, f"version name '{name}' was just taken; retry") from None
            if versions.current is not None and versions.current.id == target.id:
                return json_response(await run_db(state, lambda s: swap_result(s, target.id, {"ok": True, "seconds": 0.0})))
            outcome = await versions.swap(target)
            await run_db(state, lambda s: record_swap(s, target, outcome, actor=principal.actor, left_status=VersionStatus.retired,
                                                candidate=True))
            body = await run_db(state, lambda s: swap_result(s, target.id, outcome))
        return json_response(body, 200 if outcome["ok"] else 502)

    return create


def _rollback_route(state: AppState, versions: Versions) -> Endpoint:
    async def rollback(request: Request) -> Response:
        principal = await state.authenticate(request, admin=True)
        await versions.wait_ready()
        key = request.path_params["version_id"]

        def plan(s: Session) -> tuple[str, VersionRef]:
            row = find_version(s, key)
            if row is None:
                raise ApiError(404, f"version '{key}' not found")
            if row.status != VersionStatus.serving:
                raise ApiError(409, f"version '{row.name}' is {row.status}; only the serving version can be rolled back")
            prev = s.scalars(
                select(t.ModelVersion)
                .where(t.ModelVersion.id != row.id, t.ModelVersion.status == VersionStatus.retired,
                       t.ModelVersion.served_at.is_not(None))
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


