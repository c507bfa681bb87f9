"""The bounded, compact in-memory maps the soak leans on: the continuation index (16-byte keys,
packed links, inputs kept for the retry window only), the writer's token cache (bounded by tokens
and age) and its compact cache keys. Pure, no database."""

from __future__ import annotations

import hashlib
import hmac
import random
import time
import tracemalloc
import uuid

from proxy.lru import LRU, content_key, id_key
from proxy.record.prepare import TokenCache
from proxy.sessions import ContinuationIndex, StepLink, prefix_hashes
from proxy.store.content import canonical, content_hash
from proxy.store.ids import new_id
from proxy.store.links import LinkRow


def hashes(*texts: str) -> list[str]:
    return prefix_hashes("acme", [t.encode() for t in texts])


def test_a_transcript_links_back_with_its_ids_intact_uuid_or_not():
    index = ContinuationIndex()
    uuid_link = StepLink(step_id=new_id(), session_id=new_id())
    client_link = StepLink(step_id=new_id(), session_id="claude code session: 42/ä")  # a client-chosen id
    a, b = hashes("sys", "hello", "answer"), hashes("sys", "other", "answer")
    index.add(a[-1], uuid_link)
    index.add(b[-1], client_link)
    found = index.find([*a, *hashes("next")[-1:]], None)
    assert found.parent == uuid_link and found.history_len == 3
    found = index.find([*b, "x" * 64], None)
    assert found.parent == client_link and found.history_len == 3
    # A named session only links to its own steps.
    assert index.find([*b, "x" * 64], "another session").parent is None


def test_retries_link_within_the_window_and_inputs_are_not_kept_beyond_it():
    index = ContinuationIndex(retry_window_s=0.3)
    link = StepLink(step_id=new_id(), session_id=new_id())
    h = hashes("sys", "hello")
    index.begin_input("body-1", link, None, 0)
    index.end_input("body-1", link, None, 0, delivered=True)
    sibling = StepLink(step_id="", session_id=link.session_id)
    assert index.find(h, None, "body-1", retry=True).parent == sibling  # the client says it retries
    assert index.find(h, None, "body-2", retry=True).parent is None  # same input, another request: a new run
    time.sleep(0.35)
    assert index.find(h, None, "body-1", retry=True).parent is None
    index.end_input("body-3", link, None, 0, delivered=True)  # trims what is past the window
    assert len(index._by_input) == 1


def test_the_index_is_bounded_by_count_and_forgets_steps():
    index = ContinuationIndex(max_entries=1_000)
    links = [StepLink(step_id=new_id(), session_id=new_id()) for _ in range(1_500)]
    keys = [hashes(str(i))[-1] for i in range(1_500)]
    for k, link in zip(keys, links, strict=True):
        index.add(k, link)
    assert len(index._by_transcript) == 1_000
    assert index.find([keys[0], "x"], None).parent is None  # the oldest went first
    assert index.find([keys[-1], "x"], None).parent == links[-1]
    parent = StepLink(step_id=new_id(), session_id=links[-1].session_id)
    index.begin_input("b", links[-2], parent, 2)
    index.end_input("b", links[-2], parent, 2, delivered=False)
    index.begin_input("c", links[-3], parent, 2)  # still running
    assert index.forget({links[-1].step_id, parent.step_id}) == 3
    assert index.find([keys[-1], "x"], None).parent is None
    assert index.find(hashes("in"), None, "b").parent is None
    assert index.find(hashes("in"), None, "c", retry=True).parent is None


def test_learned_rows_link_like_local_ones():
    index = ContinuationIndex()
    t, i = hashes("a", "b")[-1], hashes("c")[-1]
    sid, parent = new_id(), new_id()
    index.learn([LinkRow(t, "t", new_id(), sid), LinkRow(i, "i", new_id(), sid, parent, 3),
                  LinkRow("old", "i", new_id(), sid, parent, 3, age_s=3600.0)])
    assert index.find([t, "x"], None).parent.session_id == sid
    # An "i" row is a request's fingerprint, from another proxy that does not say whether it answered:
    # only the client's word makes a call with that fingerprint its retry, within the window.
    assert index.find(["y"], None, i).parent is None
    assert index.find(["y"], None, i, retry=True).parent == StepLink(step_id=parent, session_id=sid)
    assert index.find(["y"], None, i, retry=True).history_len == 3
    assert index.find(["y"], None, "old", retry=True).parent is None


