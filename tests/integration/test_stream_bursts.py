"""An engine faster than its reader: every chunk of an answer arrives in one network read.

The proxy answers all the chunks of one read with one write (`proxy.streams.relay` for the
translated doors, the chat door's own stream); the client must still get every event in order and the
step every token. The scripted upstream's `#burst TEXT` sends a whole stream in one write;
`#bursterror TEXT` ends it with vLLM's error chunk in place of its end (no `[DONE]`).
"""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from proxy.translate.sse import SSEDecoder

TEXT = " ".join(["a burst of tokens"] * 12)  # 215 byte-tokens: 54 chunks of 4 in one read
ANSWER = "[w0] " + TEXT


def _stream_text(proxy, door: str, prompt: str) -> str:
    """The answer's text as the door's official SDK assembles it from the stream."""
    if door == "messages":
        client = anthropic.Anthropic(base_url=proxy.url, api_key="unused-in-open-mode", max_retries=0)
        with client.messages.stream(model="fake", max_tokens=512, messages=[{"role": "user", "content": prompt}]) as s:
            deltas = list(s.text_stream)
            assert s.get_final_message().stop_reason == "end_turn"
        return "".join(deltas)
    client = openai.OpenAI(base_url=proxy.v1, api_key="unused-in-open-mode", max_retries=0)
    if door == "responses":
        events = list(client.responses.create(model="fake", input=prompt, stream=True))
        assert events[-1].type == "response.completed"
        return "".join(e.delta for e in events if e.type == "response.output_text.delta")
    chunks = list(client.chat.completions.create(model="fake", messages=[{"role": "user", "content": prompt}],
                                                 stream=True))
    assert chunks[-1].choices[0].finish_reason == "stop"
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize("door", ["chat", "messages", "responses"])
def test_a_stream_read_in_one_piece_reaches_the_client_and_the_step_whole(start_proxy, fake_upstream, factory, door):
    proxy = start_proxy([fake_upstream.url])
    assert _stream_text(proxy, door, "#burst " + TEXT) == ANSWER
    (step,) = proxy.steps(factory)
    assert step.status == "ok" and bytes(step.output_token_ids).decode() == ANSWER
    assert len(step.output_logprobs) == len(step.output_token_ids) == len(ANSWER.encode())


@pytest.mark.parametrize("door", ["chat", "messages", "responses"])
def test_an_engine_failure_inside_one_read_ends_the_stream_with_an_error(start_proxy, fake_upstream, factory, door):
    proxy = start_proxy([fake_upstream.url])
    path, body = {
        "chat": ("/v1/chat/completions", {"model": "fake", "stream": True,
                                          "messages": [{"role": "user", "content": "#bursterror " + TEXT}]}),
        "messages": ("/v1/messages", {"model": "fake", "stream": True, "max_tokens": 512,
                                      "messages": [{"role": "user", "content": "#bursterror " + TEXT}]}),
        "responses": ("/v1/responses", {"model": "fake", "stream": True, "input": "#bursterror " + TEXT}),
    }[door]
    r = httpx.post(proxy.url + path, json=body, timeout=30)
    assert r.status_code == 200  # the failure came after the answer had started
    decoder = SSEDecoder()
    events = [e for e in decoder.feed(r.content) + decoder.flush() if e.data != "[DONE]"]
    assert b"message_stop" not in r.content and b"response.completed" not in r.content
    last = events[-1].json()
    assert "scripted engine failure" in str(last), last  # the error is the last event (chat: then its [DONE])
    if door == "chat":
        text = "".join((e.json()["choices"] or [{}])[0].get("delta", {}).get("content") or ""
                       for e in events[:-1])
    elif door == "messages":
        text = "".join(e.json()["delta"]["text"] for e in events if e.event == "content_block_delta")
    else:
        text = "".join(e.json()["delta"] for e in events if e.event == "response.output_text.delta")
    assert text == ANSWER  # every chunk before the failure was relayed
    (step,) = proxy.steps(factory)
    assert step.status == "error" and bytes(step.output_token_ids).decode() == ANSWER
