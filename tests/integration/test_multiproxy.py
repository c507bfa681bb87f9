"""Several proxies on one database: continuation linking holds across them (issue 17, item 1).

Two `atdp serve` apps share only PostgreSQL, and a client's turns alternate between them (round
robin, as a load balancer would). A client that sends no session id (Hermes-shaped chat) and a
Responses `previous_response_id` chain each end as one session per conversation with the right
parent steps, including when the next turn reaches the other proxy before the first proxy's writer
has stored the previous step.
"""

from __future__ import annotations

import itertools
import time
import uuid

import openai
import pytest
from sqlalchemy import func, select

from proxy.store import tables as t

HERMES = {"User-Agent": "HermesAgent/0.4 (python)"}


def sdk(proxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.v1, api_key="unused-in-open-mode", max_retries=0, default_headers=HERMES)


def sessions_of(factory, tenant: str) -> dict[str, list[t.Step]]:
    with factory() as s:
        rows = s.execute(select(t.Session.external_id, t.Step).join(t.Step, t.Step.session_id == t.Session.id)
                         .where(t.Session.tenant_id == tenant).order_by(t.Step.started_at)).all()
    out: dict[str, list[t.Step]] = {}
    for ext, step in rows:
        out.setdefault(ext, []).append(step)
    return out


def stored_steps(factory, tenant: str) -> int:
    with factory() as s:
        return s.scalar(select(func.count()).select_from(t.Step).where(t.Step.tenant_id == tenant))


def two_proxies(start_proxy, fake_upstream, **overrides):
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    return [start_proxy([fake_upstream.url], tenant=tenant, shared_links=True, **overrides) for _ in range(2)]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_without_ids_alternating_proxies_is_one_session_per_conversation(start_proxy, fake_upstream, factory,
                                                                              stream):
    # The writers hold steps for 3 s: every next turn reaches the other proxy before its parent is stored.
    proxies = two_proxies(start_proxy, fake_upstream, flush_interval_s=3.0)
    clients = [sdk(p) for p in proxies]
    rr = itertools.cycle(range(2))
    convs = {name: [{"role": "system", "content": f"You are agent {name}."}] for name in ("a", "b", "c")}
    step_ids: dict[str, list[str]] = {name: [] for name in convs}
    served_by: dict[str, list[int]] = {name: [] for name in convs}
    for turn in range(5):
        for name, messages in convs.items():  # interleaved conversations, turns alternating proxies
            messages.append({"role": "user", "content": f"{name} turn {turn}"})
            i = next(rr)
            if stream:
                with clients[i].chat.completions.with_streaming_response.create(
                        model="fake", messages=messages, stream=True) as raw:
                    text = "".join((c.choices[0].delta.content or "") for c in raw.parse() if c.choices)
                    sid = raw.headers["x-atdp-step-id"]
            else:
                raw = clients[i].chat.completions.with_raw_response.create(model="fake", messages=messages)
                text, sid = raw.parse().choices[0].message.content, raw.headers["x-atdp-step-id"]
            messages.append({"role": "assistant", "content": text})
            step_ids[name].append(sid)
            served_by[name].append(i)
        if turn == 0:
            assert stored_steps(factory, proxies[0].tenant) == 0  # the race: nothing is in the store yet
    assert all(set(v) == {0, 1} for v in served_by.values())
    for p in proxies:
        p.flush()
    sessions = sessions_of(factory, proxies[0].tenant)
    assert len(sessions) == 3
    by_first = {steps[0].id: steps for steps in sessions.values()}
    for ids in step_ids.values():
        steps = by_first[ids[0]]
        assert [s.id for s in steps] == ids
        assert [s.parent_step_id for s in steps] == [None, *ids[:-1]]
        assert [s.history_len for s in steps] == [0, 3, 5, 7, 9]  # the parent's input + output


