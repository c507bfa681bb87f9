"""Model versions: registration, versioned hot-swap of every vLLM replica, rollback.

Routes (admin key):
- `GET /atdp/v1/versions`: every version, newest first, and what each replica serves now.
- `POST /atdp/v1/versions` `{"checkpoint": DIR, "name": str?, "parent": str?}`: registers the
  checkpoint as a version (or finds it by name) and swaps every replica to it.
- `POST /atdp/v1/versions/{id}/rollback`: the serving version is left (`rolled_back`) and the one
  that served before it is restored (`serving`), by the same swap.

A swap goes one replica at a time. For each: close its gate (new calls wait or go to another open
replica), wait until its in-flight calls drained, run vLLM's dev-mode sequence (pause, reload
weights, tag the weight version, resume), set `replica.version`, reopen. A call is stamped with
`replica.version` when it enters the gate and no call is in flight while the weights change, so every
output token's version is exact. If any replica fails, every replica already swapped (and the failed
one) is reloaded with the previous checkpoint: the old version keeps serving everywhere.

Who writes what: a trainer inserts its version row (`candidate`) together with its lineage and the
steps' `trained_version_id` in one transaction, then calls POST; the proxy only moves statuses. A
checkpoint posted by hand becomes a new `candidate` row here. When a candidate's swap fails it is
marked `failed` with the error, its lineage rows stay (what was tried), and its steps are released
(`trained_version_id` back to NULL) so a later update can train on them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
import orjson
from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from starlette.requests import Request
from starlette.responses import Response

from proxy import tables as t
from proxy import telemetry
from proxy.errors import ApiError
from proxy.ids import new_id
from proxy.upstream import Replica

log = logging.getLogger("atdp.versions")

BASE_NAME = "base"
EVER_SERVED = ("serving", "retired", "rolled_back")


@dataclass
class VersionRef:
    id: str
    name: str
    checkpoint: str


class SwapError(Exception):
    pass


# --- database helpers (also used by the trainer) ---------------------------------------------------


def serving_version(s: Session) -> t.ModelVersion | None:
    return s.scalars(
        select(t.ModelVersion).where(t.ModelVersion.status == "serving")
        .order_by(t.ModelVersion.served_at.desc().nulls_last(), t.ModelVersion.created_at.desc()).limit(1)
    ).first()


def find_version(s: Session, key: str) -> t.ModelVersion | None:
    """A version by id or by name."""
    return s.get(t.ModelVersion, key) or s.scalars(select(t.ModelVersion).where(t.ModelVersion.name == key)).first()


def next_name(s: Session) -> str:
    """`v<N>`, N one more than the number of versions (the caller retries on a name clash)."""
    n = s.scalar(select(func.count()).select_from(t.ModelVersion)) or 0
    while s.scalar(select(t.ModelVersion.id).where(t.ModelVersion.name == f"v{n}")):
        n += 1
    return f"v{n}"


def mark_failed(s: Session, version_id: str, error: str, *, actor: str = "system") -> int:
    """The candidate never served: status `failed` with the error, lineage kept, steps released.

    Returns how many steps were released for retraining.
    """
    s.execute(update(t.ModelVersion).where(t.ModelVersion.id == version_id)
              .values(status="failed", error=error[:4000], retired_at=datetime.now(UTC)))
    released = s.execute(
        update(t.Step).where(t.Step.trained_version_id == version_id).values(trained_version_id=None)
    ).rowcount
    s.add(t.AuditEvent(actor=actor, action="version.failed", target=version_id,
                       details={"error": error[:500], "released_steps": released}))
    return released


def version_json(s: Session, v: t.ModelVersion, *, lineage: bool = True) -> dict[str, Any]:
    from proxy.records import version_model

    body = version_model(s, v).model_dump(mode="json")
    if not lineage:
        body["lineage"] = len(body["lineage"])
    body["error"] = v.error
    body["retired_at"] = v.retired_at.isoformat() if v.retired_at else None
    return body


# --- the replica side --------------------------------------------------------------------------------


def _upstream_headers(state) -> dict[str, str]:
    key = getattr(state, "settings_upstream_key", None)
    return {"authorization": f"Bearer {key}"} if key else {}


async def _check(resp: httpx.Response, what: str) -> None:
    if resp.status_code >= 400:
        raise SwapError(f"{what} answered {resp.status_code}: {resp.text[:300]}")


async def load_weights(client: httpx.AsyncClient, replica: Replica, checkpoint: str, name: str, *,
                       headers: dict[str, str], timeout_s: float) -> None:
    """vLLM dev mode: pause (let running requests end), reload, tag the version, resume."""
    url = replica.url
    await _check(await client.post(url + "/pause", params={"mode": "wait"}, headers=headers, timeout=timeout_s),
                 f"{url}/pause")
    try:
        rpc = await client.post(url + "/collective_rpc", headers=headers, timeout=timeout_s,
                                json={"method": "reload_weights", "kwargs": {"weights_path": checkpoint}})
        await _check(rpc, f"{url} reload_weights({checkpoint})")
        tag = await client.post(url + "/update_weight_version", json={"new_version": name}, headers=headers,
                                timeout=timeout_s)
        await _check(tag, f"{url}/update_weight_version")
    finally:
        # Never leave a replica paused: it would hold every call sent to it.
        await _check(await client.post(url + "/resume", headers=headers, timeout=timeout_s), f"{url}/resume")


class Versions:
    """The proxy's view of versions: what serves now, and the one swap that may run at a time."""

    def __init__(self, state) -> None:
        self.state = state
        self.lock = asyncio.Lock()
        self.current: VersionRef | None = None
        self.ready = threading.Event()
        self.drain_timeout_s = state.settings.swap_drain_timeout_s
        self.load_timeout_s = state.settings.swap_load_timeout_s

    # --- start-up -------------------------------------------------------------------------------

    def start_up(self) -> None:
        """Read the serving version (registering `base` the first time), stamp replicas with it and
        tell each vLLM its name. Runs in a thread; retries until the upstream answers."""
        while True:
            try:
                self._start_up_once()
                self.ready.set()
                return
            except Exception as e:  # the upstream may still be starting
                log.warning("versions start-up: %s: %s; retrying", type(e).__name__, e)
                time.sleep(2.0)

    def _start_up_once(self) -> None:
        state = self.state
        with state.factory() as s, s.begin():
            row = serving_version(s)
            ref = VersionRef(row.id, row.name, row.checkpoint) if row else None
        roots = {r.url: _root(r.url, _upstream_headers(state)) for r in state.pool.replicas}
        if ref is None:
            root = next((x for x in roots.values() if x), None)
            if root is None:
                raise SwapError("no replica answered GET /v1/models: cannot name the base checkpoint")
            ref = self._register_base(root)
        for replica in state.pool.replicas:
            replica.version = ref.name
        self.current = ref
        for replica in state.pool.replicas:
            headers = _upstream_headers(state)
            try:
                reported = httpx.get(replica.url + "/weight_info", headers=headers, timeout=5.0).json()
                reported = reported.get("weight_version")
                fresh_base = reported == "default" and roots.get(replica.url) == ref.checkpoint
                if reported != ref.name and not fresh_base:
                    log.warning("replica %s reports weight version %r but the serving version is %r (%s); "
                                "its tokens are stamped %r", replica.url, reported, ref.name, ref.checkpoint, ref.name)
                httpx.post(replica.url + "/update_weight_version", json={"new_version": ref.name}, headers=headers,
                           timeout=5.0).raise_for_status()
            except Exception as e:
                log.warning("could not sync the weight version of %s: %s: %s", replica.url, type(e).__name__, e)
        log.info("serving version %s (%s) on %d replica(s)", ref.name, ref.checkpoint, len(state.pool.replicas))

    def _register_base(self, root: str) -> VersionRef:
        state = self.state
        for _ in range(3):
            try:
                with state.factory() as s, s.begin():
                    row = serving_version(s)
                    if row is None:
                        row = s.scalars(select(t.ModelVersion).where(t.ModelVersion.name == BASE_NAME)).first()
                        now = datetime.now(UTC)
                        if row is None:
                            row = t.ModelVersion(id=new_id(), name=BASE_NAME, checkpoint=root, status="serving",
                                                 served_at=now, created_at=now, metrics={})
                            s.add(row)
                        else:
                            row.status, row.served_at = "serving", now
                        s.add(t.AuditEvent(actor="system", action="version.base", target=row.id,
                                           details={"checkpoint": row.checkpoint}))
                    return VersionRef(row.id, row.name, row.checkpoint)
            except IntegrityError:  # another proxy registered it at the same moment
                continue
        raise SwapError("could not register the base version")

    # --- swaps ----------------------------------------------------------------------------------

    async def swap(self, target: VersionRef) -> dict[str, Any]:
        """Swap every replica to `target`, one at a time; on any failure restore the previous version
        everywhere. Returns {"ok", "error", "seconds", "replicas": [...]}; the caller records statuses."""
        state = self.state
        pool, client, headers = state.pool, state.client, _upstream_headers(state)
        previous = self.current
        if previous is None:
            raise ApiError(503, "the serving version is not known yet; try again shortly")
        t0 = time.perf_counter()
        done: list[Replica] = []
        timings: list[dict[str, Any]] = []
        try:
            for replica in pool.replicas:
                t_gate = time.perf_counter()
                async with pool.swapping(replica, self.drain_timeout_s):
                    t_load = time.perf_counter()
                    try:
                        await load_weights(client, replica, target.checkpoint, target.name, headers=headers,
                                           timeout_s=self.load_timeout_s)
                    except BaseException:
                        # The reload may have half-replaced the weights: put the old ones back before
                        # the gate reopens.
                        await self._restore(replica, previous)
                        raise
                    replica.version = target.name
                done.append(replica)
                timings.append({"url": replica.url, "drain_s": round(t_load - t_gate, 4),
                                "load_s": round(time.perf_counter() - t_load, 4)})
        except Exception as e:
            error = f"{type(e).__name__}: {e}" if str(e) else f"{type(e).__name__} (drain timeout?)"
            for replica in done:
                async with pool.swapping(replica, self.drain_timeout_s):
                    await self._restore(replica, previous)
            telemetry.SWAPS.labels("failed").inc()
            log.error("swap to %s failed (%s); %s serves on every replica", target.name, error, previous.name)
            return {"ok": False, "error": error, "seconds": time.perf_counter() - t0, "replicas": timings}
        seconds = time.perf_counter() - t0
        self.current = target
        telemetry.SWAPS.labels("ok").inc()
        telemetry.SWAP_SECONDS.observe(seconds)
        log.info("now serving %s on %d replica(s) (%.3f s)", target.name, len(done), seconds)
        return {"ok": True, "error": None, "seconds": seconds, "replicas": timings}

    async def _restore(self, replica: Replica, previous: VersionRef) -> None:
        try:
            await load_weights(self.state.client, replica, previous.checkpoint, previous.name,
                               headers=_upstream_headers(self.state), timeout_s=self.load_timeout_s)
            replica.version = previous.name
        except Exception as e:
            # The replica's weights are unknown now: keep calls away from it for a while.
            log.error("could not restore %s on %s: %s: %s", previous.name, replica.url, type(e).__name__, e)
            replica.mark_dead(30.0)

    async def wait_ready(self) -> None:
        if not self.ready.is_set() and not await asyncio.to_thread(self.ready.wait, 30.0):
            raise ApiError(503, "model versions are not loaded yet (database or upstream starting)")


