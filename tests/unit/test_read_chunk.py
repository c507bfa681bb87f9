"""`read_chunk` (the error test inline, choice 0 taken without a search) reads what the general
path reads, and the capture keeps what it kept (ids and logprobs compact, odd values as before)."""

from __future__ import annotations

from array import array

import pytest

from proxy.record.capture import ChatCapture
from proxy.translate.chunks import _with_choice, read_chunk


def _general(chunk: dict) -> tuple | type:
    ids = chunk.get("prompt_token_ids")
    try:
        return _with_choice(chunk, ids if isinstance(ids, list) else None, chunk.get("usage") or None, "delta")
    except Exception as e:  # a malformed chunk fails as it always did
        return type(e)


def _fast(chunk: dict) -> tuple | type:
    try:
        return read_chunk(chunk)
    except Exception as e:
        return type(e)


def _lp(*values: float) -> dict:
    return {"content": [{"token": "x", "logprob": v, "bytes": [120], "top_logprobs": []} for v in values]}


BASE = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
CHOICES = [
    {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None},
    {"index": 0, "delta": {"content": "Hel"}, "logprobs": _lp(-0.5, -0.25), "finish_reason": None, "token_ids": [7, 8]},
    {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop", "stop_reason": 32000, "token_ids": []},
    {"index": 0, "delta": {"content": "x"}, "logprobs": {"content": None}, "token_ids": [1],
     "weight_versions": [{"version": "v1", "start": 0, "end": 1}]},
    {"delta": {"content": "no index"}, "token_ids": [3]},
    {"index": 0, "delta": {"reasoning_content": "think"}, "token_ids": [4]},
    {"index": 0, "delta": {"reasoning": "think"}, "token_ids": [4]},
    {"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": "{"}}]}},
    {"index": 1, "delta": {"content": "second choice"}},
    {"index": 0, "delta": None, "finish_reason": "length"},
    {"index": 0, "delta": "not an object"},
    {"index": 0, "message": {"content": "a message, not a delta"}},
]


@pytest.mark.parametrize("choice", CHOICES)
@pytest.mark.parametrize("extra", [{}, {"prompt_token_ids": [1, 2, 3]}, {"usage": {"prompt_tokens": 3}}])
def test_the_fast_path_reads_what_the_general_path_reads(choice: dict, extra: dict) -> None:
    chunk = {**BASE, **extra, "choices": [choice]}
    assert _fast(chunk) == _general(chunk)
    # Choice 0 taken directly reads as first_choice's search finds it (a tuple takes the search).
    assert _fast(chunk) == _fast({**chunk, "choices": tuple(chunk["choices"])})


@pytest.mark.parametrize("chunk", [
    {**BASE, "choices": []},
    {**BASE, "choices": [CHOICES[1], {**CHOICES[1], "index": 1}]},
    {**BASE, "choices": [{**CHOICES[1], "index": 1}, CHOICES[1]]},
    {**BASE, "choices": None, "usage": {"prompt_tokens": 3}},
    {**BASE, "choices": ["not an object"]},
])
def test_other_shapes_take_the_general_path(chunk: dict) -> None:
    assert _fast(chunk) == _general(chunk)


def test_an_error_chunk_is_an_error() -> None:
    for chunk in ({"error": {"message": "boom"}}, {"object": "error", "message": "boom"}):
        part = read_chunk(chunk)
        assert part.error == "boom" and not part.has_choice


def test_the_capture_keeps_ids_and_logprobs_compact() -> None:
    cap = ChatCapture()
    for choice in CHOICES[:4]:
        cap.feed_chunk({**BASE, "choices": [choice]})
    assert cap.output_token_ids == array("i", [7, 8, 1]) and isinstance(cap.output_token_ids, array)
    assert cap.output_logprobs == array("f", [-0.5, -0.25]) and isinstance(cap.output_logprobs, array)
    assert cap.output_text == "Helx" and cap.finish_reason == "stop" and cap.stop_reason == 32000
    # A logprob sent as a numeric string (no engine does) is read as float() reads it, as before.
    cap.feed_chunk({**BASE, "choices": [{"index": 0, "delta": {"content": "y"}, "logprobs": _lp("-1.5"),
                                         "token_ids": [9]}]})
    assert cap.output_logprobs[-1] == -1.5


def test_a_completion_s_prompt_ids_are_read_without_a_copy_and_odd_values_as_no_ids() -> None:
    from proxy.translate.chunks import read_completion

    ids = list(range(50_000))
    completion = {**BASE, "object": "chat.completion", "prompt_token_ids": ids,
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "token_ids": [5]}]}
    assert read_completion(completion).prompt_token_ids is ids  # an agent's prompt: not copied per call
    # What is not a list reads as no ids, as a stream's chunk reads it (list() of it raised or split it).
    for odd in ("1,2,3", 7, {"a": 1}, None):
        assert read_completion({**completion, "prompt_token_ids": odd}).prompt_token_ids == []
