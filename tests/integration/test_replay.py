"""`atdp replay`: recorded inputs rebuilt from the store, re-sent, and stored as a linked session."""

from __future__ import annotations

import openai
import pytest
from sqlalchemy import select

from proxy.cli import main
from proxy.store import tables as t
from proxy.store.tokens import rebuild_prompt_ids
from proxy.tools.replay import output_units, replay_session
from tests.fake_vllm import render
from tests.proxy_fixtures import shared_redactor
from tests.session_builders import agent_session, anthropic_session


def _session_steps(factory, external_id: str, tenant: str) -> tuple[t.Session, list[t.Step], dict[str, list[int]]]:
    with factory() as s:
        row = s.scalar(select(t.Session).where(t.Session.external_id == external_id, t.Session.tenant_id == tenant))
        steps = list(s.scalars(select(t.Step).where(t.Step.session_id == row.id).order_by(t.Step.seq)))
        prompts = rebuild_prompt_ids({st.id: st for st in steps}, fetch=lambda i, sid: t.get_step(s, i, sid))
    return row, steps, prompts


def test_replay_rebuilds_inputs_and_links_every_step(start_proxy, fake_upstream, factory):
    proxy = start_proxy([fake_upstream.url])
    sid = agent_session(proxy, tool_results=("the notes say hi", "2 passed"))
    proxy.flush()
    original, steps, prompts = _session_steps(factory, sid, proxy.tenant)
    sent_originally = list(fake_upstream.requests)
    fake_upstream.weights = "w1"  # "new weights": same tool choices, different text
    result = replay_session(factory, sid, tenant=proxy.tenant, upstream=fake_upstream.url,
                            redactor=shared_redactor(b"test-secret"), secret=b"test-secret", policies=proxy.state.policies,
                            model_version="v7")
    replayed = fake_upstream.requests[len(sent_originally):]
    # The replay sent each step's full input, rebuilt from redacted contents and the parents' outputs.
    assert [render(r["messages"]) for r in replayed] == [render(r["messages"]) for r in sent_originally]
    assert all(r["tools"] == sent_originally[0]["tools"] for r in replayed)
    assert all(r["return_token_ids"] is True and "stream" not in r for r in replayed)

    copy, rsteps, rprompts = _session_steps(factory, result.session_id, proxy.tenant)
    assert copy.replay_of == original.id and copy.client == "atdp-replay" and copy.labels["model_version"] == "v7"
    assert [s.replay_of for s in rsteps] == [s.id for s in steps]
    assert [s.seq for s in rsteps] == [1, 2, 3]
    assert rsteps[1].parent_step_id == rsteps[0].id and rsteps[2].parent_step_id == rsteps[1].id
    assert [s.message_hashes for s in rsteps] == [s.message_hashes for s in steps]  # inputs by reference
    assert all(s.eligibility == "debug_only" and s.model_version == "v7" for s in rsteps)
    # Same prompts token for token; outputs differ as the weights do.
    assert [rprompts[s.id] for s in rsteps] == [prompts[s.id] for s in steps]
    assert rsteps[2].prompt_prefix_len > 0  # stored as a suffix like any step
    assert rsteps[2].output_versions == [["v7", len(rsteps[2].output_token_ids)]]
    assert [(r["original_tool_calls"], r["replay_tool_calls"]) for r in result.steps] == [
        (["read_file"], ["read_file"]), (["run_tests"], ["run_tests"]), ([], [])]
    assert result.steps[2]["original_text"] == "[w0] done" and result.steps[2]["replay_text"] == "[w1] done"
    with factory() as s:
        calls = s.scalars(select(t.ToolCall).where(t.ToolCall.step_id.in_([x.id for x in rsteps]))).all()
        audit = s.scalars(select(t.AuditEvent).where(t.AuditEvent.action == "replay", t.AuditEvent.target == sid)).all()
    assert sorted(c.name for c in calls) == ["read_file", "run_tests"]
    assert len(audit) == 1 and audit[0].details["replay_session"] == result.session_id


