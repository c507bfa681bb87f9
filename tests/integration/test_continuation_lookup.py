"""A lone proxy's continuation index is a cache over the stored steps (proxy.store.links, shared off).

A call whose parent the proxy's memory has let go of (evicted by `ATDP_CONTINUATION_ENTRIES`, or
never held: another process's step) is linked by one read of `steps.transcript_hash`; nothing is
written on the request path for it; a history the database does not know either costs one read,
not one per call.
"""

from __future__ import annotations

import openai
from sqlalchemy import func, select

from proxy.sessions import ContinuationIndex
from proxy.store import tables as t

HERMES = {"User-Agent": "HermesAgent/0.4 (python)"}  # sends no session id: linking is all it has


def chat(proxy, messages: list[dict]) -> tuple[str, str, str]:
    client = openai.OpenAI(base_url=proxy.v1, api_key="unused-in-open-mode", max_retries=0, default_headers=HERMES)
    raw = client.chat.completions.with_raw_response.create(model="fake", messages=messages)
    return raw.parse().choices[0].message.content, raw.headers["x-atdp-session-id"], raw.headers["x-atdp-step-id"]


def test_a_parent_memory_let_go_of_is_found_in_the_stored_steps(start_proxy, fake_upstream, factory):
    p = start_proxy([fake_upstream.url])
    links = p.state.links
    assert links is not None and not links.shared  # on by default, reading the steps
    msgs = [{"role": "system", "content": "You are a lone agent."}, {"role": "user", "content": "turn 0"}]
    ids = []
    for turn in range(2):
        text, session, step = chat(p, msgs)
        ids.append((session, step))
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": f"turn {turn + 1}"}]
    assert links.lookups == 0  # memory linked turn 1
    p.flush()
    p.state.index = ContinuationIndex()  # what eviction (or another process) leaves: nothing in memory
    text, session, step = chat(p, msgs)
    assert links.lookups == 1 and links.failures == 0
    assert session == ids[0][0]
    steps = p.steps(factory, session)
    assert [s.parent_step_id for s in steps] == [None, ids[0][1], ids[1][1]]
    assert [s.history_len for s in steps] == [0, 3, 5]
    # The read taught the memory: the next turn costs none, and nothing was published for any of it.
    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "turn 3"}]
    assert chat(p, msgs)[1] == session
    assert links.lookups == 1
    with factory() as s:
        assert s.scalar(select(func.count()).select_from(t.ContinuationLink)
                        .where(t.ContinuationLink.session_id == session)) == 0


def test_a_history_the_database_does_not_know_is_read_once(start_proxy, fake_upstream):
    p = start_proxy([fake_upstream.url])
    links = p.state.links
    assert links is not None
    edited = [{"role": "system", "content": "You compact your history."}, {"role": "user", "content": "start"},
              {"role": "assistant", "content": "a summary no engine wrote"}]
    sessions = {chat(p, [*edited, {"role": "user", "content": f"next {i}"}])[1] for i in range(3)}
    assert links.lookups == 1  # the later calls' unknown prefix is remembered as unknown
    assert len(sessions) == 3  # nothing to link them by: three sessions, as before


def test_the_tenant_scopes_the_read(start_proxy, fake_upstream):
    """Another tenant's transcript is never found by the read: its keys are seeded by the tenant
    (the query also names the tenant, which this cannot tell apart from the seeding)."""
    a = start_proxy([fake_upstream.url])
    b = start_proxy([fake_upstream.url])
    msgs = [{"role": "system", "content": "shared prompt"}, {"role": "user", "content": "hello"}]
    text, session_a, _ = chat(a, msgs)
    a.flush()
    _, session_b, _ = chat(b, [*msgs, {"role": "assistant", "content": text}, {"role": "user", "content": "more"}])
    assert b.state.links is not None and b.state.links.lookups == 1
    assert session_b != session_a
