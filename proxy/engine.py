"""The engine client: every HTTP call the proxy service makes to a vLLM replica, on one library (aiohttp).

Model traffic (chat completions, and token-in-token-out's render / generate / derender) goes over
aiohttp: on the 2-core development machine it costs ~0.1 ms per call against ~0.6 ms for httpx, and
the proxy's added latency budget is 1 ms. Control calls (model listings, token counts, the evaluation
and shadow gates' answers, the weight routes of a swap, the version tag) go over the same library
with a connection pool of their own: a swap's `/resume` must never wait for a free connection behind
the streams it paused.

What callers see: `UpstreamResponse` (a model answer, its body not yet read) and `Reply` (a control
call's status and whole body), and one exception, `EngineUnreachable` (an `UpstreamError`, 502), for
a call that reached no engine or whose answer broke while it was read. An engine that answers, with
whatever status, returns normally; what a status means is the caller's to say. Every credential stays
out of what is raised: URLs are cut to scheme://host:port (`public_url`, `redact_url_text`).

Timeouts: connecting takes at most 5 s, each read at most `ATDP_UPSTREAM_TIMEOUT_S` (there is no
total: a long generation streams as long as its tokens keep coming); a control call that names a
`timeout` applies it to its connect and to each read instead.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from proxy.errors import ApiError

_URL_IN_TEXT = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://)([^\s/?#@]+@)?([^\s/?#]*)([^\s?#]*)(\?[^\s#]*)?(#\S*)?")

# What a call that reached no engine, or whose answer broke, raises inside the library.
_TRANSPORT = (aiohttp.ClientError, TimeoutError, OSError)


def public_url(url: str) -> str:
    """A replica's URL as it may be shown (health, metrics, errors, logs): scheme://host:port only.
    Userinfo, path, query and fragment can carry credentials (`http://user:pw@h/?token=...`)."""
    try:
        u = urlsplit(url)
        host = u.hostname or ""
        port = u.port
    except ValueError:
        return "<invalid url>"
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return f"{u.scheme}://{host}" + (f":{port}" if port else "")


def redact_url_text(text: str) -> str:
    """Free text (an exception message) with every URL in it cut to scheme://host:port."""
    return _URL_IN_TEXT.sub(lambda m: m.group(1) + m.group(3), text)


class UpstreamError(ApiError):
    """The upstream failed: no replica took the call (502/503), or a response broke while it was read
    (502). Rendered like any ApiError, in the called API's error format."""


class EngineUnreachable(UpstreamError):
    """No engine took the call (refused, reset, timed out), or its answer broke while it was read.

    `kind` is the library's exception class name and `detail` its message with URLs cut to
    scheme://host:port: what logs and step errors may say. `message` is `prefix` + `kind: detail`."""

    def __init__(self, cause: BaseException, prefix: str = "") -> None:
        self.kind = type(cause).__name__
        self.detail = redact_url_text(str(cause))
        super().__init__(502, f"{prefix}{self.kind}: {self.detail}")


@dataclass(frozen=True)
class Reply:
    """A control call's answer, read whole. `seconds`: from sending to the last byte read."""

    status: int
    body: bytes
    seconds: float = 0.0

    def json(self) -> Any:
        """The body as JSON (ValueError when it is not)."""
        return orjson.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")


