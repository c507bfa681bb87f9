"""One model call, shared by every front door: session -> upstream -> capture -> recorder.

A door (chat, messages, responses) parses its request, says which of its messages are the input and
which outputs the client will echo back next turn, and shapes the answer. Everything else —
continuation linking, replica choice and failover, the swap gate, timing, capture and handing the
step to the recorder — happens here, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson
from starlette.requests import Request

from proxy import providers, telemetry
from proxy.auth import Principal, header_map
from proxy.engine import EngineUnreachable, UpstreamError, UpstreamResponse
from proxy.errors import ApiError
from proxy.layers.serving import Applied
from proxy.providers import ProviderResponse, ProviderRoute
from proxy.record.capture import CapturedStep, ChatCapture, ToolResultIn, history_extras, shared
from proxy.sessions import (
    IDEMPOTENCY_HEADER,
    Continuation,
    SessionRef,
    StepLink,
    body_hash,
    is_output,
    link_seed,
    match_key,
    prefix_hashes,
    resolve,
    retry_signal,
    unknown_keys,
)
from proxy.state import AppState
from proxy.store.ids import new_id
from proxy.store.links import LinkRow
from proxy.tito import NoScaleOut, TitoResponse, TitoStream, TitoUnavailable, answer, open_stream
from proxy.translate import TranslationError
from proxy.upstream import Lease, NoReplicaAvailable, Replica, ReplicaFailed, failover, upstream_error

# A replica's answer, or a provider's behind the same interface.
Answer = UpstreamResponse | ProviderResponse | TitoResponse | TitoStream

log = logging.getLogger("atdp.call")


@dataclass
class Call:
    state: AppState
    principal: Principal
    api: str
    step_id: str
    session: SessionRef
    continuation: Continuation
    seed: str  # what its continuation keys are seeded with (sessions.link_seed)
    hashes: list[str]
    body_hash: str  # the request's fingerprint: a later identical call may be a retry (sessions.py)
    native_messages: list[Any]
    system: Any
    tools: Any
    tool_results: list[ToolResultIn]
    params: dict[str, Any]
    model: str | None
    client_info: dict[str, Any]
    started_at: datetime
    t0: float
    start_ns: int
    capture: ChatCapture = field(default_factory=ChatCapture)
    lease: Lease | None = None
    version: str | None = None  # weight version of the replica that served the call
    # (before, after) when a keep-mode swap overlapped the call (Lease.window): its tokens' version
    # is not known from the proxy's side.
    version_window: tuple[str, str] | None = None
    upstream_url: str | None = None
    ttft_s: float | None = None
    finished: bool = False
    replay_of: str | None = None
    provider: ProviderRoute | None = None  # set when the routing table sent the call to a provider
    published: asyncio.Future[bool] | None = None  # its continuation keys, on their way to other proxies
    prompt_path: str | None = None  # "tito" | "rendered" once an engine took the call (proxy.tito)
    layers: Applied = field(default_factory=Applied)  # the harness and memory versions it was sent with

    @property
    def link(self) -> StepLink:
        return StepLink(step_id=self.step_id, session_id=self.session.external_id)

    @property
    def parent_step(self) -> StepLink | None:
        """The step this call continues; None for a session's first step (and its retries)."""
        parent = self.continuation.parent
        return parent if parent is not None and parent.step_id else None

    @property
    def new_messages(self) -> list[Any]:
        return self.native_messages[self.continuation.history_len :]

    def response_headers(self) -> dict[str, str]:
        headers = {"x-atdp-session-id": self.session.external_id, "x-atdp-step-id": self.step_id}
        # The version that served the call, as the step records it: only once a replica took the call
        # (an answer of ours, such as "no replica", has none). Version names are printable ASCII
        # (checked when registered); a header cannot carry other characters.
        if self.version is not None and self.version.isascii() and self.version.isprintable():
            headers["x-atdp-model-version"] = self.version
        if self.layers.harness is not None:  # layer names are printable ASCII (h<N>, m<N>, or checked)
            headers["x-atdp-harness-version"] = self.layers.harness.name
        if self.layers.memory is not None:
            headers["x-atdp-memory-version"] = self.layers.memory.name
        return headers

    def mark_token(self) -> None:
        if self.ttft_s is None:
            self.ttft_s = time.perf_counter() - self.t0


