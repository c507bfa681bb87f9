"""Token-in-token-out on real vLLM (tiny model, `--enable-scale-out`): multi-turn tool-calling
conversations shaped like Hermes, Claude Code and Codex, through each door, streamed and not.

Every continuation whose history matches its parent is sent as the parent's exact prompt+output ids
followed by the new turn (`prompt_path = "tito"`), so its prompt begins with them; a client that
compacted its history is rendered and recorded as such.
"""

from __future__ import annotations

import threading
import time

import anthropic
import httpx
import pytest
from sqlalchemy import select

from proxy.store import tables as t
from proxy.store.read import session_document
from tests import agent_traffic as traffic

pytestmark = pytest.mark.vllm


def documents(proxy, factory) -> list:
    """Every step of the proxy's tenant, as ATDP documents (whole prompt ids, prompt_path)."""
    proxy.flush()
    with factory() as s:
        sessions = s.scalars(select(t.Session).where(t.Session.tenant_id == proxy.tenant)).all()
        return [step for sess in sessions for step in session_document(s, sess).steps]


# streamed-4: ATDP_STREAM_INTERVAL=4, so the generate stream (and the rendered first call's chat
# stream) carry up to 4 tokens a chunk and the proxy derenders each batch of them at once
@pytest.mark.parametrize(("stream", "interval"), [(False, 1), (True, 1), (True, 4)],
                         ids=["whole", "streamed", "streamed-4"])
@pytest.mark.parametrize("door", ["chat", "messages", "responses"])
def test_continuations_reuse_the_exact_prefix(start_proxy, vllm_server, factory, door: str, stream: bool,
                                              interval: int) -> None:
    proxy = start_proxy([vllm_server.base_url], tito_stream=stream, stream_interval=interval)
    model = vllm_server.model
    if door == "chat":
        traffic.hermes(proxy.v1, model, stream=stream)
    elif door == "messages":
        traffic.claude_code(proxy.url, model, stream=stream)
    else:
        traffic.codex(proxy.v1, model, stream=stream)
    steps = documents(proxy, factory)
    assert len(steps) == 3 and all(s.status == "ok" for s in steps), [(s.status, s.error) for s in steps]
    assert len({s.session_id for s in steps}) == 1
    first, *continuations = sorted(steps, key=lambda s: s.seq)
    assert first.tokens.prompt_path == "rendered" and first.parent_step_id is None
    # The forced calls really were tool calls, parsed back by the engine's parser on the tito path.
    assert all(s.action.tool_calls for s in [first, continuations[0]])
    assert [s.tokens.prompt_path for s in continuations] == ["tito", "tito"]
    assert traffic.prefix_exact(steps) == (2, 2)
    for s in continuations:
        assert len(s.tokens.output_logprobs) == len(s.tokens.output_token_ids) > 0


def test_compacted_history_is_rendered_and_recorded(start_proxy, vllm_server, factory) -> None:
    proxy = start_proxy([vllm_server.base_url])
    conv = traffic.claude_code(proxy.url, vllm_server.model, turns=2)
    # Claude Code compacts: same session, its history replaced by a summary. No parent to reuse.
    client = anthropic.Anthropic(api_key="k", base_url=proxy.url,
                                 default_headers={"x-claude-code-session-id": conv.session_hint or ""})
    client.messages.create(model=vllm_server.model, max_tokens=8, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": "Summary: two tests failed."},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "Continue."},
    ])  # fmt: skip
    steps = sorted(documents(proxy, factory), key=lambda s: s.seq)
    assert [s.tokens.prompt_path for s in steps] == ["rendered", "tito", "rendered"]
    assert steps[2].parent_step_id is None and steps[2].session_id == steps[0].session_id


def test_path_off_renders_every_call(start_proxy, vllm_server, factory) -> None:
    proxy = start_proxy([vllm_server.base_url], tito=False)
    traffic.hermes(proxy.v1, vllm_server.model, turns=2)
    steps = documents(proxy, factory)
    assert sorted(s.tokens.prompt_path for s in steps) == ["rendered", "rendered"]


