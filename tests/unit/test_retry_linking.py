"""Telling a retry from a new run (issue 43), pure: the index's rules, the client's retry signal,
and what seeds a call's keys. The end-to-end cases, with the SDKs and PostgreSQL, are in
tests/integration/test_session_linking.py."""

from __future__ import annotations

from proxy.sessions import (
    ContinuationIndex,
    SessionRef,
    StepLink,
    body_hash,
    link_seed,
    prefix_hashes,
    resolve,
    retry_signal,
)
from proxy.store.ids import new_id

BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'


def _first_call(index: ContinuationIndex, fingerprint: str) -> StepLink:
    link = StepLink(step_id=new_id(), session_id=new_id())
    index.begin_input(fingerprint, link, None, 0)
    return link


def _session(index: ContinuationIndex, fingerprint: str, retry: bool, named: str | None = None) -> SessionRef:
    headers = {"x-atdp-session-id": named} if named else {}
    ref, _ = resolve(tenant="acme", headers=headers, path_session=None, body={}, hashes=["h"], index=index,
                     fingerprint=fingerprint, retry=retry)
    return ref


def test_an_answered_request_again_is_a_new_run_unless_the_client_says_retry():
    index = ContinuationIndex()
    link = _first_call(index, "fp")
    index.end_input("fp", link, None, 0, delivered=True)
    assert _session(index, "fp", retry=False).source == "new"
    ref = _session(index, "fp", retry=True)
    assert (ref.source, ref.external_id) == ("continuation", link.session_id)


def test_a_request_that_delivered_nothing_is_retried_by_the_same_body_alone():
    index = ContinuationIndex(retry_window_s=30.0)
    link = _first_call(index, "fp")
    index.end_input("fp", link, None, 0, delivered=False)  # an error, or a stream the client cut off
    assert _session(index, "fp", retry=False).external_id == link.session_id
    assert _session(index, "other body", retry=False).source == "new"


def test_a_running_request_joins_only_a_signalled_retry_whatever_its_age():
    index = ContinuationIndex(retry_window_s=0.0)  # a call running longer than the window
    link = _first_call(index, "fp")
    assert _session(index, "fp", retry=False).source == "new"  # a parallel run, unnamed: its own
    assert _session(index, "fp", retry=True).external_id == link.session_id


def test_a_retry_of_a_later_turn_gets_the_parent_of_the_request_it_repeats():
    index = ContinuationIndex()
    parent = StepLink(step_id=new_id(), session_id=new_id())
    first = StepLink(step_id=new_id(), session_id=parent.session_id)
    index.begin_input("fp", first, parent, 3)
    found = index.find(["a", "b"], None, "fp", retry=True)
    assert (found.parent, found.history_len) == (parent, 3)
    # A named session only links to its own steps.
    assert index.find(["a", "b"], "another", "fp", retry=True).parent is None


def test_the_latest_running_request_is_the_one_kept_and_ending_another_keeps_it():
    index = ContinuationIndex()
    a, b = _first_call(index, "fp"), _first_call(index, "fp")
    index.end_input("fp", a, None, 0, delivered=True)  # a ends; b still runs
    assert index.find(["h"], None, "fp", retry=True).parent == StepLink("", b.session_id)
    index.end_input("fp", b, None, 0, delivered=True)
    assert index.sizes()["running_inputs"] == 0


def test_the_retry_signal():
    assert not retry_signal({})
    assert not retry_signal({"x-stainless-retry-count": "0"})  # an SDK's first attempt
    assert retry_signal({"x-stainless-retry-count": "1"})
    assert not retry_signal({"x-stainless-retry-count": "-1"})
    assert not retry_signal({"x-stainless-retry-count": "many"})
    assert retry_signal({"idempotency-key": "req-1"})


def test_keys_end_users_and_idempotency_keys_seed_the_fingerprint():
    seed = link_seed("acme", "key-1", {})
    assert body_hash(seed, BODY) == body_hash(link_seed("acme", "key-1", {}), BODY)
    others = [link_seed("acme", "key-2", {}), link_seed("acme", "key-1", {"user": "u1"}),
              link_seed("acme", "key-1", {"metadata": {"user_id": "u2"}}), link_seed("other", "key-1", {})]
    assert len({seed, *others}) == 5
    assert body_hash(seed, BODY, "req-1") != body_hash(seed, BODY, "req-2") != body_hash(seed, BODY)
    # ... and the continuation keys: another key's or end user's identical transcript is not a parent.
    keys = [b"sys", b"hi", b"answer"]
    assert len({prefix_hashes(s, keys)[-1] for s in [seed, *others]}) == 5