async def begin(state: AppState, request: Request, principal: Principal, *, api: str, body: dict[str, Any],
                raw_body: bytes, messages: list[Any], system: Any = None, tools: Any = None, tool_results_of=None,
                params: dict[str, Any] | None = None, path_session: str | None = None) -> Call:
    """Resolve the session and parent step of a call: in memory, or (when this proxy's memory does
    not know the parent) with one read of the database's keys (proxy.store.links)."""
    t0 = time.perf_counter()
    headers = header_map(request.scope)
    seed = link_seed(principal.tenant, principal.actor, body)
    hashes = prefix_hashes(seed, [match_key(m) for m in messages])
    fingerprint = body_hash(seed, raw_body, headers.get(IDEMPOTENCY_HEADER, ""))
    retry = retry_signal(headers)
    session, cont = resolve(tenant=principal.tenant, headers=headers, path_session=path_session, body=body,
                            hashes=hashes, index=state.index, fingerprint=fingerprint, retry=retry)
    links = state.links
    if links is not None and (wanted := unknown_keys(cont, session, hashes, messages, inputs=links.shared,
                                                     retry_key=fingerprint if retry else None)):
        rows = await links.lookup(wanted, principal.tenant)
        if rows:
            state.index.learn(rows)
            session, cont = resolve(tenant=principal.tenant, headers=headers, path_session=path_session,
                                    body=body, hashes=hashes, index=state.index, fingerprint=fingerprint, retry=retry)
    new = messages[cont.history_len :]
    call = Call(
        state=state, principal=principal, api=api, step_id=new_id(), session=session, continuation=cont, seed=seed,
        hashes=hashes, body_hash=fingerprint, native_messages=messages, system=system, tools=tools,
        tool_results=tool_results_of(new) if tool_results_of else [], params=params or {},
        model=body.get("model"), client_info=_client_info(headers), started_at=datetime.now(UTC),
        t0=t0, start_ns=time.time_ns(),
    )
    # Running: a retry the client sends before this call ends (it timed out) joins its session.
    state.index.begin_input(fingerprint, call.link, call.parent_step, cont.history_len)
    return call


def _client_info(headers: Mapping[str, str]) -> dict[str, Any]:
    info = {}
    for h in ("user-agent", "x-stainless-lang", "x-stainless-package-version", "anthropic-version", "originator"):
        if v := headers.get(h):
            info[h] = v[:200]
    return info


def with_stream_interval(body: dict[str, Any], interval: int) -> dict[str, Any]:
    """Ask vLLM for `interval` output tokens per streamed chunk (`ATDP_STREAM_INTERVAL`). A client's
    own larger value stands; one that is not a positive integer is passed on as sent, for vLLM to refuse."""
    asked = body.get("stream_interval")
    if asked is None or (type(asked) is int and 1 <= asked < interval):
        return {**body, "stream_interval": interval}
    return body