def test_tito_steps_carry_the_versions_the_engine_reports(start_proxy, vllm_server, factory) -> None:
    # The engine is tagged behind the proxy's back (same weights, a new label): the rendered first
    # step carries the proxy's version, the tito continuation the engine's own spans.
    proxy = start_proxy([vllm_server.base_url])
    assert proxy.versions.ready.wait(60)  # its start-up tags the engine with the proxy's version first
    with httpx.Client(base_url=vllm_server.base_url, timeout=60) as engine:
        engine.post("/update_weight_version", json={"new_version": "engine-tag"}).raise_for_status()
        try:
            traffic.hermes(proxy.v1, vllm_server.model, turns=2)
        finally:  # the server is shared: back to vLLM's own label for untagged weights
            engine.post("/update_weight_version", json={"new_version": "default"}).raise_for_status()
    first, second = sorted(documents(proxy, factory), key=lambda s: s.seq)
    assert second.tokens.prompt_path == "tito"
    assert [(r.version, r.count) for r in second.tokens.output_versions] == [
        ("engine-tag", len(second.tokens.output_token_ids))]
    assert {r.version for r in first.tokens.output_versions} == {proxy.state.pool.replicas[0].version}


def _stream_chat(client, **kw) -> tuple[dict, list[int]]:
    """A streamed chat call: (the assembled assistant message + token ids, output tokens per chunk)."""
    content, calls, ids, per_chunk = [], {}, [], []
    extra = {"return_token_ids": True, **kw.pop("extra_body", {})}
    for chunk in client.chat.completions.create(stream=True, extra_body=extra, **kw):
        for choice in chunk.choices:
            got = list((choice.model_extra or {}).get("token_ids") or ())
            ids += got
            if got:
                per_chunk.append(len(got))
            content.append(choice.delta.content or "")
            for tc in choice.delta.tool_calls or ():
                cur = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                cur["name"] += (tc.function.name or "") if tc.function else ""
                cur["arguments"] += (tc.function.arguments or "") if tc.function else ""
    return {"content": "".join(content), "tool_calls": [calls[i] for i in sorted(calls)], "ids": ids}, per_chunk


def _whole_chat(client, **kw) -> dict:
    extra = {"return_token_ids": True, **kw.pop("extra_body", {})}
    resp = client.chat.completions.create(extra_body=extra, **kw)
    msg = resp.choices[0].message
    return {"content": msg.content or "", "ids": list((resp.choices[0].model_extra or {}).get("token_ids") or ()),
            "tool_calls": [{"name": tc.function.name, "arguments": tc.function.arguments} for tc in msg.tool_calls or ()]}


def _stream_across_a_freeze(client, engine: str, **kw) -> tuple[dict, list[int]]:
    """A streamed call the engine is frozen in mid-generation (`/pause?mode=keep`), so its first
    tokens can be derendered and sent on before the rest exist, whatever the engine's speed.

    vLLM's API server answers a derender late while it streams a fast engine's outputs (a 400-token
    answer of the tiny model on a quiet AMX machine came as one chunk); frozen, it answers at once.
    As in the keep-swap test the engine is frozen before the call reaches it, resumed, and frozen
    again a moment later; the moment grows until the freeze lands mid-answer."""
    gap, out = 0.005, {}

    def run() -> None:
        try:
            out["msg"], out["per_chunk"] = _stream_chat(client, **kw)
        except Exception as e:  # reported by the caller, not lost in the thread
            out["error"] = e

    for attempt in range(6):
        out.clear()
        httpx.post(engine + "/pause", params={"mode": "keep"}, timeout=60).raise_for_status()
        worker = threading.Thread(target=run)
        try:
            worker.start()
            time.sleep(1.0)  # its renders (answered while frozen); its generate request waits in the engine
            httpx.post(engine + "/resume", timeout=60).raise_for_status()
            time.sleep(gap)
            httpx.post(engine + "/pause", params={"mode": "keep"}, timeout=60).raise_for_status()
            time.sleep(1.0)  # the tokens so far derendered and sent on while nothing more comes
        finally:
            httpx.post(engine + "/resume", timeout=60)  # never leave the shared engine frozen
        worker.join(300)
        assert not worker.is_alive() and "error" not in out, out
        print(f"attempt {attempt + 1}: refrozen after {gap * 1000:.0f} ms, output tokens per chunk {out['per_chunk']}")
        if len(out["per_chunk"]) > 1:
            break
        gap *= 3
    return out["msg"], out["per_chunk"]


