"""Token-in-token-out pieces that need no engine: the prompt's assembly, the engine's version spans,
the streamed chunks (derender + generate) read back by the capture, stop strings (the engine path: tests/integration/test_tito_vllm.py)."""

from __future__ import annotations

import orjson
import pytest

from proxy import tito
from proxy.record.capture import ChatCapture, spans_to_versions
from proxy.tito import TitoUnavailable, TokenMemory, continuation_ids, glue, history_cut

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


def _gen_chunk(ids: list[int], lps: list[float], finish: str | None = None, stop_reason=None, spans=None) -> dict:
    """One `/inference/v1/generate` stream chunk (token ids, id-shaped logprobs)."""
    choice = {"index": 0, "token_ids": ids, "finish_reason": finish, "stop_reason": stop_reason,
              "logprobs": {"content": [{"token_id": i, "logprob": lp} for i, lp in zip(ids, lps, strict=True)]}}
    if spans is not None:
        choice["weight_versions"] = spans
    return {"request_id": "generate-tokens-1", "choices": [choice]}


def _der_chunk(delta: dict, finish: str | None = None) -> dict:
    """What derender's streamed parser path answers for a chunk (no logprobs, no ids: it resolves none)."""
    return {"id": "generate-tokens-1", "object": "chat.completion.chunk", "created": 5, "model": "tiny",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                         "stop_reason": None, "token_ids": None}], "usage": None}


def test_generate_chunks_that_arrived_together_are_derendered_as_one() -> None:
    a, b = _gen_chunk([10], [-0.1]), _gen_chunk([11, 12], [-0.2, -0.3], "stop", spans=[{"version": "v", "start": 0, "end": 3}])
    merged = tito.merge_chunks([a, b])["choices"][0]
    assert merged["token_ids"] == [10, 11, 12] and merged["finish_reason"] == "stop"
    assert [x["logprob"] for x in merged["logprobs"]["content"]] == [-0.1, -0.2, -0.3]
    assert merged["weight_versions"] == [{"version": "v", "start": 0, "end": 3}]
    assert tito.merge_chunks([a]) is a


def test_streamed_chunks_capture_what_a_whole_answer_does() -> None:
    # A forced tool call, streamed: derender's deltas (name, then argument fragments) plus generate's
    # ids, logprobs and the version spans on the finishing chunk.
    cut = tito.StopCut.of({})
    spans = [{"version": "v1", "start": 0, "end": 1}, {"version": "v2", "start": 1, "end": 3}]
    parts = [
        (_der_chunk({"role": "assistant", "tool_calls": [
            {"index": 0, "id": "call_1", "type": "function", "function": {"name": "Read", "arguments": ""}}]}),
         _gen_chunk([10], [-0.5])),
        (_der_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}), _gen_chunk([11], [-0.5])),
        (_der_chunk({}, "tool_calls"), _gen_chunk([IM_END], [-0.5], "stop", spans=spans)),
    ]  # fmt: skip
    cap = ChatCapture()
    for i, (der, gen) in enumerate(parts):
        chunk = tito.chat_chunk(der, gen, cut)
        if i == 0:
            chunk["prompt_token_ids"] = [1, 2, 3]
        cap.feed_chunk(orjson.loads(orjson.dumps(chunk)))
    cap.feed_chunk({"id": "generate-tokens-1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}})
    assert list(cap.prompt_token_ids) == [1, 2, 3] and list(cap.output_token_ids) == [10, 11, IM_END]
    assert list(cap.output_logprobs) == [-0.5] * 3 and cap.output_versions == ["v1", "v2", "v2"]
    assert cap.assistant_message()["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "Read", "arguments": '{"a": 1}'}}]
    assert cap.finish_reason == "tool_calls" and cap.usage == {"prompt_tokens": 3, "completion_tokens": 3}


def test_stop_strings_are_held_back_and_cut_as_the_chat_route_cuts_them() -> None:
    # Derender decodes the tokens that completed "END" (and what followed in the same token); the
    # client must see neither, and no text that a stop string could still claim.
    cut = tito.StopCut.of({"stop": ["END", "xy"]})
    sent = [cut.feed(t) for t in ["Hel", "lo E"]]
    assert sent == ["H", "ello"]  # " E" held back: the longest stop string, less one character
    assert cut.finish("END", "NDzz") == " "  # the last tokens completed the stop string
    keep = tito.StopCut.of({"stop": "END", "include_stop_str_in_output": True})
    assert keep.feed("Hello E") + keep.finish("END", "NDzz") == "Hello END"  # nothing after it
    # A stop token (an int stop_reason) or none: everything held is sent.
    other = tito.StopCut.of({"stop": ["END"]})
    assert other.feed("abcEN") + other.finish(None, "x") == "abcENx"
    assert tito.StopCut.of({}).feed("EN") == "EN"


def test_a_finishing_chunk_carries_the_held_text_cut_at_the_stop() -> None:
    cut = tito.StopCut.of({"stop": ["\n\n"]})
    first = tito.chat_chunk(_der_chunk({"role": "assistant", "content": "Four"}), _gen_chunk([7], [-1.0]), cut)
    last = tito.chat_chunk(_der_chunk({"content": " files.\n\nMore"}, "stop"),
                           _gen_chunk([8, 9], [-1.0, -1.0], "stop", "\n\n"), cut)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "Fou"}
    assert last["choices"][0]["delta"]["content"] == "r files."
    assert last["choices"][0]["token_ids"] == [8, 9]


def test_an_engine_without_the_routes_is_not_asked_again_for_a_while() -> None:
    mem = TokenMemory()
    assert mem.may_ask("http://e1")
    mem.engine_lacks_routes("http://e1", for_s=60)
    assert not mem.may_ask("http://e1") and mem.may_ask("http://e2")
    mem.engine_lacks_routes("http://e2", for_s=0)
    assert mem.may_ask("http://e2")