async def open_upstream(call: Call, upstream_body: dict[str, Any], *, path: str = "/v1/chat/completions"
                        ) -> Answer:
    """Send the call to a replica (sticky per session, failing over while nothing reached the client),
    or to a provider when the routing table says so (`proxy.providers`, same interface).

    Returns the upstream response with its headers read and its body not yet consumed; the caller
    must `close_upstream`. Raises UpstreamError (502/503) when no replica could take it.
    """
    state = call.state
    if (state.layers.active or state.shadow.runs) and path == "/v1/chat/completions":  # proxy.layers
        client_body = upstream_body
        upstream_body, call.layers = await state.layers.apply(upstream_body, call.principal.tenant,
                                                              call.session.external_id,
                                                              continues=call.continuation.history_len > 0)
        if state.shadow.runs:  # a candidate in its shadow gate may mirror this call, off its path
            state.shadow.offer(client_body, upstream_body, call.principal.tenant, call.layers)
    route = state.routes.match(call.model)
    if route is not None:
        call.provider, call.version, call.upstream_url = route, route.target(str(call.model)), route.label
        return await providers.open_provider(route, upstream_body)
    if upstream_body.get("stream") and state.settings.stream_interval > 1:
        upstream_body = with_stream_interval(upstream_body, state.settings.stream_interval)
    content = orjson.dumps(upstream_body)
    engine = state.engine_client
    assert engine is not None, "the app is not started"
    call.prompt_path = "rendered"
    parent_ids = _tito_parent(call, path, upstream_body)

    async def attempt(replica: Replica) -> UpstreamResponse:
        try:
            lease = await state.pool.acquire(replica)
        except NoReplicaAvailable as e:
            raise ReplicaFailed(str(e), 503) from None
        if parent_ids is not None and state.tokens.may_ask(replica.url):
            try:
                tito = await (open_stream if upstream_body.get("stream") else answer)(
                    engine, replica.url, upstream_body, parent_ids)
            except NoScaleOut as e:  # not this engine's routes: stop asking it for a while
                state.tokens.engine_lacks_routes(replica.url)
                log.warning("%s: %s; continuations render", replica.label, e)
            except TitoUnavailable as e:
                log.info("step %s renders its prompt: %s", call.step_id, e)
            except EngineUnreachable:
                pass  # the chat route below meets the same failure and handles it (failover)
            else:
                replica.mark_alive()
                call.lease, call.version, call.upstream_url = lease, lease.version, replica.label
                call.prompt_path = "tito"
                return tito
        try:
            resp = await engine.open(replica.url, path, content)
        except EngineUnreachable as e:
            state.pool.release(lease)
            replica.mark_dead()
            telemetry.UPSTREAM_FAILURES.labels(replica.label).inc()
            # The library's messages name the host it tried; never the URL's credentials (`label`).
            raise ReplicaFailed(f"{replica.label}: {e.kind}: {e.detail}".rstrip(": ")) from None
        if resp.status_code >= 500:
            # The slot is released however the error body's read ends: a read that fails here must
            # not leave the replica counted busy, or its next swap waits for a call that is gone.
            try:
                detail = (await resp.aread())[:500].decode(errors="replace")
            except UpstreamError as e:
                detail = e.message
            finally:
                await resp.aclose()
                state.pool.release(lease)
            replica.mark_dead(1.0)
            telemetry.UPSTREAM_FAILURES.labels(replica.label).inc()
            raise ReplicaFailed(f"{replica.label} answered {resp.status_code}: {detail}")
        replica.mark_alive()
        call.lease, call.version, call.upstream_url = lease, lease.version, replica.label
        return resp

    # A canary running (gate 3): the session's arm decides which replicas may serve it.
    route = await state.canary.route(call.principal.tenant, call.session.external_id,
                                     continues=call.continuation.history_len > 0)
    return await failover(state.pool, call.session.external_id, attempt, route.replicas if route else None)


def _tito_parent(call: Call, path: str, body: dict[str, Any]) -> list[int] | None:
    """The parent's prompt+output ids when this call may take the token-in-token-out path, else None."""
    parent = call.continuation.parent
    on = call.state.settings.tito and (call.state.settings.tito_stream or not body.get("stream"))
    if (not on or path != "/v1/chat/completions" or parent is None or not parent.step_id
            or body.get("n", 1) not in (1, None) or "continue_final_message" in body
            or "add_generation_prompt" in body):
        return None
    if any(is_output(m) for m in call.new_messages):
        return None  # a model turn the client wrote after the parent's answer: not the parent's tokens
    return call.state.tokens.get(parent.step_id)


