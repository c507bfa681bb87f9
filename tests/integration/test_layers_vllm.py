"""Harness and memory versions in front of the real engine (vLLM on the CPU, the tiny model): the
overlay's text and the retrieved fact are in the prompt the engine tokenized, so the step's prompt
token ids (what training sees) hold them, through the OpenAI and the Anthropic doors; the step names
both versions and the fact; a rollback takes the overlay out of the next call and leaves the memory."""

from __future__ import annotations

import time
import uuid

import anthropic
import httpx
import openai
import pytest

from tests.session_builders import prompt_ids

pytestmark = pytest.mark.vllm

ADMIN = {"authorization": "Bearer admin-test-key"}
ADDITION = "Always answer with the port number first."
FACT = "The quollbridge service listens on port 4821."
QUESTION = "Which port does the quollbridge service use?"


def _post(proxy, body: dict) -> dict:
    r = httpx.post(f"{proxy.url}/atdp/v1/versions", headers=ADMIN, json={**body, "wait": True}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _chat(proxy, model: str, sid: str) -> httpx.Headers:
    c = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0)
    r = c.chat.completions.with_raw_response.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                                    max_tokens=4, temperature=0,
                                                    extra_headers={"x-atdp-session-id": sid})
    r.parse()
    return r.headers


def _messages(proxy, model: str, sid: str) -> httpx.Headers:
    c = anthropic.Anthropic(base_url=proxy.url, api_key="x", max_retries=0)
    r = c.messages.with_raw_response.create(model=model, max_tokens=4, messages=[{"role": "user", "content": QUESTION}],
                                            extra_headers={"x-atdp-session-id": sid})
    r.parse()
    return r.headers


def test_overlay_and_memory_reach_the_engine_and_the_steps_token_ids(start_proxy, vllm_server, factory):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vllm_server.model_dir)
    proxy = start_proxy([vllm_server.base_url])  # gates off, as the fixture's operator says: this is serving
    harness = _post(proxy, {"layer": "harness", "tenant": proxy.tenant, "overlay": {"system_append": ADDITION}})
    memory = _post(proxy, {"layer": "memory", "tenant": proxy.tenant, "facts": [FACT]})
    assert harness["status"] == memory["status"] == "serving", (harness, memory)

    def seen(call, sid: str) -> tuple[httpx.Headers, str, object]:
        headers = call(proxy, vllm_server.model, sid)
        [step] = proxy.steps(factory, sid)
        return headers, tokenizer.decode(prompt_ids(factory, step)), step

    deadline = time.monotonic() + 10  # the layers' table reloads after a promotion
    while _chat(proxy, vllm_server.model, f"warm-{uuid.uuid4().hex[:6]}").get("x-atdp-harness-version") is None \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    for call in (_chat, _messages):
        headers, prompt, step = seen(call, f"{call.__name__}-{uuid.uuid4().hex[:6]}")
        assert headers["x-atdp-harness-version"] == harness["name"]
        assert headers["x-atdp-memory-version"] == memory["name"]
        assert ADDITION in prompt and FACT in prompt and QUESTION in prompt, prompt
        assert step.harness_version == harness["id"] and step.memory_version == memory["id"]
        assert len(step.memory_facts) == 1 and step.status == "ok" and step.output_token_ids

    r = httpx.post(f"{proxy.url}/atdp/v1/versions/{harness['name']}/rollback", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    headers, prompt, step = seen(_chat, f"after-{uuid.uuid4().hex[:6]}")
    # The tenant's scope now has no harness of its own (a global one that other tests left serving on
    # the shared database may apply): not this one.
    assert headers.get("x-atdp-harness-version") != harness["name"] and step.harness_version != harness["id"]
    assert ADDITION not in prompt and FACT in prompt and headers["x-atdp-memory-version"] == memory["name"]
