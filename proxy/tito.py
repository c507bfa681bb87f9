"""Token-in-token-out: a continuation's prompt is the parent's exact prompt+output ids, then the new turn.

Re-rendering a conversation from the client's messages can give the model different tokens than it
produced (a tool call re-serialised by the template, whitespace, a different JSON key order). When a
call continues a step this proxy served, and its ids are still in memory (`TokenMemory`), the call
goes through vLLM's scale-out routes (`vllm serve --enable-scale-out`) instead of
`/v1/chat/completions`:

1. `/v1/chat/completions/render` renders the whole conversation, and the history alone (up to and
   including the parent's answer, no generation prompt). The history's rendering must be a prefix
   of the whole one (the template only appends); the tokens after it are the new turn.
2. The prompt is parent prompt + parent output + the template's glue after the parent's last token
   (ChatML's newline after `<|im_end|>`) + the new turn; `/inference/v1/generate` samples from it.
3. `/v1/chat/completions/derender` turns the output back into a chat completion with the engine's
   own tool-call and reasoning parsers; the proxy adds the ids it sent and the engine's weight
   version spans, and the doors read it as they read any chat completion.

Anything that does not fit (no parent ids, a template that rewrites history, the engine without the
routes, an error answer) raises `TitoUnavailable`: the caller renders as before and records
`prompt_path = "rendered"`.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from typing import Any

import aiohttp
import orjson

# How far back from the end of the rendered history the parent's last output token may sit: the
# template's glue after an end-of-turn token is a newline or two, never a message.
_GLUE_WINDOW = 4


class TitoUnavailable(Exception):
    """This call cannot take the token-in-token-out path; render instead (the reason is logged)."""


class NoScaleOut(TitoUnavailable):
    """The engine does not serve the routes (started without `--enable-scale-out`: 403, or 404)."""


class TokenMemory:
    """Recent steps' prompt+output ids by step id, bounded by total tokens (oldest dropped first)."""

    def __init__(self, max_tokens: int = 4_000_000) -> None:
        self._items: OrderedDict[str, array] = OrderedDict()
        self._total = 0
        self.max_tokens = max_tokens
        self._without: dict[str, float] = {}  # engine URL -> until when not to ask it (NoScaleOut)

    def engine_lacks_routes(self, url: str, for_s: float = 300.0) -> None:
        self._without[url] = time.monotonic() + for_s

    def may_ask(self, url: str) -> bool:
        return self._without.get(url, 0.0) <= time.monotonic()

    def put(self, step_id: str, prompt_ids: list[int], output_ids: list[int]) -> None:
        if not prompt_ids or not output_ids or step_id in self._items:
            return
        a = array("i", prompt_ids)
        a.extend(output_ids)
        self._items[step_id] = a
        self._total += len(a)
        while self._total > self.max_tokens and self._items:
            _, old = self._items.popitem(last=False)
            self._total -= len(old)

    def get(self, step_id: str | None) -> list[int] | None:
        a = self._items.get(step_id) if step_id else None
        return a.tolist() if a is not None else None

    def forget(self, step_ids: set[str]) -> None:
        for sid in step_ids:
            old = self._items.pop(sid, None)
            if old is not None:
                self._total -= len(old)


def history_cut(messages: list[Any]) -> int | None:
    """How many leading chat messages the parent covers: up to its answer, the last assistant turn."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if isinstance(m, dict) and m.get("role") == "assistant":
            return i + 1
    return None


def glue(history_ids: list[int], last_token: int) -> list[int] | None:
    """The template's tokens after the parent's last output token at the end of the rendered history."""
    n = len(history_ids)
    for k in range(n - 1, max(n - 1 - _GLUE_WINDOW, -1), -1):
        if history_ids[k] == last_token:
            return history_ids[k + 1 :]
    return None


def continuation_ids(parent_ids: list[int], history_ids: list[int], full_ids: list[int]) -> list[int]:
    """parent prompt+output, the glue, then what the whole rendering adds after the history's."""
    if full_ids[: len(history_ids)] != history_ids:
        raise TitoUnavailable("the chat template rewrites the history (its rendering is not a prefix)")
    g = glue(history_ids, parent_ids[-1])
    if g is None:
        raise TitoUnavailable("the parent's last token does not end the rendered history (no end-of-turn)")
    return parent_ids + g + full_ids[len(history_ids) :]


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str],
                what: str) -> dict[str, Any]:
    async with http.post(url, data=orjson.dumps(body), headers=headers) as resp:
        data = await resp.read()
        if resp.status in (403, 404) and what.startswith("render"):
            raise NoScaleOut(f"{what} answered {resp.status}: is vLLM started with --enable-scale-out?")
        if resp.status != 200:
            # The engine's message may echo the request: only the status goes into the reason.
            raise TitoUnavailable(f"{what} answered {resp.status}")
    try:
        parsed = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise TitoUnavailable(f"{what} sent invalid JSON") from None
    if not isinstance(parsed, dict):
        raise TitoUnavailable(f"{what} sent no object")
    return parsed