def _root(url: str, headers: dict[str, str]) -> str | None:
    """The checkpoint a replica was started with: `root` of its first model in GET /v1/models."""
    try:
        data = httpx.get(url + "/v1/models", headers=headers, timeout=5.0).json().get("data") or []
    except Exception:
        return None
    return (data[0].get("root") or data[0].get("id")) if data else None


# --- routes ----------------------------------------------------------------------------------------


def install(app, state) -> None:
    versions = Versions(state)
    state.extra["versions"] = versions
    # Start-up work needs the database; it then talks to the replicas, so it gets its own thread.
    state.extra.setdefault("on_db", []).append(
        lambda st: threading.Thread(target=versions.start_up, name="atdp-versions", daemon=True).start()
    )
    app.add_api_route("/atdp/v1/versions", _list_route(state, versions), methods=["GET"])
    app.add_api_route("/atdp/v1/versions", _create_route(state, versions), methods=["POST"])
    app.add_api_route("/atdp/v1/versions/{version_id}/rollback", _rollback_route(state, versions), methods=["POST"])


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


async def _db(state, fn):
    from proxy.feedback import run_db

    return await run_db(state, fn)


def _list_route(state, versions: Versions):
    async def list_versions(request: Request) -> Response:
        await state.authenticate(request, admin=True)

        def read(s: Session) -> list[dict]:
            rows = s.scalars(select(t.ModelVersion).order_by(t.ModelVersion.created_at.desc())).all()
            return [version_json(s, v, lineage=False) for v in rows]

        rows = await _db(state, read)
        return _json({
            "data": rows,
            "serving": versions.current.name if versions.current else None,
            "replicas": [{"url": r.url, "version": r.version, "open": r.is_open, "alive": r.alive}
                         for r in state.pool.replicas],
        })

    return list_versions


