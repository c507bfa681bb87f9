"""The SSE encoder and the incremental decoder used by the translation layer."""

from __future__ import annotations

import pytest

from proxy.translate.sse import DONE, ServerSentEvent, SSEDecoder, encode_data, encode_event


def test_encode() -> None:
    assert encode_event("ping", {"type": "ping"}) == b'event: ping\ndata: {"type":"ping"}\n\n'
    assert encode_data({"a": "é\n"}) == b'data: {"a":"\xc3\xa9\\n"}\n\n'
    assert DONE == b"data: [DONE]\n\n"


STREAM = (
    b": keep-alive comment\r\n"
    b'event: message_start\r\ndata: {"a":1}\r\n\r\n'
    b"data: line one\ndata: line two\nid: 7\nretry: 10\n\n"
    b"event: x\rdata:no-space\r\r"
    b"data: [DONE]\n\n"
)
EXPECTED = [
    ServerSentEvent("message_start", '{"a":1}'),
    ServerSentEvent(None, "line one\nline two"),
    ServerSentEvent("x", "no-space"),
    ServerSentEvent(None, "[DONE]"),
]


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(STREAM)])
def test_decoder_any_split(size: int) -> None:
    decoder = SSEDecoder()
    events = []
    for i in range(0, len(STREAM), size):
        events += decoder.feed(STREAM[i : i + size])
    events += decoder.flush()
    assert events == EXPECTED
    assert events[0].json() == {"a": 1}


def test_decoder_flushes_an_unterminated_event() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"event: a\ndata: 1") == []
    assert decoder.flush() == [ServerSentEvent("a", "1")]


def test_decoder_lone_cr_at_the_end() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: 1\r") == []  # may be the first half of CRLF
    assert decoder.flush() == [ServerSentEvent(None, "1")]
