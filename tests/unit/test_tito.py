"""Token-in-token-out pieces that need no engine: the prompt's assembly, the engine's version spans,
and the synthesized stream read back by the capture (the engine path: tests/integration/test_tito_vllm.py)."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from proxy.record.capture import ChatCapture, spans_to_versions
from proxy.tito import TitoResponse, TitoUnavailable, TokenMemory, continuation_ids, glue, history_cut
from proxy.translate.sse import iter_sse

IM_END, NL = 2, 198


def test_prompt_is_parent_ids_then_glue_then_new_turn() -> None:
    # The template rendered the parent's answer differently (7 -> 70, 71): the parent's own ids win.
    parent = [1, 5, 6, 7, IM_END]
    history = [1, 5, 6, 70, 71, IM_END, NL]
    full = history + [1, 9, IM_END, NL, 1, 4]
    assert continuation_ids(parent, history, full) == [1, 5, 6, 7, IM_END, NL, 1, 9, IM_END, NL, 1, 4]


def test_history_the_template_rewrites_is_refused() -> None:
    with pytest.raises(TitoUnavailable, match="not a prefix"):
        continuation_ids([1, 5, IM_END], [1, 5, IM_END, NL], [1, 6, IM_END, NL, 1, 4])


def test_parent_cut_short_has_no_glue() -> None:
    # finish_reason "length": the parent's last token is mid-answer, far from the history's end
    assert glue([1, 5, 6, 7, 8, 9, 10, IM_END, NL], 5) is None
    with pytest.raises(TitoUnavailable, match="end-of-turn"):
        continuation_ids([1, 5], [1, 5, 6, 7, 8, 9, 10, IM_END, NL], [1, 5, 6, 7, 8, 9, 10, IM_END, NL, 3])


def test_history_cut_is_after_the_last_assistant_turn() -> None:
    msgs = [{"role": "system"}, {"role": "user"}, {"role": "assistant"}, {"role": "tool"}, {"role": "user"}]
    assert history_cut(msgs) == 3
    assert history_cut([{"role": "user"}]) is None


def test_spans_become_one_version_per_token() -> None:
    spans = [{"version": "v1", "start": 0, "end": 2}, {"version": "v2", "start": 2, "end": 5}]
    assert spans_to_versions(spans, 5) == ["v1", "v1", "v2", "v2", "v2"]
    assert spans_to_versions(spans, 6) is None  # not covering the output: not trusted
    assert spans_to_versions([{"version": "v1", "start": 1, "end": 3}], 2) is None  # a gap
    assert spans_to_versions([], 3) is None


def test_token_memory_is_bounded_and_forgets() -> None:
    mem = TokenMemory(max_tokens=6)
    mem.put("a", [1, 2], [3])
    mem.put("b", [4, 5], [6])
    assert mem.get("a") == [1, 2, 3]
    mem.put("c", [7], [8])  # 8 tokens > 6: the oldest goes
    assert mem.get("a") is None and mem.get("b") == [4, 5, 6]
    mem.forget({"b"})
    assert mem.get("b") is None and mem.get("c") == [7, 8]


def _completion() -> dict:
    return {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "tiny",
        "prompt_token_ids": [1, 2, 3],
        "choices": [{
            "index": 0, "finish_reason": "tool_calls", "token_ids": [10, 11, IM_END],
            "logprobs": {"content": [{"token": "", "logprob": -0.5}] * 3},
            "weight_versions": [{"version": "v1", "start": 0, "end": 1}, {"version": "v2", "start": 1, "end": 3}],
            "message": {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "Read", "arguments": '{"a": 1}'}}]},
        }],
        "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
    }  # fmt: skip


def test_streamed_and_whole_answers_capture_the_same() -> None:
    whole = ChatCapture()
    whole.feed_response(_completion())

    async def read_stream() -> ChatCapture:
        cap = ChatCapture()
        resp = TitoResponse(_completion(), stream=True)
        async for payload in iter_sse(resp.aiter_raw()):
            if payload != b"[DONE]":
                cap.feed_chunk(orjson.loads(payload))
        return cap

    streamed = asyncio.run(read_stream())
    for cap in (whole, streamed):
        assert cap.prompt_token_ids == [1, 2, 3] and list(cap.output_token_ids) == [10, 11, IM_END]
        assert cap.output_versions == ["v1", "v2", "v2"]
        assert cap.assistant_message()["tool_calls"][0]["function"] == {"name": "Read", "arguments": '{"a": 1}'}
        assert cap.finish_reason == "tool_calls" and cap.usage == _completion()["usage"]


def test_an_engine_without_the_routes_is_not_asked_again_for_a_while() -> None:
    mem = TokenMemory()
    assert mem.may_ask("http://e1")
    mem.engine_lacks_routes("http://e1", for_s=60)
    assert not mem.may_ask("http://e1") and mem.may_ask("http://e2")
    mem.engine_lacks_routes("http://e2", for_s=0)
    assert mem.may_ask("http://e2")
