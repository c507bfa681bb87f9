"""The chat door against the real vLLM (tiny model): same answers, token-exact capture, sessions."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.vllm


def _direct(vllm_server, messages, **kw):
    body = {"model": vllm_server.model, "messages": messages, "temperature": 0, "max_tokens": 16,
            "return_token_ids": True, "logprobs": True, **kw}
    return httpx.post(vllm_server.base_url + "/v1/chat/completions", json=body, timeout=60).json()


def test_non_streamed_answer_and_tokens_match_vllm(start_proxy, vllm_server, factory):
    proxy = start_proxy([vllm_server.base_url])
    messages = [{"role": "user", "content": "Say something short."}]
    direct = _direct(vllm_server, messages)
    c = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0)
    got = c.chat.completions.create(model=vllm_server.model, messages=messages, temperature=0, max_tokens=16)
    assert got.choices[0].message.content == direct["choices"][0]["message"]["content"]
    assert got.usage.completion_tokens == direct["usage"]["completion_tokens"]
    (step,) = proxy.steps(factory)
    assert step.prompt_token_ids == direct["prompt_token_ids"]  # never re-tokenized
    assert step.output_token_ids == direct["choices"][0]["token_ids"]
    lp = [x["logprob"] for x in direct["choices"][0]["logprobs"]["content"]]
    assert step.output_logprobs == pytest.approx(lp, abs=1e-3)
    assert step.token_source == "engine" and step.model == vllm_server.model


def test_streamed_answer_and_tokens_match_vllm(start_proxy, vllm_server, factory):
    proxy = start_proxy([vllm_server.base_url])
    messages = [{"role": "user", "content": "Stream a few words."}]
    direct = _direct(vllm_server, messages)
    c = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0)
    chunks = list(c.chat.completions.create(model=vllm_server.model, messages=messages, temperature=0, max_tokens=16, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == direct["choices"][0]["message"]["content"]
    (step,) = proxy.steps(factory)
    assert step.prompt_token_ids == direct["prompt_token_ids"]
    assert step.output_token_ids == direct["choices"][0]["token_ids"]
    assert step.ttft_ms is not None and step.ttft_ms <= step.total_ms


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