def _note_window(call: Call) -> None:
    if call.lease is not None and call.version_window is None:
        call.version_window = call.lease.window()


async def close_upstream(call: Call, resp: Answer | None) -> None:
    if call.lease is not None:
        _note_window(call)
        call.state.pool.release(call.lease)
        call.lease = None
    if resp is not None:
        with contextlib.suppress(Exception):
            await resp.aclose()


def finish(call: Call, *, status: str, error: dict[str, Any] | None = None, native_output: Any = None,
           output_units: list[Any] | None = None, tool_names: dict[str, str] | None = None,
           upstream: str | None = None) -> None:
    """Record the call as a step (once), link it for continuation, and count it."""
    if call.finished:
        return
    call.finished = True
    _note_window(call)  # a stream is recorded before its replica slot is freed
    cap = call.capture
    total_s = time.perf_counter() - call.t0
    link = call.link
    parent_step = call.parent_step
    transcript_hash = None
    # What a retry of this request joins (sessions.py): answered, or not (an error, a cut-off stream).
    call.state.index.end_input(call.body_hash, link, parent_step, call.continuation.history_len,
                               delivered=status == "ok")
    rows = [LinkRow(call.body_hash, "i", call.step_id, link.session_id,
                    parent_step.step_id if parent_step else None, call.continuation.history_len)]
    if status == "ok":
        # The client's next call will start with these messages + what we answered.
        units = output_units if output_units is not None else [cap.assistant_message()]
        extended = prefix_hashes(call.seed, [match_key(m) for m in units],
                                 start=call.hashes[-1] if call.hashes else None)
        transcript_hash = extended[-1] if extended else None
        if transcript_hash:
            call.state.index.add(transcript_hash, link)
            rows.append(LinkRow(transcript_hash, "t", call.step_id, link.session_id))
        if call.provider is None:  # a later turn may continue from these exact ids (proxy.tito)
            call.state.tokens.put(call.step_id, cap.prompt_token_ids, cap.output_token_ids)
    if call.state.links is not None:  # published while shared, else kept a while (proxy.store.links)
        call.published = call.state.links.offer(rows)
    usage = cap.usage or {}
    prompt_tokens = usage.get("prompt_tokens") or len(cap.prompt_token_ids)
    completion_tokens = usage.get("completion_tokens") or len(cap.output_token_ids)
    parent = call.continuation.parent
    # A provider's price from LiteLLM's cost map; engine calls are not priced here.
    cost = providers.usage_cost(call.version, usage) if call.provider is not None and call.version else None
    step = CapturedStep(
        step_id=call.step_id, session=call.session, api=call.api, started_at=call.started_at,
        parent_step_id=parent.step_id if parent and parent.step_id else None,
        history_len=call.continuation.history_len, system=shared(call.system), tools=shared(call.tools),
        new_messages=call.new_messages, tool_results=call.tool_results, params=call.params,
        action=cap.action(native_output, tool_names), prompt_token_ids=cap.prompt_token_ids,
        output_token_ids=cap.output_token_ids, output_logprobs=cap.output_logprobs,
        finish_reason=cap.finish_reason, status=status, error=error,
        upstream=upstream or call.upstream_url, model=cap.model or call.model, model_version=call.version,
        ttft_ms=call.ttft_s * 1000 if call.ttft_s is not None else None, total_ms=total_s * 1000,
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, transcript_hash=transcript_hash,
        client_info=call.client_info, replay_of=call.replay_of,
        history_extras=history_extras(call.native_messages[: call.continuation.history_len]),
        provider=call.provider.provider if call.provider is not None else None, cost=cost,
        version_window=call.version_window,
        output_versions=_engine_versions(cap.output_versions, call.version), prompt_path=call.prompt_path,
        harness_version=call.layers.harness.id if call.layers.harness else None,
        memory_version=call.layers.memory.id if call.layers.memory else None, memory_facts=call.layers.facts,
    )
    call.state.recorder.submit(step)
    telemetry.record_call(call.api, status, total_s, call.ttft_s, prompt_tokens, completion_tokens)
    call.state.tracer.record_call(
        api=call.api, model=step.model, session_id=call.session.external_id, step_id=call.step_id, status=status,
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, start_ns=call.start_ns,
        end_ns=time.time_ns(), finish_reason=cap.finish_reason, upstream=step.upstream,
        error=error_summary(error),
    )