def test_a_streamed_continuation_is_incremental_and_says_what_the_whole_one_says(start_proxy, vllm_server,
                                                                                factory) -> None:
    # One parent, then the same continuation whole and streamed (temperature 0: the same tokens). The
    # stream arrives chunk by chunk (its first chunk holds a part of the answer), its text, tool call
    # and ids are the whole answer's; with a stop string, both cut where the chat route cuts.
    import openai

    proxy = start_proxy([vllm_server.base_url])
    client = openai.OpenAI(api_key="k", base_url=proxy.v1)
    tools = [{"type": "function", "function": {"name": "terminal", "parameters": traffic.TERMINAL}}]
    messages = [{"role": "user", "content": "Count the files."}]
    forced = {"type": "function", "function": {"name": "terminal"}}
    first = client.chat.completions.create(model=vllm_server.model, messages=messages, tools=tools, tool_choice=forced,
                                           temperature=0, max_tokens=traffic.TOOL_TOKENS).choices[0].message
    tc = first.tool_calls[0]
    messages += [{"role": "assistant", "content": first.content,
                  "tool_calls": [{"id": tc.id, "type": "function", "function": tc.function.model_dump()}]},
                 {"role": "tool", "tool_call_id": tc.id, "content": "12\n"},
                 {"role": "user", "content": "And the tests?"}]
    base = {"model": vllm_server.model, "messages": messages, "tools": tools, "temperature": 0}
    # Incremental is asserted on a long answer the engine is frozen in mid-way: chunks the engine sent
    # while a derender call ran are derendered together, and a fast engine's whole answer can outrun
    # the first derender (59 tokens on a quiet Zen 4, 400 on a quiet AMX Xeon).
    long = {"tool_choice": "none", "max_tokens": 400, "extra_body": {"ignore_eos": True}}
    for kw in ({"tool_choice": forced, "max_tokens": traffic.TOOL_TOKENS}, long, {"tool_choice": "none", "max_tokens": 24}):
        whole = _whole_chat(client, **base, **kw)
        if kw is long:
            streamed, per_chunk = _stream_across_a_freeze(client, vllm_server.base_url, **base, **kw)
        else:
            streamed, per_chunk = _stream_chat(client, **base, **kw)
        assert streamed == whole and len(whole["ids"]) > 1
        if kw is long:
            assert len(per_chunk) > 1 and per_chunk[0] < len(whole["ids"]), per_chunk  # incremental
    assert whole["tool_calls"] == [] and len(whole["content"]) > 4
    text = whole["content"]
    stop = next(text[i:i + 2] for i in range(2, len(text) - 1) if text.find(text[i:i + 2]) == i)
    cut = text[: text.find(stop)]
    kw = {"tool_choice": "none", "max_tokens": 24, "stop": [stop]}
    assert _whole_chat(client, **base, **kw)["content"] == cut
    assert _stream_chat(client, **base, **kw)[0]["content"] == cut
    steps = sorted(documents(proxy, factory), key=lambda s: s.seq)
    assert [s.tokens.prompt_path for s in steps] == ["rendered"] + ["tito"] * 8
    assert traffic.prefix_exact(steps) == (8, 8)