def _create_route(state, versions: Versions):
    async def create(request: Request) -> Response:
        from proxy.app import read_json

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
                if row.status == "failed":
                    raise ApiError(409, f"version '{name}' failed to swap in; register the checkpoint under a new name")
                return VersionRef(row.id, row.name, row.checkpoint)
            parent_row = find_version(s, parent) if parent else None
            if parent and parent_row is None:
                raise ApiError(404, f"parent version '{parent}' not found")
            row = t.ModelVersion(
                id=new_id(), name=name or next_name(s), checkpoint=checkpoint, status="candidate",
                parent_id=parent_row.id if parent_row else (versions.current.id if versions.current else None),
                metrics={}, created_at=datetime.now(UTC),
            )
            s.add(row)
            s.add(t.AuditEvent(actor=principal.actor, action="version.register", target=row.id,
                               details={"name": row.name, "checkpoint": checkpoint}))
            return VersionRef(row.id, row.name, row.checkpoint)

        async with versions.lock:
            try:
                target = await _db(state, register)
            except IntegrityError:
                raise ApiError(409, f"version name '{name}' was just taken; retry") from None
            if versions.current is not None and versions.current.id == target.id:
                return _json(await _db(state, lambda s: _result(s, target.id, {"ok": True, "seconds": 0.0})))
            outcome = await versions.swap(target)
            await _db(state, lambda s: _record(s, target, outcome, actor=principal.actor, left_status="retired",
                                                candidate=True))
            body = await _db(state, lambda s: _result(s, target.id, outcome))
        return _json(body, 200 if outcome["ok"] else 502)

    return create