class UpstreamResponse:
    """A model-traffic response whose body is not read yet; read failures raise EngineUnreachable
    (an UpstreamError, 502)."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._r = resp
        self.status_code = resp.status
        self.headers = resp.headers
        self._done = False

    async def aread(self) -> bytes:
        try:
            data = await self._r.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise EngineUnreachable(e, "upstream read failed: ") from e
        self._done = True
        return data

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._r.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, TimeoutError) as e:
            raise EngineUnreachable(e, "upstream stream broke: ") from e
        self._done = True

    async def aclose(self, *, finished: bool | None = None) -> None:
        """A finished body returns the connection to the pool; an unfinished one is closed, which
        makes vLLM abort the generation (the client is gone, so are its tokens). `finished`: the
        caller's own word on it (a reader that stopped at the stream's end marker)."""
        if self._done if finished is None else finished:
            self._r.release()
        else:
            self._r.close()


def make_session(timeout_s: float, max_connections: int = 512, *, decompress: bool = False) -> aiohttp.ClientSession:
    """A pool to the engines as the proxy keeps it (bench/floor_proxy.py measures the floor with it)."""
    return aiohttp.ClientSession(
        # Idle connections go before the engine would close them (uvicorn's keep-alive: 5 s), so the
        # pool rarely hands out one the engine is closing; `open` resends when it still does.
        connector=aiohttp.TCPConnector(limit=max_connections, ttl_dns_cache=300, keepalive_timeout=3),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=timeout_s),
        auto_decompress=decompress,
        trust_env=False,  # never an environment's proxy
        skip_auto_headers=("User-Agent",),
    )


def _timeout(seconds: float | None) -> dict[str, aiohttp.ClientTimeout]:
    """A call's own timeout, as aiohttp's keyword (none: the session's; aiohttp reads `None` as no limit)."""
    return {} if seconds is None else {"timeout": aiohttp.ClientTimeout(total=None, sock_connect=seconds,
                                                                        sock_read=seconds)}


class EngineClient:
    """The proxy's client of its engines (one per process, `AppState.engine_client`, made on start-up
    inside the event loop). Every request carries the upstream auth header (`ReplicaPool.auth_headers`:
    vLLM started with --api-key wants it on every route). `base`: a replica's URL (`Replica.url`)."""

    def __init__(self, timeout_s: float, auth_headers: Mapping[str, str] | None = None, *,
                 max_connections: int = 512) -> None:
        self.timeout_s = timeout_s
        self.headers: dict[str, str] = dict(auth_headers or {})
        self._json_headers = {"content-type": "application/json", **self.headers}
        # The hot path forwards bytes exactly: no decompression.
        self._model = make_session(timeout_s, max_connections)
        self._control = make_session(timeout_s, max_connections, decompress=True)

    async def close(self) -> None:
        await self._model.close()
        await self._control.close()

    # --- model traffic ---------------------------------------------------------------------------

    async def open(self, base: str, path: str, content: bytes) -> UpstreamResponse:
        """POST a model call's JSON body; the answer with its headers read, its body not.

        Sent again on a new connection when a pooled one turned out closed before the request went
        out: the engine closes idle keep-alive connections on its own clock (uvicorn: 5 s), and a
        connection the pool hands out just as the engine closes it fails while the body is written,
        or with no answer at all. Sending again is safe: no client has seen anything, and an engine
        that did read the request aborts it when its connection drops. A refused connect is not
        retried (the replica is down: the caller fails over)."""
        try:
            for tries_left in (2, 1, 0):
                try:
                    return UpstreamResponse(await self._model.post(base + path, data=content,
                                                                   headers=self._json_headers))
                except aiohttp.ClientConnectorError:
                    raise
                except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                    if not tries_left:
                        raise
        except _TRANSPORT as e:
            raise EngineUnreachable(e) from None
        raise AssertionError("unreachable")

    async def post_json(self, base: str, path: str, body: Any) -> Reply:
        """POST JSON on the model traffic's pool and read the whole answer (token-in-token-out's
        render, generate and derender)."""
        t0 = time.perf_counter()
        try:
            async with self._model.post(base + path, data=orjson.dumps(body), headers=self._json_headers) as resp:
                return Reply(resp.status, await resp.read(), time.perf_counter() - t0)
        except _TRANSPORT as e:
            raise EngineUnreachable(e) from None

    async def open_stream(self, base: str, path: str, body: Any) -> UpstreamResponse:
        """POST JSON on the model traffic's pool; the answer with its body not read (a stream)."""
        try:
            return UpstreamResponse(await self._model.post(base + path, data=orjson.dumps(body),
                                                           headers=self._json_headers))
        except _TRANSPORT as e:
            raise EngineUnreachable(e) from None

    # --- control calls ---------------------------------------------------------------------------

    async def request(self, method: str, base: str, path: str, *, json: Any = None, content: bytes | None = None,
                      params: Mapping[str, str] | None = None, timeout: float | None = None) -> Reply:
        """One control call, its answer read whole. Redirects are not followed."""
        data = orjson.dumps(json) if json is not None else content
        headers = self._json_headers if data is not None else self.headers
        t0 = time.perf_counter()
        try:
            async with self._control.request(method, base + path, data=data, params=params, headers=headers,
                                             allow_redirects=False, **_timeout(timeout)) as resp:
                return Reply(resp.status, await resp.read(), time.perf_counter() - t0)
        except _TRANSPORT as e:
            raise EngineUnreachable(e) from None

    async def models(self, base: str, *, timeout: float | None = None) -> Reply:
        """`GET /v1/models`: what the engine serves (`data[0].id` is the served model's name, `root`
        the checkpoint it was started with)."""
        return await self.request("GET", base, "/v1/models", timeout=timeout)

    async def tokenize(self, base: str, content: bytes) -> Reply:
        """`POST /tokenize` of a chat request (JSON bytes): `count` is its rendered prompt's length."""
        return await self.request("POST", base, "/tokenize", content=content)

    async def chat(self, base: str, body: dict[str, Any], *, timeout: float | None = None) -> Reply:
        """A non-streamed chat completion off the request path (the gates' and the shadow's answers)."""
        return await self.request("POST", base, "/v1/chat/completions", json=body, timeout=timeout)

    async def weight_version(self, base: str, *, timeout: float = 5.0) -> str | None:
        """The version the engine's weights are tagged with (`GET /weight_info`; vLLM's untagged
        weights say `default`). ValueError or AttributeError when the answer is no JSON object."""
        reply = await self.request("GET", base, "/weight_info", timeout=timeout)
        return reply.json().get("weight_version")

    async def tag_version(self, base: str, name: str, *, timeout: float | None = None) -> Reply:
        """`POST /update_weight_version`: the engine stamps the tokens it samples from now on `name`."""
        return await self.request("POST", base, "/update_weight_version", json={"new_version": name},
                                  timeout=timeout)

    async def control(self, base: str, route: str, *, json: Any = None, params: Mapping[str, str] | None = None,
                      timeout: float | None = None) -> Reply:
        """`POST` to one of the engine's dev-mode routes (`/sleep`, `/resume`, `/reset_prefix_cache`,
        `/collective_rpc`, the weight transfer's routes, `/atdp/update_weights`:
        proxy.rollout.engine_weights says what each does)."""
        return await self.request("POST", base, route, json=json, params=params, timeout=timeout)
