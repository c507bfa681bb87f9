"""Server-sent events: encoding what we emit, reading vLLM's stream, and a small incremental decoder.

Both translated APIs name every event (`event: NAME` then `data: JSON`); chat completions sends
only `data:` lines and ends with `data: [DONE]`.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson

_EOL = re.compile(rb"\r\n|\r|\n")

DONE = b"data: [DONE]\n\n"


def encode_event(event: str, data: Any) -> bytes:
    """One named event: `event: NAME\\ndata: JSON\\n\\n` (compact JSON, UTF-8, on one line)."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def encode_data(data: Any) -> bytes:
    """One unnamed event, as chat completions streams them."""
    return b"data: " + orjson.dumps(data) + b"\n\n"


@dataclass
class ServerSentEvent:
    event: str | None
    data: str

    def json(self) -> Any:
        return orjson.loads(self.data)


class SSEDecoder:
    """Incremental decoder: feed raw bytes as they arrive, get the completed events back.

    Follows the WHATWG rules that matter here: lines end in LF, CRLF or CR; `data:` lines of one
    event are joined with LF; comments (`:`) and `id:`/`retry:` fields are skipped.
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._event: str | None = None
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[ServerSentEvent]:
        self._buffer += chunk
        events: list[ServerSentEvent] = []
        while True:
            line, found = self._next_line()
            if not found:
                return events
            event = self._line(line)
            if event is not None:
                events.append(event)

    def flush(self) -> list[ServerSentEvent]:
        """End of stream: a final event without its blank line still counts."""
        events: list[ServerSentEvent] = []
        if self._buffer:
            event = self._line(self._buffer.decode().removesuffix("\r"))
            self._buffer = b""
            if event is not None:
                events.append(event)
        event = self._line("")
        if event is not None:
            events.append(event)
        return events

    def _next_line(self) -> tuple[str, bool]:
        match = _EOL.search(self._buffer)
        # A CR at the very end may be the first half of CRLF: wait for more bytes.
        if match is None or (match.group() == b"\r" and match.end() == len(self._buffer)):
            return "", False
        line = self._buffer[: match.start()].decode()
        self._buffer = self._buffer[match.end() :]
        return line, True

    def _line(self, line: str) -> ServerSentEvent | None:
        if line == "":
            if not self._data and self._event is None:
                return None
            event = ServerSentEvent(self._event, "\n".join(self._data))
            self._event, self._data = None, []
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        return None


async def iter_sse_batches(raw_chunks: AsyncIterable[bytes]) -> AsyncIterator[list[bytes]]:
    """Yield, per network read, the `data:` payloads (bytes) of the SSE events it completed.

    Handling a read's events together lets the proxy answer with one write per read instead of
    one per event: the same bytes, far fewer sends when the engine is fast.
    """
    buf = b""
    async for raw in raw_chunks:
        buf += raw
        if b"\n\n" not in buf:
            continue
        done, _, buf = buf.rpartition(b"\n\n")
        yield [line[5:].strip() for event in done.split(b"\n\n") for line in event.split(b"\n")
               if line.startswith(b"data:")]
    if buf.strip():
        yield [line[5:].strip() for line in buf.split(b"\n") if line.startswith(b"data:")]


async def iter_sse(raw_chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """Yield each SSE event's `data:` payload (bytes) as it arrives."""
    async for batch in iter_sse_batches(raw_chunks):
        for payload in batch:
            yield payload
