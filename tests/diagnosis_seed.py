"""Seed a store for the diagnosis the way agents fill it: the official `anthropic` SDK through the real
proxy (scripted upstream: `#tool NAME {json}` makes the model call a tool), tool results sent back
with `is_error`, and rewards / corrections through the real feedback API."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import anthropic
import httpx

from proxy.auth import create_key
from proxy.store.db import transaction

# Declared tool schemas: `deploy` requires `env` from an enum, so a call without it breaks the schema.
SCHEMAS = {
    "deploy": {"type": "object", "properties": {"env": {"type": "string", "enum": ["staging", "prod"]},
                                                "ref": {"type": "string"}}, "required": ["env"]},
    "read_file": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    "run_tests": {"type": "object", "properties": {"pattern": {"type": "string"}}},
    "search": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
}
TOOLS = [{"name": name, "description": f"the {name} tool", "input_schema": schema} for name, schema in SCHEMAS.items()]


@dataclass
class Use:
    tool: str
    arguments: str  # the JSON the scripted model emits
    result: str
    is_error: bool = False


def tenant_key(factory, tenant: str) -> str:
    with transaction(factory) as s:
        _, key = create_key(s, tenant)
    return key


def tool_session(proxy, uses: list[Use], *, task: str, key: str = "unused", sid: str | None = None) -> str:
    """One session: per use, a model call that calls the tool and the tool's result sent back (marked as
    an error or not), then a final answer. Returns the session's public id."""
    sid = sid or f"d-{uuid.uuid4().hex[:10]}"
    c = anthropic.Anthropic(base_url=proxy.url, api_key=key, max_retries=0,
                            default_headers={"X-ATDP-Session-Id": sid, "X-ATDP-Task-Id": task})
    messages: list[dict] = [{"role": "user", "content": f"#tool {uses[0].tool} {uses[0].arguments}"}]
    for i, use in enumerate(uses):
        r = c.messages.create(model="fake", max_tokens=256, system="You are an ops agent.", tools=TOOLS,
                              messages=messages)
        (call,) = [b for b in r.content if b.type == "tool_use"]
        nxt = f"#tool {uses[i + 1].tool} {uses[i + 1].arguments}" if i + 1 < len(uses) else "#say done"
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": use.result,
                                                   "is_error": use.is_error}, {"type": "text", "text": nxt}]}]
    c.messages.create(model="fake", max_tokens=256, system="You are an ops agent.", tools=TOOLS, messages=messages)
    return sid


def chat_session(proxy, text: str, *, task: str, key: str = "unused", system: str = "") -> str:
    """One plain call (no tools); the scripted model answers `text`."""
    sid = f"c-{uuid.uuid4().hex[:10]}"
    c = anthropic.Anthropic(base_url=proxy.url, api_key=key, max_retries=0,
                            default_headers={"X-ATDP-Session-Id": sid, "X-ATDP-Task-Id": task})
    c.messages.create(model="fake", max_tokens=64, messages=[{"role": "user", "content": f"#say {text}"}],
                      **({"system": system} if system else {}))
    return sid


def feedback(proxy, sid: str, *, key: str | None = None, **body) -> dict:
    """Post feedback through the real API (after the writer stored the session)."""
    proxy.flush()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(f"{proxy.url}/atdp/v1/sessions/{sid}/feedback", json=body, headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


# --- the three scenarios of issue 14 (each returns the session ids it made) ----------------------------

def seed_harness(proxy, *, other_key: str, n: int = 6) -> list[str]:
    """Failures concentrated on one tool: `deploy` fails in every session (paths vary, one signature) and
    its calls omit the required `env`; `read_file` always works. Two tenants, two tasks."""
    sids = []
    for k in range(n):
        uses = [Use("read_file", f'{{"path": "notes-{k}.txt"}}', f"release notes {k}"),
                Use("deploy", f'{{"ref": "v1.{k}"}}', f"Permission denied: /srv/app-{k}/release.tar", is_error=True)]
        key = other_key if k % 2 else "unused"
        sid = tool_session(proxy, uses, task=f"ship-{k % 2}", key=key)
        feedback(proxy, sid, key=None if key == "unused" else key, reward=0.0)
        sids.append(sid)
    return sids


FACTS = ["The Berlin office is at 12 Hauptstrasse", "Our VPN port is 8443", "The invoice currency is EUR",
         "The staging database is called orders_stage", "Support hours are 8 to 18 CET",
         "The build server runs on build-7.internal"]


def seed_memory(proxy, n: int = 6) -> list[str]:
    """Corrections that supply facts the agent could not know, on plain chat sessions without tools."""
    sids = []
    for k in range(n):
        sid = chat_session(proxy, f"answer {k}", task="helpdesk")
        feedback(proxy, sid, reward=-0.5, source="user_correction", correction=FACTS[k % len(FACTS)])
        sids.append(sid)
    return sids


SPREAD = [("read_file", '{"path": "a.txt"}', "No such file: /repo/a.txt"),
          ("run_tests", '{"pattern": "unit"}', "3 tests failed in tests/unit"),
          ("search", '{"query": "owner"}', "Timeout after 30 s")]


def seed_policy(proxy, *, other_key: str, n: int = 12) -> list[str]:
    """Failures spread over tenants, tasks and tools: every session makes two calls of two different
    tools; one fails, the other works, the failing tool rotates (no tool holds half the failures)."""
    sids = []
    for k in range(n):
        bad, good = SPREAD[k % 3], SPREAD[(k + 1) % 3]
        uses = [Use(bad[0], bad[1], bad[2], is_error=True), Use(good[0], good[1], "ok")]
        key = other_key if k % 2 else "unused"
        sid = tool_session(proxy, uses, task=f"task-{(k // 2) % 2}", key=key)
        feedback(proxy, sid, key=None if key == "unused" else key, reward=-1.0)
        sids.append(sid)
    return sids