def test_retry_on_the_other_proxy_is_a_sibling(start_proxy, fake_upstream, factory):
    """The same input again (a client's retry) reaching the other proxy joins the same session as a
    sibling (same parent), as on one proxy."""
    a, b = two_proxies(start_proxy, fake_upstream, flush_interval_s=3.0)
    msgs = [{"role": "system", "content": "retry agent"}, {"role": "user", "content": "hello"}]
    first = sdk(a).chat.completions.with_raw_response.create(model="fake", messages=msgs)
    msgs2 = [*msgs, {"role": "assistant", "content": first.parse().choices[0].message.content},
             {"role": "user", "content": "again"}]
    second = sdk(b).chat.completions.with_raw_response.create(model="fake", messages=msgs2)
    retry = sdk(a).chat.completions.with_raw_response.create(model="fake", messages=msgs2)
    a.flush()
    b.flush()
    (steps,) = sessions_of(factory, a.tenant).values()
    by_id = {s.id: s for s in steps}
    parent = first.headers["x-atdp-step-id"]
    assert by_id[second.headers["x-atdp-step-id"]].parent_step_id == parent
    assert by_id[retry.headers["x-atdp-step-id"]].parent_step_id == parent


def test_an_sdk_retry_on_the_other_proxy_joins_the_failed_attempt(start_proxy, fake_upstream, factory):
    """A first attempt fails on one proxy; the SDK's retry (`x-stainless-retry-count: 1`) reaches the
    other, whose memory never saw the request: one read of the shared keys finds the failed attempt's
    session. The same request again without the signal, its attempt answered, is a new run."""
    a, b = two_proxies(start_proxy, fake_upstream)
    msgs = [{"role": "system", "content": "retrying agent"}, {"role": "user", "content": "hi"}]
    fake_upstream.script = [{"status": 500}]
    with pytest.raises(openai.APIStatusError) as failed:
        sdk(a).chat.completions.create(model="fake", messages=msgs)
    session = failed.value.response.headers["x-atdp-session-id"]
    deadline = time.monotonic() + 5.0
    while not _published(factory, session):  # the failed call's keys are committed without waiting
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert b.state.links is not None
    retry = sdk(b).chat.completions.with_raw_response.create(model="fake", messages=msgs,
                                                              extra_headers={"x-stainless-retry-count": "1"})
    assert retry.headers["x-atdp-session-id"] == session and b.state.links.lookups == 1
    again = sdk(b).chat.completions.with_raw_response.create(model="fake", messages=msgs)
    assert again.headers["x-atdp-session-id"] != session
    a.flush()
    b.flush()
    steps = sessions_of(factory, a.tenant)[session]
    assert [(s.status, s.parent_step_id) for s in steps] == [("error", None), ("ok", None)]


def _published(factory, session: str) -> bool:
    with factory() as s:
        return bool(s.scalar(select(func.count()).select_from(t.ContinuationLink)
                             .where(t.ContinuationLink.session_id == session, t.ContinuationLink.kind == "i")))


@pytest.mark.parametrize("stream", [False, True])
def test_responses_chain_across_proxies(start_proxy, fake_upstream, factory, stream):
    """`previous_response_id` served by the other proxy: its sealed conversation is read from the
    shared store (waiting for the other proxy's writer when it is not there yet)."""
    proxies = two_proxies(start_proxy, fake_upstream, flush_interval_s=0.5)
    clients = [sdk(p) for p in proxies]
    previous, step_ids = None, []
    for turn in range(4):
        kw = {"previous_response_id": previous} if previous else {"instructions": "You answer briefly."}
        client = clients[turn % 2]
        if stream:
            with client.responses.with_streaming_response.create(model="fake", input=f"turn {turn}", stream=True,
                                                                 **kw) as raw:
                events = list(raw.parse())
                previous = next(e.response.id for e in events if e.type == "response.completed")
                step_ids.append(raw.headers["x-atdp-step-id"])
        else:
            raw = client.responses.with_raw_response.create(model="fake", input=f"turn {turn}", **kw)
            previous = raw.parse().id
            step_ids.append(raw.headers["x-atdp-step-id"])
    for p in proxies:
        p.flush()
    (steps,) = sessions_of(factory, proxies[0].tenant).values()
    assert [s.id for s in steps] == step_ids
    assert [s.parent_step_id for s in steps] == [None, *step_ids[:-1]]
    # The last turn's upstream prompt carried the whole conversation, every turn's input included.
    prompt = fake_upstream.requests[-1]["messages"]
    assert [m["content"] for m in prompt if m["role"] == "user"] == [f"turn {k}" for k in range(4)]


