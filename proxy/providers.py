"""Provider upstreams: calls the routing table sends to a hosted model, through LiteLLM's SDK.

Capture-only: a provider returns no engine token ids, so its steps are stored with token source
`none` (supervised / distillation data, never PPO). LiteLLM is imported in the background when a
proxy whose table has a provider route starts (or by the first provider call, off the event loop);
a proxy without one never imports it, and the vLLM path never calls it.

A provider's answer is handed to the doors behind the interface a replica's answer has
(`status_code`, `aread`, `aiter_raw` as chat-completion SSE, `aclose`): every door reads,
translates and captures it with the code it uses for vLLM. Errors come back as an OpenAI-shaped
error body with a status the caller's door renders in its own format.

Credentials: `api_key_env` names the environment variable; its value is read once at start-up and
lives only in `ProviderRoute.api_key` (not in its repr), and is cut out of any error text.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import importlib.util
import os
import re
import threading
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import orjson

from proxy.config import UpstreamRoute
from proxy.engine import UpstreamError, public_url, redact_url_text
from proxy.errors import ApiError
from proxy.lru import LRU

# Keys of an OpenAI chat completion (and chunk) that clients and the capture read; LiteLLM adds
# its own (`provider_specific_fields`, `thinking_blocks`, `citations` ...), which are dropped.
_TOP = ("id", "object", "created", "model", "system_fingerprint", "choices", "usage")
_CHOICE = ("index", "message", "delta", "finish_reason")
_MESSAGE = ("role", "content", "tool_calls", "reasoning_content", "refusal")
_USAGE = ("prompt_tokens", "completion_tokens", "total_tokens")


class ProviderConfigError(ValueError):
    """The routing table cannot be served (a credential variable is not set)."""


@dataclass(frozen=True)
class ProviderRoute:
    pattern: str
    provider: str  # LiteLLM model; "{model}" is replaced by the requested name
    api_base: str | None
    timeout_s: float
    api_key: str | None = field(default=None, repr=False)

    def target(self, model: str) -> str:
        return self.provider.replace("{model}", model)

    @property
    def label(self) -> str:
        """What a step, a span or a log may say about where the call went (never the api_base's
        path or credentials)."""
        return "litellm:" + self.provider.split("/", 1)[0] + (f"@{public_url(self.api_base)}" if self.api_base else "")


@dataclass(frozen=True)
class RouteTable:
    """Compiled routing table: the first row whose pattern matches the model wins; None = vLLM."""

    rows: tuple[tuple[re.Pattern[str], ProviderRoute | None], ...] = ()
    _cache: LRU[str, ProviderRoute | None] = field(default_factory=lambda: LRU(1024), compare=False, repr=False)

    @property
    def has_providers(self) -> bool:
        return any(route is not None for _, route in self.rows)

    def match(self, model: object) -> ProviderRoute | None:
        if not self.rows or not isinstance(model, str):  # no table: the vLLM path does nothing more
            return None
        hit = self._cache.get(model, False)
        if hit is not False:
            return hit
        found = next((route for rx, route in self.rows if rx.match(model)), None)
        self._cache.put(model, found)
        return found


def build(routes: list[UpstreamRoute], environ: Mapping[str, str], default_timeout_s: float) -> RouteTable:
    """The table from the settings; a named credential variable that is unset is an error at start-up."""
    rows = []
    for r in routes:
        rx = re.compile(fnmatch.translate(r.model))
        if not r.is_provider:
            rows.append((rx, None))
            continue
        key = None
        if r.api_key_env:
            key = environ.get(r.api_key_env)
            if not key:
                raise ProviderConfigError(f"route {r.model!r}: environment variable {r.api_key_env} is not set")
        rows.append((rx, ProviderRoute(pattern=r.model, provider=r.provider, api_base=r.api_base,
                                       timeout_s=r.timeout_s or default_timeout_s, api_key=key)))
    table = RouteTable(tuple(rows))
    if not table.has_providers:
        return RouteTable()  # only vLLM rows: the same as no table, and no lookup per call
    if importlib.util.find_spec("litellm") is None:
        raise ProviderConfigError("provider routes need LiteLLM: pip install 'atdp[providers]'")
    return table


# --- LiteLLM, imported on first use ----------------------------------------------------------------


_LOADED: list[ModuleType] = []  # LiteLLM once configured (a half-imported module is never handed out)
_LOAD_LOCK = threading.Lock()


def _litellm() -> ModuleType:
    if _LOADED:
        return _LOADED[0]
    with _LOAD_LOCK:
        if not _LOADED:
            # Offline: the bundled cost map, never the one LiteLLM would fetch at import.
            os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
            import litellm

            litellm.telemetry = False
            litellm.suppress_debug_info = True  # its "Give Feedback / Get Help" banner on errors
            litellm.drop_params = True  # a parameter a provider lacks is dropped, not a 400
            _LOADED.append(litellm)
    return _LOADED[0]


def warm_up() -> None:
    """Import LiteLLM now (seconds on a small machine), so the first provider call does not wait."""
    _litellm()


def usage_cost(model: str, usage: Mapping[str, Any] | None) -> float | None:
    """The call's cost from LiteLLM's cost map (USD); None for a model the map does not price."""
    if not usage:
        return None
    litellm = _litellm()
    try:
        prompt, completion = litellm.cost_per_token(model=model, prompt_tokens=int(usage.get("prompt_tokens") or 0),
                                                    completion_tokens=int(usage.get("completion_tokens") or 0))
    except Exception:  # LiteLLM raises for a model it does not know
        return None
    return float(prompt) + float(completion)


# --- the answer, shaped like a replica's -----------------------------------------------------------

# Body keys the proxy adds for vLLM's capture; a provider has no token ids to return.
_ENGINE_ONLY = ("return_token_ids", "logprobs", "top_logprobs", "stream_options", "model")


class ProviderResponse:
    """A provider's answer behind `UpstreamResponse`'s interface (see the module docstring)."""

    def __init__(self, status_code: int, *, body: bytes = b"", stream: Any = None, first: Any = None,
                 secret: str | None = None, timeout_s: float = 600.0) -> None:
        self.status_code = status_code
        self.headers = {"content-type": "text/event-stream" if stream is not None else "application/json"}
        self._body, self._stream, self._first = body, stream, first
        self._secret, self._timeout_s = secret, timeout_s

    async def aread(self) -> bytes:
        if self._stream is None:
            return self._body
        return b"".join([part async for part in self.aiter_raw()])

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        if self._stream is None:
            yield self._body
            return
        if self._first is not None:
            first, self._first = self._first, None
            yield _sse(first)
        it = self._stream.__aiter__()
        while True:
            try:
                chunk = await asyncio.wait_for(it.__anext__(), self._timeout_s)
            except StopAsyncIteration:
                break
            except Exception as e:  # the provider's stream broke (or went silent) mid-answer
                status, message = provider_error(e, self._secret)
                raise UpstreamError(504 if status == 504 else 502, f"provider stream broke: {message}") from None
            yield _sse(chunk)
        yield b"data: [DONE]\n\n"

    async def aclose(self) -> None:
        stream, self._stream = self._stream, None
        close = getattr(stream, "aclose", None)
        if close is not None:
            with contextlib.suppress(Exception):  # closing a stream the provider already ended
                await close()


def _sse(chunk: Any) -> bytes:
    return b"data: " + orjson.dumps(clean(_as_dict(chunk))) + b"\n\n"


def _as_dict(obj: Any) -> dict[str, Any]:
    return obj if isinstance(obj, dict) else obj.model_dump()


def clean(data: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI chat completion / chunk with only OpenAI's keys (see `_TOP`)."""
    out = {k: data[k] for k in _TOP if data.get(k) is not None}
    choices = []
    for c in data.get("choices") or ():
        choice = {k: c.get(k) for k in _CHOICE if k in c and (c.get(k) is not None or k == "finish_reason")}
        for key in ("message", "delta"):
            if isinstance(choice.get(key), dict):
                msg = choice[key]
                shaped = {k: msg[k] for k in _MESSAGE if msg.get(k) is not None}
                if key == "message":
                    shaped.setdefault("content", None)
                if msg.get("tool_calls"):
                    shaped["tool_calls"] = [_tool_call(tc) for tc in msg["tool_calls"]]
                choice[key] = shaped
        choices.append(choice)
    if "choices" in data:
        out["choices"] = choices
    if isinstance(data.get("usage"), dict):
        out["usage"] = {k: data["usage"][k] for k in _USAGE if data["usage"].get(k) is not None}
    return out


