"""Real agents are trainable by default (#13, item 2), measured the test suite's way.

Each client's captured traffic goes through the real proxy to the real vLLM tiny model, with no
ATDP_TOKENIZER (the proxy finds the served model's tokenizer itself), through the client's own
door and official SDK: Claude Code (`/v1/messages`, Anthropic SDK, streamed), Codex CLI
(`/v1/responses`, OpenAI SDK, streamed) and Hermes (`/v1/chat/completions`, OpenAI SDK). The
requests are the captured ones (`tests/data/*_request.json`: the turns of a tool round trip) with
each client's real system prompt and tool schemas (`bench/corpus/clients/`), followed by further
tool rounds whose outputs are code-like tool output (`tests/redaction_corpus.lookalikes`: git
logs, tracebacks, listings, JSON, with dates, versions, hashes, ports), the last one a `git log`
with an author's e-mail address (redacted: that step keeps cleaned token ids). What is not the capture's:
the model name, `max_tokens` (the tiny model answers 16 tokens), and Claude Code's and Hermes' tool
lists cut to their smallest schemas (the whole lists are 64 KB and 40 KB; the tiny model serves a
40k-token context on the CPU).

Counted per client: the share of steps that are `eligible` and keep the engine's output token ids
(token source `engine`, or `rederived` when redaction cleaned the prompt). Goal >= 95%.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from sqlalchemy import select

from proxy.store import tables as t
from tests.redaction_corpus import client_operator_content, lookalikes
from tests.vllm_fixtures import SERVED_NAME

DATA = Path(__file__).resolve().parents[1] / "data"
ROUNDS = 4  # tool rounds after the captured turns
MAX_TOKENS = 16


# Real tool output carries personal data too: `git log` shows authors' e-mail addresses. Redaction
# cleans it, and the step keeps exact token ids of the cleaned text (found tokenizer), still trainable.
GIT_LOG_WITH_EMAIL = ("commit 3f9c2a1e7b4d\nAuthor: Maria Gonzalez <maria.gonzalez@fastmail.com>\n"
                      "Date:   Mon Nov 24 10:12:03 2025 +0100\n\n    store: batch the tool-call links\n")


def _tool_outputs(seed: int) -> list[str]:
    return [*[text[:1200] for _, text in lookalikes(seed, kb=8)][: ROUNDS - 1], GIT_LOG_WITH_EMAIL]


def _smallest(tools: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    return sorted(tools, key=lambda x: len(json.dumps(x)))[:n]


def claude_code_turns() -> list[dict[str, Any]]:
    base = json.loads((DATA / "claude_code_request.json").read_text())
    real = client_operator_content()["claude-code"]
    base.update(model=SERVED_NAME, max_tokens=MAX_TOKENS, system=real["system"]["system"],
                tools=[*base["tools"], *_smallest(real["tools"], 6)])
    base.pop("thinking", None)  # a thinking budget larger than max_tokens is refused by Anthropic's API too
    messages = base["messages"]
    ends = [i + 1 for i, m in enumerate(messages) if m["role"] == "user"]
    turns = [{**copy.deepcopy(base), "messages": messages[:end]} for end in ends]
    history = copy.deepcopy(messages)
    for k, output in enumerate(_tool_outputs(11)):
        history += [{"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_r{k}", "name": "Bash",
                                                       "input": {"command": "git log -5", "description": "Recent"}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_r{k}", "content": output}]}]
        turns.append({**copy.deepcopy(base), "messages": copy.deepcopy(history)})
    return turns


def codex_turns() -> list[dict[str, Any]]:
    base = json.loads((DATA / "codex_request.json").read_text())
    real = client_operator_content()["codex"]
    items = [*real["system"]["developer"], *base["input"][1:]]
    base.update(model=SERVED_NAME, max_output_tokens=MAX_TOKENS, tools=[*base["tools"], *_smallest(real["tools"], 4)])
    ends = [i + 1 for i, it in enumerate(items)
            if it.get("role") == "user" and (i + 1 == len(items) or items[i + 1].get("role") != "user")]
    ends.append(len(items))
    turns = [{**copy.deepcopy(base), "input": items[:end]} for end in dict.fromkeys(ends)]
    history = copy.deepcopy(items)
    for k, output in enumerate(_tool_outputs(12)):
        history += [{"type": "function_call", "call_id": f"call_r{k}", "name": "shell_command",
                     "arguments": json.dumps({"command": "git log -5"})},
                    {"type": "function_call_output", "call_id": f"call_r{k}", "output": output}]
        turns.append({**copy.deepcopy(base), "input": copy.deepcopy(history)})
    return turns


def hermes_turns() -> list[dict[str, Any]]:
    real = client_operator_content()["hermes"]
    base = {"model": SERVED_NAME, "max_tokens": MAX_TOKENS, "tools": _smallest(real["tools"], 8)}
    history = [*real["system"], {"role": "user", "content": "List the files, then read NOTES.md"}]
    turns = [{**base, "messages": copy.deepcopy(history)}]
    for k, output in enumerate(_tool_outputs(13)):
        history += [{"role": "assistant", "content": None, "tool_calls": [
                        {"id": f"call_r{k}", "type": "function",
                         "function": {"name": "terminal", "arguments": json.dumps({"command": "git log -5"})}}]},
                    {"role": "tool", "tool_call_id": f"call_r{k}", "content": output}]
        turns.append({**base, "messages": copy.deepcopy(history)})
    return turns


def _send(client: str, proxy, body: dict[str, Any]) -> str:
    """One turn through the client's SDK; returns the step id the proxy answered with."""
    if client == "claude-code":
        sdk = anthropic.Anthropic(base_url=proxy.url, api_key="unused", max_retries=0, timeout=600,
                                  default_headers={"user-agent": "claude-cli/2.1.197 (external, sdk-cli)"})
        known = {"max_tokens", "messages", "model", "metadata", "output_config", "system", "thinking", "tools"}
        extra = {k: body.pop(k) for k in list(body) if k not in known}  # temperature, context_management
        raw = sdk.messages.with_raw_response.create(**{**body, "stream": True}, extra_body=extra)
        for _ in raw.parse():
            pass
        return raw.headers["x-atdp-step-id"]
    sdk = openai.OpenAI(base_url=proxy.v1, api_key="unused", max_retries=0, timeout=600)
    if client == "codex":
        extra = {k: body.pop(k) for k in ("client_metadata", "prompt_cache_key") if k in body}
        raw = sdk.responses.with_raw_response.create(**{**body, "stream": True}, extra_body=extra,
                                                      extra_headers={"originator": "codex_cli_rs"})
        for _ in raw.parse():
            pass
        return raw.headers["x-atdp-step-id"]
    raw = sdk.chat.completions.with_raw_response.create(**body, extra_headers={"x-atdp-session-id": "hermes-run"})
    raw.parse()
    return raw.headers["x-atdp-step-id"]