def test_replay_cli_and_upstream_failure_is_recorded(start_proxy, fake_upstream, factory, monkeypatch, db_url, tmp_path, capsys):
    proxy = start_proxy([fake_upstream.url])
    sid = agent_session(proxy, tool_results=())
    proxy.flush()
    monkeypatch.setenv("ATDP_DATABASE_URL", db_url)
    monkeypatch.setenv("ATDP_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ATDP_UPSTREAM_URL", fake_upstream.url)
    assert main(["replay", sid, "--tenant", proxy.tenant, "--model-version", "v2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("step 1: ok, same") and out[-1].startswith("replay-")
    # A dead upstream: each step is still recorded, as an error, so the comparison shows it.
    assert main(["replay", sid, "--tenant", proxy.tenant, "--upstream", "http://127.0.0.1:1"]) == 0
    dead = capsys.readouterr().out.strip().splitlines()
    _, steps, _ = _session_steps(factory, dead[-1], proxy.tenant)
    assert [s.status for s in steps] == ["error"] and steps[0].error["type"] == "upstream_unavailable"
    assert main(["replay", "no-such-session", "--tenant", proxy.tenant]) == 1


def test_output_units_per_api():
    chat = {"role": "assistant", "content": None, "refusal": None, "tool_calls": [{"id": "c1"}]}
    assert output_units("chat.completions", chat) == [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}]
    msg = {"type": "message", "role": "assistant", "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn"}
    assert output_units("messages", msg) == [{"role": "assistant", "content": [{"type": "text", "text": "hi"}]}]
    items = [{"type": "message", "role": "assistant"}, {"type": "function_call", "call_id": "c"}]
    assert output_units("responses", items) == items
    assert output_units("responses", {"object": "response", "output": items}) == items


@pytest.mark.vllm
def test_replay_against_real_vllm_reproduces_a_greedy_session(start_proxy, vllm_server, factory):
    # The rendered path: replay rebuilds each input from its messages and lets vLLM render it, so it
    # reproduces rendered prompts; a token-in-token-out step's prompt holds the parent's own output
    # ids, which a rendering of the same text need not give back (docs/limits.md).
    proxy = start_proxy([vllm_server.base_url], tito=False)
    c = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0, default_headers={"X-ATDP-Session-Id": "vllm-replay"})
    messages = [{"role": "system", "content": "You are terse."}]
    for turn in range(3):
        messages.append({"role": "user", "content": f"Question {turn}?"})
        r = c.chat.completions.create(model=vllm_server.model, messages=messages, temperature=0, max_tokens=8)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    proxy.flush()
    _, steps, prompts = _session_steps(factory, "vllm-replay", proxy.tenant)
    assert len(steps) == 3 and all(s.token_source == "engine" for s in steps)
    result = replay_session(factory, "vllm-replay", tenant=proxy.tenant, upstream=vllm_server.base_url,
                            redactor=shared_redactor(b"test-secret"), secret=b"test-secret", policies=proxy.state.policies,
                            model_version="base")
    _, rsteps, rprompts = _session_steps(factory, result.session_id, proxy.tenant)
    assert [s.status for s in rsteps] == ["ok"] * 3
    # vLLM renders the rebuilt inputs to exactly the prompt ids it rendered for the agent, and greedy
    # decoding gives the same tokens back.
    assert [rprompts[s.id] for s in rsteps] == [prompts[s.id] for s in steps]
    assert [s.output_token_ids for s in rsteps] == [s.output_token_ids for s in steps]
    assert all(r["original_text"] == r["replay_text"] for r in result.steps)
    assert [s.replay_of for s in rsteps] == [s.id for s in steps]


def test_replay_of_an_anthropic_messages_session(start_proxy, fake_upstream, factory):
    proxy = start_proxy([fake_upstream.url])
    sid = anthropic_session(proxy)
    proxy.flush()
    original, steps, prompts = _session_steps(factory, sid, proxy.tenant)
    assert [s.api for s in steps] == ["messages", "messages"] and steps[1].parent_step_id == steps[0].id
    sent_originally = list(fake_upstream.requests)
    result = replay_session(factory, sid, tenant=proxy.tenant, upstream=fake_upstream.url,
                            redactor=shared_redactor(b"test-secret"), secret=b"test-secret", policies=proxy.state.policies)
    replayed = fake_upstream.requests[len(sent_originally):]
    # Stored Anthropic messages (the parent's answer included) translate to the same chat request.
    assert [render(r["messages"]) for r in replayed] == [render(r["messages"]) for r in sent_originally[-2:]]
    assert replayed[0]["tools"] == sent_originally[-2]["tools"]
    _, rsteps, rprompts = _session_steps(factory, result.session_id, proxy.tenant)
    assert [rprompts[s.id] for s in rsteps] == [prompts[s.id] for s in steps]
    assert [r["replay_tool_calls"] for r in result.steps] == [["run_tests"], []]
    assert result.steps[1]["replay_text"] == "[w0] fixed it"