def _tool_call(tc: dict[str, Any]) -> dict[str, Any]:
    fn = tc.get("function") or {}
    out: dict[str, Any] = {k: tc[k] for k in ("index", "id", "type") if tc.get(k) is not None}
    out["function"] = {k: fn[k] for k in ("name", "arguments") if fn.get(k) is not None}
    return out


# LiteLLM's wording around a provider's message: "litellm.BadRequestError: ", "Handle with `...`".
_LITELLM_NOISE = re.compile(r"litellm\.\w+: |\w+Error: (?=\w+Exception)|\. Handle with `litellm\.\w+`\.?")


def provider_error(e: BaseException, secret: str | None) -> tuple[int, str]:
    """(status for the caller, message) of a LiteLLM exception; the route's key cut out of the text.

    A provider's 4xx about the request (400, 404, 413, 422, 429) is the caller's: it keeps its
    status. Its 401/403 are about the proxy's credentials, not the caller's key: 502. Its 5xx and a
    failed connection: 502. A timeout: 504."""
    message = _LITELLM_NOISE.sub("", redact_url_text(str(getattr(e, "message", None) or e) or type(e).__name__)).strip()
    if secret:
        message = message.replace(secret, "[credential]")
    message = message[:1000]
    name = type(e).__name__
    status = getattr(e, "status_code", None)
    if isinstance(e, TimeoutError) or name in ("Timeout", "APITimeoutError") or status == 408:
        return 504, f"the provider did not answer in time ({name})"
    if isinstance(status, int) and 400 <= status < 500 and status not in (401, 403, 407):
        return status, message
    if status in (401, 403, 407):
        return 502, f"the provider refused the proxy's credentials: {message}"
    return 502, message