@pytest.mark.vllm
def test_each_real_clients_steps_are_trainable_by_default(start_proxy, vllm_server, factory, capsys):
    proxy = start_proxy([vllm_server.base_url], tokenizer=None)  # no ATDP_TOKENIZER: found from /v1/models
    assert proxy.versions.ready.wait(120)
    turns = {"claude-code": claude_code_turns(), "codex": codex_turns(), "hermes": hermes_turns()}
    sent = {client: [_send(client, proxy, body) for body in bodies] for client, bodies in turns.items()}
    proxy.flush(120)
    figures = {}
    with factory() as s:
        for client, ids in sent.items():
            rows = s.scalars(select(t.Step).where(t.Step.id.in_(ids))).all()
            assert len(rows) == len(ids)
            good = [r for r in rows if r.eligibility == "eligible" and r.token_source in ("engine", "rederived")
                    and len(r.output_token_ids) > 0]
            figures[client] = {"steps": len(rows), "trainable_with_engine_ids": len(good),
                               "share": len(good) / len(rows),
                               "token_sources": sorted({r.token_source for r in rows}),
                               "redacted_steps": sum(1 for r in rows if r.redaction),
                               "not_trainable": [(r.eligibility, r.eligibility_reason) for r in rows if r not in good],
                               "prompt_tokens_max": max(r.prompt_tokens for r in rows)}
    with capsys.disabled():
        print("\nclient trainability:", json.dumps(figures, indent=1))
    for client, f in figures.items():
        assert f["steps"] >= 5, (client, f)
        assert f["share"] >= 0.95, (client, f)
        assert f["redacted_steps"] >= 1 and "rederived" in f["token_sources"], (client, f)  # the e-mail