def test_an_entry_costs_a_few_hundred_bytes():
    """The figure the settings' comments quote (about 230 bytes per continuation key)."""
    index = ContinuationIndex(max_entries=50_000)
    keys = [hashes(str(i))[-1] for i in range(20_000)]
    links = [StepLink(step_id=new_id(), session_id=new_id()) for _ in range(20_000)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for k, link in zip(keys, links, strict=True):
        index.add(k, link)
    per_entry = (tracemalloc.get_traced_memory()[0] - before) / 20_000
    tracemalloc.stop()
    assert per_entry < 300, per_entry


def test_token_cache_is_bounded_by_tokens_and_by_age():
    cache = TokenCache(max_tokens=1_000, max_age_s=0.3)
    a, b, c = new_id(), new_id(), "not-a-uuid"
    cache.put(a, list(range(600)))
    cache.put(b, list(range(300)))
    cache.put(c, list(range(300)))  # over 1,000 tokens: the oldest goes
    assert cache.get(a) is None and list(cache.get(b)) == list(range(300)) and cache.get(c) is not None
    cache.put(b, [1, 2, 3])  # rewritten: counted once
    assert cache._total == 303
    cache.drop(c)
    assert cache._total == 3
    time.sleep(0.35)
    assert cache.get(b) is None  # too old to be a parent worth a prefix
    cache.put(new_id(), [7])
    assert cache._total == 1


def test_id_keys_are_16_bytes_for_uuids_and_the_text_for_anything_else():
    uid = new_id()
    assert isinstance(id_key(uid), bytes) and len(id_key(uid)) == 16
    others = ["step-1", "", "0" * 32, uid.upper()]  # the last two parse as UUIDs but are not written as ours
    assert [id_key(v) for v in others] == others
    lru: LRU = LRU(10)
    for v in [uid, *others]:
        lru.put(id_key(v), v)
    assert [lru[id_key(v)] for v in [uid, *others]] == [uid, *others]



def _id_key_by_uuid(value: str) -> bytes | str:
    """The definition id_key implements without the uuid module: the canonical text of a UUID packs."""
    try:
        u = uuid.UUID(value)
    except ValueError:
        return value
    return u.bytes if str(u) == value else value


def test_id_key_agrees_with_the_uuid_module_on_every_spelling():
    rng = random.Random(5)
    cases = ["", "-" * 36, "{" + new_id() + "}", "urn:uuid:" + new_id(), new_id().replace("-", ""), "g" * 36]
    for _ in range(3000):
        u = str(uuid.UUID(int=rng.getrandbits(128)))
        pos = rng.randrange(36)
        cases += [u, u.upper(), u[:pos] + rng.choice("0aAfFgG-_ {}") + u[pos + 1:], u[:pos] + u[pos + 1:] + "0",
                  u.replace("-", "", 1) + "0", "\uff11" + u[1:], u[:-1] + "\u0661"]
    for v in cases:
        assert id_key(v) == _id_key_by_uuid(v), v


def test_content_hash_is_the_hmac_of_the_canonical_bytes():
    values = ["", "x" * 300, {"b": [1, 2.5, None], "a": "\u00e9"}, [{"role": "user", "content": "hi"}], 7]
    for v in values:
        assert content_hash(b"secret", v) == hmac.new(b"secret", canonical(v), hashlib.sha256).hexdigest()

def test_content_keys_separate_tenants():
    assert content_key("acme", "h" * 64) != content_key("other", "h" * 64)
    assert content_key("acme", "h" * 64) == content_key("acme", "h" * 64) and len(content_key("a", "b")) == 16