def _rollback_route(state, versions: Versions):
    async def rollback(request: Request) -> Response:
        principal = await state.authenticate(request, admin=True)
        await versions.wait_ready()
        key = request.path_params["version_id"]

        def plan(s: Session) -> tuple[str, VersionRef]:
            row = find_version(s, key)
            if row is None:
                raise ApiError(404, f"version '{key}' not found")
            if row.status != "serving":
                raise ApiError(409, f"version '{row.name}' is {row.status}; only the serving version can be rolled back")
            prev = s.scalars(
                select(t.ModelVersion)
                .where(t.ModelVersion.id != row.id, t.ModelVersion.status == "retired",
                       t.ModelVersion.served_at.is_not(None))
                .order_by(t.ModelVersion.served_at.desc()).limit(1)
            ).first()
            if prev is None:
                raise ApiError(409, f"no earlier version to roll back to from '{row.name}'")
            return row.id, VersionRef(prev.id, prev.name, prev.checkpoint)

        async with versions.lock:
            left_id, target = await _db(state, plan)
            outcome = await versions.swap(target)
            await _db(state, lambda s: _record(s, target, outcome, actor=principal.actor, left_status="rolled_back",
                                                candidate=False, left_id=left_id))
            body = await _db(state, lambda s: _result(s, target.id, outcome, left_id=left_id))
        return _json(body, 200 if outcome["ok"] else 502)

    return rollback


def _record(s: Session, target: VersionRef, outcome: dict, *, actor: str, left_status: str, candidate: bool,
            left_id: str | None = None) -> None:
    """Statuses after a swap. Success: the target serves, the one(s) it replaced are `left_status`.
    Failure: a new candidate is `failed` (steps released); an existing version keeps its status."""
    now = datetime.now(UTC)
    if outcome["ok"]:
        s.execute(update(t.ModelVersion).where(t.ModelVersion.status == "serving", t.ModelVersion.id != target.id)
                  .values(status=left_status, retired_at=now))
        s.execute(update(t.ModelVersion).where(t.ModelVersion.id == target.id)
                  .values(status="serving", served_at=now, retired_at=None, error=None))
        s.add(t.AuditEvent(actor=actor, action="version.rollback" if left_id else "version.swap", target=target.id,
                           details={"name": target.name, "seconds": round(outcome["seconds"], 4),
                                    "replicas": outcome["replicas"], "left": left_id}))
    elif candidate:
        mark_failed(s, target.id, outcome["error"], actor=actor)
    else:
        s.add(t.AuditEvent(actor=actor, action="version.swap_failed", target=target.id,
                           details={"name": target.name, "error": outcome["error"]}))


def _result(s: Session, version_id: str, outcome: dict, left_id: str | None = None) -> dict[str, Any]:
    body = version_json(s, s.get(t.ModelVersion, version_id, populate_existing=True), lineage=False)
    body["swap"] = {k: outcome.get(k) for k in ("ok", "error", "seconds", "replicas")}
    if left_id is not None:
        left = s.get(t.ModelVersion, left_id, populate_existing=True)
        body["rolled_back"] = {"id": left.id, "name": left.name, "status": left.status}
    return body
