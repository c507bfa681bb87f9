"""Every door against the real vLLM (tiny model): the answer is vLLM's own answer to the request the door
sends it, and the step holds vLLM's token ids exactly (never re-tokenized). One table of per-door client
calls; door-specific vLLM checks (tool round trips, recorded client bodies, count_tokens) stay in each
door's file."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import openai
import pytest

from proxy.translate.anthropic import messages_to_chat
from proxy.translate.responses import responses_to_chat
from tests.session_builders import prompt_ids

pytestmark = pytest.mark.vllm


@dataclass(frozen=True)
class Answer:
    text: str
    input_tokens: int | None  # None: the door's streamed answer does not report it
    output_tokens: int | None


@dataclass(frozen=True)
class VllmDoor:
    name: str
    body: Callable[[str], dict[str, Any]]  # served model -> the door's request (greedy, short)
    to_chat: Callable[[dict[str, Any]], dict[str, Any]]  # what the door sends vLLM for it
    call: Callable[[Any, dict[str, Any], bool], Answer]  # (proxy, body, stream), through the official SDK


def _chat_call(proxy: Any, body: dict[str, Any], stream: bool) -> Answer:
    client = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0)
    if not stream:
        r = client.chat.completions.create(**body)
        return Answer(r.choices[0].message.content or "", r.usage.prompt_tokens, r.usage.completion_tokens)
    chunks = list(client.chat.completions.create(**body, stream=True))
    assert all(not c.usage for c in chunks)  # not asked for: usage was added for capture only
    return Answer("".join(c.choices[0].delta.content or "" for c in chunks if c.choices), None, None)


def _messages_call(proxy: Any, body: dict[str, Any], stream: bool) -> Answer:
    client = anthropic.Anthropic(base_url=proxy.url, auth_token="bearer-key", api_key=None, max_retries=0)
    body = dict(body)
    extra = {"temperature": body.pop("temperature")}  # still a Messages field, no longer an SDK argument
    if stream:
        with client.messages.stream(**body, extra_body=extra) as s:
            msg = s.get_final_message()
    else:
        msg = client.messages.create(**body, extra_body=extra)
    return Answer(msg.content[0].text, msg.usage.input_tokens, msg.usage.output_tokens)


def _responses_call(proxy: Any, body: dict[str, Any], stream: bool) -> Answer:
    client = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0)
    if stream:
        # The last event's response (the SDK's helper insists on `completed`; the tiny model usually
        # runs into the token limit: `incomplete`).
        events = list(client.responses.create(**body, stream=True))
        assert events[-1].type in ("response.completed", "response.incomplete")
        resp = events[-1].response
    else:
        resp = client.responses.create(**body)
    return Answer(resp.output_text, resp.usage.input_tokens, resp.usage.output_tokens)


DOORS = [
    VllmDoor("chat",
             lambda model: {"model": model, "max_tokens": 12, "temperature": 0,
                            "messages": [{"role": "system", "content": "Be short."},
                                         {"role": "user", "content": "Say something."}]},
             lambda body: body, _chat_call),
    VllmDoor("messages",
             lambda model: {"model": model, "max_tokens": 12, "temperature": 0, "system": "Be short.",
                            "messages": [{"role": "user", "content": "Say something."}]},
             lambda body: messages_to_chat(body).body, _messages_call),
    VllmDoor("responses",
             lambda model: {"model": model, "max_output_tokens": 12, "temperature": 0, "instructions": "Be short.",
                            "input": "Say something."},
             lambda body: responses_to_chat(body).body, _responses_call),
]


def direct(vllm_server, chat: dict[str, Any]) -> dict[str, Any]:
    """vLLM's own non-streamed answer to a chat body, with token ids and logprobs."""
    chat = {k: v for k, v in chat.items() if k not in ("stream", "stream_options")}
    r = httpx.post(vllm_server.base_url + "/v1/chat/completions",
                   json={**chat, "return_token_ids": True, "logprobs": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


# streamed-4: ATDP_STREAM_INTERVAL=4, vLLM sends up to 4 tokens per chunk (each door's translator and the
# capture take several tokens a chunk; the answer and the ids stay vLLM's own)
@pytest.mark.parametrize(("stream", "interval"), [(False, 1), (True, 1), (True, 4)],
                         ids=["whole", "streamed", "streamed-4"])
@pytest.mark.parametrize("door", DOORS, ids=[d.name for d in DOORS])
def test_answer_and_tokens_match_vllm(start_proxy, vllm_server, factory, door, stream, interval):
    proxy = start_proxy([vllm_server.base_url], stream_interval=interval)
    body = door.body(vllm_server.model)
    expected = direct(vllm_server, door.to_chat(body))
    got = door.call(proxy, body, stream)
    assert got.text == (expected["choices"][0]["message"]["content"] or "")
    if got.input_tokens is not None:
        assert got.input_tokens == expected["usage"]["prompt_tokens"]
    if got.output_tokens is not None:
        assert got.output_tokens == expected["usage"]["completion_tokens"]
    (step,) = proxy.steps(factory)
    assert prompt_ids(factory, step) == expected["prompt_token_ids"]  # never re-tokenized
    assert step.output_token_ids == expected["choices"][0]["token_ids"]
    logprobs = [x["logprob"] for x in expected["choices"][0]["logprobs"]["content"]]
    assert step.output_logprobs == pytest.approx(logprobs, abs=1e-3)
    assert step.token_source == "engine" and step.model == vllm_server.model
    assert step.ttft_ms is not None and step.ttft_ms <= step.total_ms


def _streamed_ids(proxy: Any, body: dict[str, Any]) -> list[list[int]]:
    """The output token ids of each chunk of a streamed chat answer that carries any (asked for)."""
    client = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0)
    chunks = client.chat.completions.create(**body, stream=True, extra_body={"return_token_ids": True})
    return [ids for c in chunks if c.choices and (ids := getattr(c.choices[0], "token_ids", None))]


def test_stream_interval_has_the_engine_send_fewer_larger_chunks(start_proxy, vllm_server, factory):
    """Each chunk is a read, a parse and a write in the proxy: with ATDP_STREAM_INTERVAL=4 vLLM sends
    its first token at once and then 4 a chunk, the same tokens, a quarter of the chunks."""
    body = {**DOORS[0].body(vllm_server.model), "max_tokens": 16}
    expected = direct(vllm_server, body)["choices"][0]["token_ids"]
    n = len(expected)
    assert n > 5  # enough tokens for the interval to show
    one = start_proxy([vllm_server.base_url])
    per_token = _streamed_ids(one, body)
    assert [t for ids in per_token for t in ids] == expected and len(per_token) == n
    four = start_proxy([vllm_server.base_url], stream_interval=4)
    grouped = _streamed_ids(four, body)
    assert [t for ids in grouped for t in ids] == expected
    assert len(grouped) <= 1 + -(-(n - 1) // 4) and max(map(len, grouped)) == 4
    (step,) = four.steps(factory)
    assert step.output_token_ids == expected and len(step.output_logprobs) == n


def test_five_turn_conversation_is_one_session(start_proxy, vllm_server, factory):
    proxy = start_proxy([vllm_server.base_url])
    c = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0)
    messages = [{"role": "system", "content": "You are terse."}]
    for turn in range(5):
        messages.append({"role": "user", "content": f"Question {turn}?"})
        r = c.chat.completions.create(model=vllm_server.model, messages=messages, temperature=0, max_tokens=8)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    steps = proxy.steps(factory)
    assert len(steps) == 5 and len({s.session_id for s in steps}) == 1
    assert [s.seq for s in steps] == [1, 2, 3, 4, 5]
    assert all(s.parent_step_id == p.id for s, p in zip(steps[1:], steps, strict=False))
    # Token history stored once: each later prompt shares a prefix with its parent's tokens.
    assert all(s.prompt_prefix_len > 0 for s in steps[1:])