def _engine_versions(versions: list[str] | None, served: str | None) -> list[str] | None:
    """The engine's per-token versions; vLLM labels weights it was never told the name of "default":
    those are the version the replica started with, as the proxy names it."""
    if versions is None or served is None:
        return versions
    return [served if v == "default" else v for v in versions]


async def settle(call: Call) -> None:
    """Wait (bounded) until the call's continuation keys are in the database, so the client's next
    call finds them whichever proxy it reaches. Doors await it before the answer's last bytes."""
    if call.published is not None and call.state.links is not None:
        await call.state.links.settle(call.published)
        call.published = None


def error_summary(error: dict[str, Any] | None) -> str | None:
    """What a span may say about a failed call: its type and status, never the message (vLLM's 400s
    echo the request; the message is stored redacted, by the writer)."""
    if not error:
        return None
    status = error.get("status_code")
    return f"{error.get('type') or 'error'}" + (f" (HTTP {status})" if status else "")


# --- reading the upstream answer (every door; streams are relayed by proxy.streams) ---

# What the proxy adds to every upstream request, for capture (the translators never ask for them).
CAPTURE_FIELDS = {"return_token_ids": True, "logprobs": True}


def translation_error(e: TranslationError) -> ApiError:
    return ApiError(e.status, e.message)


async def open_translated(call: Call, upstream_body: dict[str, Any]) -> Answer:
    """Send a translated request; an upstream failure is recorded and raised as an ApiError, which
    the app renders in the door's own error shape (Anthropic or OpenAI), not vLLM's."""
    try:
        resp = await open_upstream(call, {**upstream_body, **CAPTURE_FIELDS})
    except ApiError as e:
        finish(call, status="error", error={"type": "upstream_unavailable", "message": e.message,
                                                  "status_code": e.status})
        e.headers = {**e.headers, **call.response_headers()}
        raise
    if resp.status_code >= 400:
        upstream_url = call.upstream_url
        try:
            data = await resp.aread()
        except UpstreamError as e:  # the error body broke mid-read: a 502 of our own
            finish(call, status="error", error={"type": "upstream_error", "message": e.message}, upstream=upstream_url)
            e.headers = {**e.headers, **call.response_headers()}
            raise
        finally:
            await close_upstream(call, resp)  # the replica's slot, whatever the read did
        error = upstream_error(resp.status_code, data)
        finish(call, status="error", error=error, upstream=upstream_url)
        raise ApiError(resp.status_code, error["message"], headers=call.response_headers())
    return resp


async def read_completion(call: Call, resp: Answer) -> dict[str, Any]:
    """Read a non-streamed chat completion and feed it to the capture (upstream released)."""
    try:
        data = await resp.aread()
    except UpstreamError as e:
        await close_upstream(call, resp)
        finish(call, status="error", error={"type": "upstream_error", "message": e.message})
        e.headers = {**e.headers, **call.response_headers()}
        raise
    await close_upstream(call, resp)
    try:
        parsed = orjson.loads(data)
    except orjson.JSONDecodeError:
        finish(call, status="error", error={"type": "upstream_error", "message": "upstream sent invalid JSON"})
        raise ApiError(502, "upstream sent invalid JSON", headers=call.response_headers()) from None
    call.mark_token()
    call.capture.feed_response(parsed)
    return parsed