def test_unknown_previous_response_waits_then_404(start_proxy, fake_upstream):
    a, _ = two_proxies(start_proxy, fake_upstream, response_wait_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(openai.NotFoundError):
        sdk(a).responses.create(model="fake", input="x", previous_response_id="resp_" + uuid.uuid4().hex)
    assert 0.3 <= time.monotonic() - t0 < 3.0


def test_database_gone_costs_a_bounded_wait_and_links_locally(start_proxy, fake_upstream, factory):
    """Publishing and lookups that fail leave the call answered and linked from the proxy's memory."""
    (a,) = [start_proxy([fake_upstream.url], shared_links=True)]
    assert a.state.links is not None
    a.state.links.url = "postgresql://postgres@127.0.0.1:1/none"  # a port nothing listens on
    client = sdk(a)
    msgs = [{"role": "system", "content": "offline"}, {"role": "user", "content": "one"}]
    r1 = client.chat.completions.with_raw_response.create(model="fake", messages=msgs)
    msgs += [{"role": "assistant", "content": r1.parse().choices[0].message.content}, {"role": "user", "content": "two"}]
    t0 = time.monotonic()
    r2 = client.chat.completions.with_raw_response.create(model="fake", messages=msgs)
    assert time.monotonic() - t0 < 3 * a.state.settings.shared_timeout_s + 1.0
    assert r2.headers["x-atdp-session-id"] == r1.headers["x-atdp-session-id"]
    assert a.state.links.failures >= 1
    a.flush()
    steps = a.steps(factory, r1.headers["x-atdp-session-id"])
    assert [s.parent_step_id for s in steps] == [None, r1.headers["x-atdp-step-id"]]


def test_identical_calls_at_once_publish_without_conflict(start_proxy, fake_upstream, factory):
    """Parallel samples of one input finish together: their keys share one group commit, which must
    hold each key once (an upsert cannot touch a row twice); none of them is lost."""
    from concurrent.futures import ThreadPoolExecutor

    a, b = two_proxies(start_proxy, fake_upstream)
    msgs = [{"role": "system", "content": "parallel"}, {"role": "user", "content": "same input"}]
    with ThreadPoolExecutor(16) as ex:
        raws = list(ex.map(lambda _: sdk(a).chat.completions.with_raw_response.create(model="fake", messages=msgs),
                           range(16)))
    assert a.state.links is not None and a.state.links.failures == 0
    sessions = {r.headers["x-atdp-session-id"] for r in raws}
    # Their next turn on the other proxy joins one of their sessions.
    msgs2 = [*msgs, {"role": "assistant", "content": raws[0].parse().choices[0].message.content},
             {"role": "user", "content": "next"}]
    again = sdk(b).chat.completions.with_raw_response.create(model="fake", messages=msgs2)
    assert again.headers["x-atdp-session-id"] in sessions


def test_a_call_memory_links_costs_no_read(start_proxy, fake_upstream):
    """The database is read only when this proxy's memory does not know a call's parent and the
    history holds a model output: a first call, its next turns on the same proxy and the same input
    again never read."""
    (a,) = [start_proxy([fake_upstream.url], shared_links=True)]
    assert a.state.links is not None
    client = sdk(a)
    msgs = [{"role": "system", "content": "local"}, {"role": "user", "content": "t0"}]
    for turn in range(4):
        text = client.chat.completions.create(model="fake", messages=msgs).choices[0].message.content
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": f"t{turn + 1}"}]
    assert a.state.links.lookups == 0
    for _ in range(3):  # the same first input again: new runs (no retry signal), nothing to read
        client.chat.completions.create(model="fake", messages=msgs[:2])
    assert a.state.links.lookups == 0
    # A history this proxy never saw (another proxy's conversation, or the client's own): one read.
    client.chat.completions.create(model="fake", messages=[*msgs[:2], {"role": "assistant", "content": "elsewhere"},
                                                           {"role": "user", "content": "go on"}])
    assert a.state.links.lookups == 1