async def complete(http: aiohttp.ClientSession, base_url: str, headers: dict[str, str], body: dict[str, Any],
                   parent_ids: list[int]) -> dict[str, Any]:
    """One chat completion through render -> generate -> derender, shaped as vLLM's chat route answers
    (with `prompt_token_ids`, choice `token_ids` and `logprobs`, plus choice `weight_versions`)."""
    messages = body.get("messages")
    cut = history_cut(messages) if isinstance(messages, list) else None
    if cut is None or cut == len(messages or ()):
        raise TitoUnavailable("no new turn after the parent's answer")
    chat = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    full = await _post(http, base_url + "/v1/chat/completions/render", chat, headers, "render")
    history = {k: v for k, v in chat.items() if k not in ("tool_choice", "response_format")}
    history.update(messages=messages[:cut], add_generation_prompt=False, continue_final_message=False)
    hist = await _post(http, base_url + "/v1/chat/completions/render", history, headers, "render (history)")
    full_ids, hist_ids = full.get("token_ids"), hist.get("token_ids")
    if not isinstance(full_ids, list) or not isinstance(hist_ids, list):
        raise TitoUnavailable("render sent no token ids")
    ids = continuation_ids(parent_ids, hist_ids, full_ids)
    gen_req = {**full, "token_ids": ids, "stream": False, "stream_options": None, "token_offsets": None}
    params = dict(gen_req.get("sampling_params") or {})
    # Without a client budget the engine sized the default for the rendered prompt: keep prompt + output
    # within it. A budget the client set is the client's: kept as asked.
    asked = body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None
    if not asked and isinstance(params.get("max_tokens"), int) and len(ids) > len(full_ids):
        params["max_tokens"] = max(1, params["max_tokens"] - (len(ids) - len(full_ids)))
    gen_req["sampling_params"] = params
    gen = await _post(http, base_url + "/inference/v1/generate", gen_req, headers, "generate")
    der = await _post(http, base_url + "/v1/chat/completions/derender",
                      {"generate_response": gen, "prompt_token_ids": ids, "prompt_tokens": len(ids),
                       "chat_request": chat, "model": body.get("model")}, headers, "derender")
    return _with_tokens(der, gen, ids)


def _with_tokens(der: dict[str, Any], gen: dict[str, Any], ids: list[int]) -> dict[str, Any]:
    """The derendered completion with what capture reads: the ids sent and produced, logprobs, spans."""
    choices = der.get("choices") or []
    gchoices = gen.get("choices") or []
    if not choices or not gchoices:
        raise TitoUnavailable("derender sent no choice")
    choice, gchoice = choices[0], gchoices[0]
    out_ids = list(gchoice.get("token_ids") or [])
    der["prompt_token_ids"] = ids
    choice["token_ids"] = out_ids
    lp = choice.get("logprobs")
    if not (isinstance(lp, dict) and len(lp.get("content") or ()) == len(out_ids)):
        glp = (gchoice.get("logprobs") or {}).get("content") or []
        # Derender decodes token strings only when asked for logprobs; the values are the engine's.
        choice["logprobs"] = {"content": [{"token": "", "logprob": float(x.get("logprob", 0.0))} for x in glp]}
    if gchoice.get("weight_versions") is not None:
        choice["weight_versions"] = gchoice["weight_versions"]
    der.setdefault("created", int(time.time()))
    return der


def as_stream(completion: dict[str, Any], *, include_usage: bool = True) -> bytes:
    """A whole chat completion as the SSE chunks vLLM's chat route would stream (generated at once)."""
    choice = (completion.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    base = {"id": completion.get("id"), "object": "chat.completion.chunk", "created": completion.get("created"),
            "model": completion.get("model")}
    delta: dict[str, Any] = {"role": "assistant", "content": msg.get("content") or ""}
    reasoning = msg.get("reasoning") or msg.get("reasoning_content")
    if reasoning:
        delta["reasoning"] = reasoning
    if msg.get("tool_calls"):
        delta["tool_calls"] = [{**tc, "index": i} for i, tc in enumerate(msg["tool_calls"])]
    first = {**base, "prompt_token_ids": completion.get("prompt_token_ids"),
             "choices": [{"index": 0, "delta": delta, "logprobs": choice.get("logprobs"),
                          "token_ids": choice.get("token_ids") or [], "finish_reason": None}]}
    last_choice = {"index": 0, "delta": {}, "finish_reason": choice.get("finish_reason"),
                   "stop_reason": choice.get("stop_reason")}
    if choice.get("weight_versions") is not None:
        last_choice["weight_versions"] = choice["weight_versions"]
    chunks = [first, {**base, "choices": [last_choice]}]
    if include_usage and completion.get("usage"):
        chunks.append({**base, "choices": [], "usage": completion["usage"]})
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


class TitoResponse:
    """A token-in-token-out answer behind `UpstreamResponse`'s interface (read whole, or as SSE)."""

    def __init__(self, completion: dict[str, Any], *, stream: bool, include_usage: bool = True) -> None:
        self.status_code = 200
        self.headers = {"content-type": "text/event-stream" if stream else "application/json"}
        self._body = as_stream(completion, include_usage=include_usage) if stream else orjson.dumps(completion)

    async def aread(self) -> bytes:
        return self._body

    async def aiter_raw(self):
        yield self._body

    async def aclose(self) -> None:
        return None
