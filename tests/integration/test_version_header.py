"""`X-ATDP-Model-Version` on every model call, through the official SDKs, on the real engine.

vLLM on the CPU with the tiny model: the three doors (chat completions, responses, messages),
streamed and not, plus an error answer that came from the engine (a `max_tokens` beyond the model's
context: vLLM answers 400), first under `base`, then after a swap to the seed-1 checkpoint (`seed1`).
For every call the header must equal the version recorded on the step the `x-atdp-step-id` header
names, and the calls made after the swap must carry the new version.
"""

from __future__ import annotations

from collections.abc import Callable

import anthropic
import httpx
import openai
import pytest

from proxy.store import tables as t

ADMIN = {"authorization": "Bearer admin-test-key"}
HEADER = "x-atdp-model-version"

pytestmark = pytest.mark.vllm

Headers = httpx.Headers


def _calls(proxy, model: str, tag: str) -> dict[str, Callable[[], Headers]]:
    """One callable per kind of call; each returns the response headers the SDK saw."""
    oa = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0)
    an = anthropic.Anthropic(base_url=proxy.url, api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "say something"}]

    def sid(kind: str) -> dict[str, str]:
        return {"x-atdp-session-id": f"{tag}-{kind}"}

    def chat() -> Headers:
        raw = oa.chat.completions.with_raw_response.create(model=model, messages=msgs, max_tokens=6,
                                                           extra_headers=sid("chat"))
        assert raw.parse().choices[0].message is not None
        return raw.headers

    def chat_stream() -> Headers:
        with oa.chat.completions.with_streaming_response.create(model=model, messages=msgs, max_tokens=6, stream=True,
                                                                extra_headers=sid("chat-stream")) as r:
            assert any(chunk.choices for chunk in r.parse())
            return r.headers

    def responses() -> Headers:
        raw = oa.responses.with_raw_response.create(model=model, input="say something", max_output_tokens=16,
                                                    extra_headers=sid("responses"))
        assert raw.parse().output is not None
        return raw.headers

    def responses_stream() -> Headers:
        with oa.responses.with_streaming_response.create(model=model, input="say something", max_output_tokens=16,
                                                         stream=True, extra_headers=sid("responses-stream")) as r:
            assert [e.type for e in r.parse()][-1] in ("response.completed", "response.incomplete")
            return r.headers

    def messages() -> Headers:
        raw = an.messages.with_raw_response.create(model=model, messages=msgs, max_tokens=6,
                                                   extra_headers=sid("messages"))
        assert raw.parse().content is not None
        return raw.headers

    def messages_stream() -> Headers:
        with an.messages.with_streaming_response.create(model=model, messages=msgs, max_tokens=6, stream=True,
                                                        extra_headers=sid("messages-stream")) as r:
            assert [e.type for e in r.parse()][-1] == "message_stop"
            return r.headers

    def chat_engine_error() -> Headers:
        with pytest.raises(openai.BadRequestError) as e:
            oa.chat.completions.create(model=model, messages=msgs, max_tokens=10**7, extra_headers=sid("chat-error"))
        return e.value.response.headers

    def messages_engine_error() -> Headers:
        with pytest.raises(anthropic.BadRequestError) as e:
            # An explicit timeout: the SDK refuses a non-streamed call this long otherwise, before sending it.
            an.messages.create(model=model, messages=msgs, max_tokens=10**7, extra_headers=sid("messages-error"),
                               timeout=60)
        return e.value.response.headers

    return {"chat": chat, "chat-stream": chat_stream, "responses": responses, "responses-stream": responses_stream,
            "messages": messages, "messages-stream": messages_stream, "chat-error": chat_engine_error,
            "messages-error": messages_engine_error}


def test_every_call_names_the_version_its_step_records_across_a_swap(start_proxy, vllm_server, tiny_model_dir_b,
                                                                     own_db):
    from tests.vllm_fixtures import swap_weights

    url, factory = own_db
    proxy = start_proxy([vllm_server.base_url], database_url=url)
    assert proxy.versions.ready.wait(60)
    seen: list[tuple[str, str, str, str | None]] = []  # (phase, kind, step id, header)
    try:
        for phase in ("before", "after"):
            if phase == "after":
                # The operator override: this test is about the header, not the gates.
                r = httpx.post(proxy.url + "/atdp/v1/versions", headers=ADMIN, timeout=300,
                               json={"checkpoint": str(tiny_model_dir_b), "name": "seed1", "promote": "now"})
                assert r.status_code == 200 and r.json()["status"] == "serving", r.text
            for kind, call in _calls(proxy, vllm_server.model, phase).items():
                headers = call()
                seen.append((phase, kind, headers["x-atdp-step-id"], headers.get(HEADER)))
    finally:
        # The server is shared by the test session: whatever happened, it serves seed 0 again.
        if httpx.get(vllm_server.base_url + "/weight_info", timeout=10).json().get("weight_version") != "base":
            swap_weights(vllm_server.base_url, vllm_server.model_dir, "base")

    proxy.flush()
    with factory() as s:
        recorded = {st.id: (st.model_version, st.status) for st in s.query(t.Step).all()}
    for phase, kind, step_id, header in seen:
        version, status = recorded[step_id]
        assert header == version, (phase, kind, header, version)
        assert header == ("base" if phase == "before" else "seed1"), (phase, kind, header)
        assert (status == "error") == kind.endswith("-error"), (kind, status)
    assert len(seen) == 16