def error_body(status: int, message: str) -> bytes:
    kind = "timeout" if status == 504 else "provider_error" if status >= 500 else "invalid_request_error"
    return orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": str(status)}})


async def open_provider(route: ProviderRoute, body: dict[str, Any]) -> ProviderResponse:
    """Send a chat-completions body to the route's provider. A stream's first chunk is awaited here,
    so a provider that refuses the call answers with a status before any byte reaches the client."""
    # Off the event loop while it imports (the start-up warm-up may still be at it).
    litellm = _LOADED[0] if _LOADED else await asyncio.to_thread(_litellm)
    kwargs = {k: v for k, v in body.items() if k not in _ENGINE_ONLY}
    kwargs.update(model=route.target(str(body.get("model"))), timeout=route.timeout_s, num_retries=0)
    if route.api_key:
        kwargs["api_key"] = route.api_key
    if route.api_base:
        kwargs["api_base"] = route.api_base
    stream = bool(body.get("stream"))
    if stream:
        kwargs["stream_options"] = {"include_usage": True}
    try:
        resp = await asyncio.wait_for(litellm.acompletion(**kwargs), route.timeout_s)
        if not stream:
            return ProviderResponse(200, body=orjson.dumps(clean(_as_dict(resp))))
        it = resp.__aiter__()
        try:
            first = await asyncio.wait_for(it.__anext__(), route.timeout_s)
        except StopAsyncIteration:
            first = None
        return ProviderResponse(200, stream=resp, first=first, secret=route.api_key, timeout_s=route.timeout_s)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        status, message = provider_error(e, route.api_key)
        return ProviderResponse(status, body=error_body(status, message))


async def count_tokens(route: ProviderRoute, chat: dict[str, Any]) -> int:
    """`/v1/messages/count_tokens` for a provider model: the provider's own counting API where LiteLLM
    has one (Anthropic), else LiteLLM's local tokenizer for the model. Raises ApiError on failure."""
    litellm = _LOADED[0] if _LOADED else await asyncio.to_thread(_litellm)
    try:
        resp = await asyncio.wait_for(litellm.acount_tokens(
            model=route.target(str(chat.get("model"))), messages=chat.get("messages"), tools=chat.get("tools"),
            api_key=route.api_key, api_base=route.api_base), route.timeout_s)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        status, message = provider_error(e, route.api_key)
        raise ApiError(status, message) from None
    return int(resp.total_tokens)
