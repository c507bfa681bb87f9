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

A streamed call (`open_stream`) generates with `stream: true` (token ids per chunk) and derenders
each batch of chunks as it arrives (`stream: true` on derender: vLLM's incremental detokenizer, and
the parser replayed over the output so far, its state carried by the proxy as `stream_state`); the
doors read chat chunks, as from the chat route. Derender decodes every id it is given, so the proxy
leaves out the stop token that ended the answer (`for_derender`) and cuts stop strings from content
(`StopCut`), as the engine's own detokenizer does for the chat route.

Anything that does not fit (no parent ids, a template that rewrites history, the engine without the
routes, an error answer) raises `TitoUnavailable`: the caller renders as before and records
`prompt_path = "rendered"`.
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson

from proxy.engine import EngineClient, EngineUnreachable, UpstreamResponse
from proxy.translate.chunks import error_message
from proxy.translate.sse import encode_data, iter_sse

RENDER, GENERATE, DERENDER = "/v1/chat/completions/render", "/inference/v1/generate", "/v1/chat/completions/derender"

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

    def put(self, step_id: str, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        if not prompt_ids or not output_ids or step_id in self._items:
            return
        a = array("i", prompt_ids)
        a.extend(output_ids)
        self._items[step_id] = a
        self._total += len(a)
        while self._total > self.max_tokens and self._items:
            _, old = self._items.popitem(last=False)
            self._total -= len(old)

    def sizes(self) -> dict[str, int]:
        return {"tito_steps": len(self._items), "tito_tokens": self._total}

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


async def _post(engine: EngineClient, base_url: str, path: str, body: dict[str, Any], what: str) -> dict[str, Any]:
    """One of the scale-out routes, its answer as a JSON object (EngineUnreachable: no answer)."""
    reply = await engine.post_json(base_url, path, body)
    if reply.status in (403, 404) and what.startswith("render"):
        raise NoScaleOut(f"{what} answered {reply.status}: is vLLM started with --enable-scale-out?")
    if reply.status != 200:
        # The engine's message may echo the request: only the status goes into the reason.
        raise TitoUnavailable(f"{what} answered {reply.status}")
    try:
        parsed = reply.json()
    except orjson.JSONDecodeError:
        raise TitoUnavailable(f"{what} sent invalid JSON") from None
    if not isinstance(parsed, dict):
        raise TitoUnavailable(f"{what} sent no object")
    return parsed


async def _prepare(engine: EngineClient, base_url: str, body: dict[str, Any], parent_ids: list[int]
                   ) -> tuple[dict[str, Any], list[int], dict[str, Any]]:
    """Render twice and assemble the continuation: (the chat request, the prompt ids, generate's body)."""
    messages = body.get("messages")
    cut = history_cut(messages) if isinstance(messages, list) else None
    if cut is None or cut == len(messages or ()):
        raise TitoUnavailable("no new turn after the parent's answer")
    chat = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    history = {k: v for k, v in chat.items() if k not in ("tool_choice", "response_format")}
    history.update(messages=messages[:cut], add_generation_prompt=False, continue_final_message=False)
    # Both renderings at once: they do not depend on each other, and the client waits for both.
    full, hist = await asyncio.gather(
        _post(engine, base_url, RENDER, chat, "render"),
        _post(engine, base_url, RENDER, history, "render (history)"))
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
    return chat, ids, gen_req


async def complete(engine: EngineClient, base_url: str, body: dict[str, Any], parent_ids: list[int]) -> dict[str, Any]:
    """One chat completion through render -> generate -> derender, shaped as vLLM's chat route answers
    (with `prompt_token_ids`, choice `token_ids` and `logprobs`, plus choice `weight_versions`)."""
    chat, ids, gen_req = await _prepare(engine, base_url, body, parent_ids)
    gen = await _post(engine, base_url, GENERATE, gen_req, "generate")
    cut = StopCut.of(gen_req["sampling_params"])
    shown = for_derender(gen, cut.include) if (gen.get("choices") or [{}])[0].get("token_ids", [0])[:-1] else gen
    der = await _post(engine, base_url, DERENDER,
                      {"generate_response": shown, "prompt_token_ids": ids, "prompt_tokens": len(ids),
                       "chat_request": chat, "model": body.get("model")}, "derender")
    return _with_tokens(der, gen, ids, cut)


async def answer(engine: EngineClient, base_url: str, body: dict[str, Any], parent_ids: list[int]) -> TitoResponse:
    return TitoResponse(await complete(engine, base_url, body, parent_ids))


def _with_tokens(der: dict[str, Any], gen: dict[str, Any], ids: list[int], cut: StopCut) -> dict[str, Any]:
    """The derendered completion with what capture reads: the ids sent and produced, logprobs, spans."""
    choices = der.get("choices") or []
    gchoices = gen.get("choices") or []
    if not choices or not gchoices:
        raise TitoUnavailable("derender sent no choice")
    choice, gchoice = choices[0], gchoices[0]
    der["prompt_token_ids"] = ids
    _add_tokens(choice, gchoice)
    msg = choice.get("message") or {}
    if isinstance(msg.get("content"), str):
        msg["content"] = cut.finish(gchoice.get("stop_reason"), msg["content"])
    der.setdefault("created", int(time.time()))
    return der


def for_derender(gen: dict[str, Any], include_stop: bool) -> dict[str, Any]:
    """What derender should decode: the engine's detokenizer leaves out the stop token that ended a
    generation (EOS or a stop token id) unless `include_stop_str_in_output`; derender, which decodes
    every id it is given with special tokens kept for the parser, would put it in the text."""
    choices = gen.get("choices") or []
    choice = choices[0] if choices else {}
    if (choice.get("finish_reason") != "stop" or isinstance(choice.get("stop_reason"), str) or include_stop
            or not choice.get("token_ids")):
        return gen
    shown = {**choice, "token_ids": choice["token_ids"][:-1]}
    lp = choice.get("logprobs")
    if isinstance(lp, dict) and lp.get("content"):
        shown["logprobs"] = {**lp, "content": lp["content"][:-1]}
    return {**gen, "choices": [shown]}


def _add_tokens(choice: dict[str, Any], gchoice: dict[str, Any]) -> None:
    """Generate's ids, logprobs and version spans onto the derendered choice (what capture reads)."""
    out_ids = list(gchoice.get("token_ids") or [])
    choice["token_ids"] = out_ids
    lp = choice.get("logprobs")
    if not (isinstance(lp, dict) and len(lp.get("content") or ()) == len(out_ids)):
        glp = (gchoice.get("logprobs") or {}).get("content") or []
        # Derender decodes token strings only on its plain path (no parser); the values are the engine's.
        choice["logprobs"] = {"content": [{"token": "", "logprob": float(x.get("logprob", 0.0))} for x in glp]}
    if gchoice.get("weight_versions") is not None:
        choice["weight_versions"] = gchoice["weight_versions"]


class StopCut:
    """The engine's stop strings, applied to derendered content as the chat route applies them.

    Derender decodes every output token, so the stop string (and anything after it in the last token)
    comes back as text; the chat route cuts there, and holds back as many characters as a stop string
    could still complete in (`SamplingParams.output_text_buffer_length`). Content only: a stop string
    inside a tool call's arguments or reasoning is left as the parser returned it."""

    def __init__(self, stops: list[str], include: bool) -> None:
        self.stops, self.include = stops, include
        self.hold = max(map(len, stops)) - 1 if stops and not include else 0
        self.span = max(map(len, stops), default=0)
        self.pending = ""
        self.tail = ""  # the last characters sent: a stop string may begin in them

    @classmethod
    def of(cls, params: dict[str, Any]) -> StopCut:
        stop = params.get("stop")
        stops = [stop] if isinstance(stop, str) else [s for s in stop or () if isinstance(s, str)]
        return cls([s for s in stops if s], bool(params.get("include_stop_str_in_output")))

    def feed(self, text: str) -> str:
        """What of `text` may be sent now."""
        if not self.stops:
            return text
        self.pending += text
        n = len(self.pending) - self.hold
        if n <= 0:
            return ""
        out, self.pending = self.pending[:n], self.pending[n:]
        self.tail = (self.tail + out)[-self.span :]
        return out

    def finish(self, stop_reason: Any, last: str = "") -> str:
        """What is still held and the last text, cut at the stop string that ended the generation
        (when one did: it completes in the last tokens)."""
        text, self.pending = self.pending + last, ""
        if isinstance(stop_reason, str) and stop_reason in self.stops:
            joined = self.tail + text
            i = joined.find(stop_reason)
            if i >= 0:
                end = i + (len(stop_reason) if self.include else 0)
                return text[: max(0, end - len(self.tail))]
        return text


class TitoResponse:
    """A whole token-in-token-out answer behind `UpstreamResponse`'s interface."""

    status_code = 200

    def __init__(self, completion: dict[str, Any]) -> None:
        self.headers = {"content-type": "application/json"}
        self._body = orjson.dumps(completion)

    async def aread(self) -> bytes:
        return self._body

    async def aiter_raw(self):
        yield self._body

    async def aclose(self) -> None:
        return None


async def open_stream(engine: EngineClient, base_url: str, body: dict[str, Any], parent_ids: list[int]) -> TitoStream:
    """A streamed continuation: generate streams token ids, derender turns each batch of them into a
    chat chunk with the engine's parsers. Returns once the first chunk is ready, so anything that fails
    before then still renders instead (TitoUnavailable)."""
    chat, ids, gen_req = await _prepare(engine, base_url, body, parent_ids)
    gen_req.update(stream=True, stream_options={"include_usage": True})
    resp = await engine.open_stream(base_url, GENERATE, gen_req)
    if resp.status_code != 200 or not resp.headers.get("content-type", "").startswith("text/event-stream"):
        await resp.aclose(finished=False)
        raise TitoUnavailable(f"generate (streamed) answered {resp.status_code}")
    stream = TitoStream(engine, base_url, resp, chat, ids,
                        model=body.get("model"), cut=StopCut.of(gen_req["sampling_params"]))
    try:
        await stream.prime()
    except BaseException:
        await stream.aclose()
        raise
    return stream


_END = object()  # the generate stream ended


def _token_chunk(item: Any) -> bool:
    return isinstance(item, dict) and bool(item.get("choices")) and error_message(item) is None


def merge_chunks(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """Consecutive generate chunks as one: their ids and logprobs in order, the last one's finish.

    Derender is one HTTP call per chunk and replays the output so far through the parser; when the
    engine outpaces it, the chunks that arrived meanwhile go in one call (the chat route's parser,
    too, takes whatever one engine step produced)."""
    first = chunks[0]
    if len(chunks) == 1:
        return first
    ids: list[int] = []
    lps: list[Any] = []
    for c in chunks:
        ch = c["choices"][0]
        ids.extend(ch.get("token_ids") or ())
        lps.extend((ch.get("logprobs") or {}).get("content") or ())
    last = chunks[-1]["choices"][0]
    choice = {**last, "token_ids": ids, "logprobs": {"content": lps} if lps else None}
    return {**first, "choices": [choice]}


def chat_chunk(der: dict[str, Any], gen: dict[str, Any], cut: StopCut) -> dict[str, Any]:
    """A derendered chunk as vLLM's chat route streams it, with the ids, logprobs and version spans
    capture reads, and the stop strings cut from its content."""
    chunk = {k: v for k, v in der.items() if v is not None}
    gchoice = gen["choices"][0]
    choices = chunk.get("choices") or [{"index": 0, "delta": {}}]
    chunk["choices"] = choices
    choice = choices[0]
    _add_tokens(choice, gchoice)
    delta = choice.get("delta") or {}
    choice["delta"] = delta
    text = delta.get("content") or ""
    text = cut.feed(text) if gchoice.get("finish_reason") is None else cut.finish(gchoice.get("stop_reason"), text)
    if text:
        delta["content"] = text
    else:
        delta.pop("content", None)
    return chunk


class TitoStream:
    """A streamed token-in-token-out answer behind `UpstreamResponse`'s interface: chat SSE chunks,
    each derendered as its tokens arrive from generate (one derender call at a time, see
    `merge_chunks`). A failure after the first chunk ends the stream with an error chunk, as vLLM's
    chat route does."""

    status_code = 200

    def __init__(self, engine: EngineClient, base_url: str, resp: UpstreamResponse, chat: dict[str, Any],
                 ids: list[int], *, model: Any, cut: StopCut) -> None:
        self.headers = {"content-type": "text/event-stream"}
        self._engine, self._base, self._resp = engine, base_url, resp
        self._chat, self._ids, self._model, self._cut = chat, ids, model, cut
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._held: list[Any] = []
        self._state: Any = None  # derender's stream_state, carried from call to call
        self._meta = {"id": None, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
        self._ready: list[bytes] = []
        self._sent_tokens = self._ended = False
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        try:
            async for payload in iter_sse(self._resp.aiter_raw()):
                if payload == b"[DONE]":
                    break
                self._queue.put_nowait(orjson.loads(payload))
            self._queue.put_nowait(_END)
        except EngineUnreachable as e:
            self._queue.put_nowait(TitoUnavailable(f"generate stream broke: {e.kind}"))
        except orjson.JSONDecodeError as e:
            self._queue.put_nowait(TitoUnavailable(f"generate stream broke: {type(e).__name__}"))

    async def _take(self) -> list[Any]:
        """The next generate chunks to derender: every token chunk that has arrived (up to a finish),
        or one other item (usage, error, end)."""
        first = self._held.pop() if self._held else await self._queue.get()
        batch = [first]
        while _token_chunk(batch[-1]) and batch[-1]["choices"][0].get("finish_reason") is None \
                and not self._queue.empty():
            nxt = self._queue.get_nowait()
            if not _token_chunk(nxt):
                self._held.append(nxt)
                break
            batch.append(nxt)
        return batch if _token_chunk(first) else [first]

    async def _step(self) -> bytes:
        batch = await self._take()
        item = batch[0]
        if item is _END:
            self._ended = True
            return b"data: [DONE]\n\n"
        if isinstance(item, Exception):
            raise item
        if not _token_chunk(item):
            if (msg := error_message(item)) is not None:
                raise TitoUnavailable(f"generate failed: {msg}")
            if item.get("usage") is None:
                return b""
            return encode_data({**self._meta, "choices": [], "usage": item["usage"]})
        gen = merge_chunks(batch)
        req = {"stream": True, "model": self._model, "generate_chunk": for_derender(gen, self._cut.include),
               "stream_state": self._state,
               "prompt_tokens": len(self._ids), "prompt_token_ids": self._ids, "chat_request": self._chat}
        der = await _post(self._engine, self._base, DERENDER, req, "derender (streamed)")
        self._state = der.get("stream_state")
        if not isinstance(der.get("chunk"), dict):
            raise TitoUnavailable("derender sent no chunk")
        chunk = chat_chunk(der["chunk"], gen, self._cut)
        self._meta.update(id=chunk.get("id"), model=chunk.get("model", self._model))
        chunk["created"] = self._meta["created"]
        if not self._sent_tokens:
            chunk["prompt_token_ids"] = self._ids
            self._sent_tokens = True
        return encode_data(chunk)

    async def prime(self) -> None:
        """Derender up to the first chunk with output (raises TitoUnavailable: nothing was sent yet)."""
        while not self._sent_tokens and not self._ended:
            self._ready.append(await self._step())

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        ready, self._ready = self._ready, []
        if ready:
            yield b"".join(ready)
        while not self._ended:
            try:
                out = await self._step()
            except (TitoUnavailable, EngineUnreachable) as e:
                self._ended = True
                reason = str(e) if isinstance(e, TitoUnavailable) else f"derender failed: {e.kind}"
                yield encode_data({"error": {"message": reason, "type": "upstream_error"}}) + b"data: [DONE]\n\n"
                return
            if out:
                yield out

    async def aread(self) -> bytes:
        return b"".join([part async for part in self.aiter_raw()])

    async def aclose(self) -> None:
        # An unfinished generate is closed, not released: vLLM aborts a request whose connection drops.
        self._reader.cancel()
        await self._resp.aclose(finished=self._ended)
