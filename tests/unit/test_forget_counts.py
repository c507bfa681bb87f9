"""The forget count the writer's cache reflects (proxy.record.prepare.Preparer, proxy.store.forgets):
it moves on only over forgets whose deletions the cache has let go of, with no gap, so a batch
prepared from a cache that missed one is checked when it is written."""

from __future__ import annotations

import orjson

from proxy.control.admin import _merged
from proxy.governance.forget import Forgotten, announcement
from proxy.governance.policy import TenantPolicy
from proxy.lru import content_key
from proxy.record.prepare import Preparer


class _NoRedaction:
    def redact_many(self, items, *, with_values=False, operator=None):
        return [(v, {}) for _, v in items]


def _preparer() -> Preparer:
    return Preparer(secret=b"s", redactor=_NoRedaction(), policy_for=lambda s, tenant: TenantPolicy(),
                    database=lambda: None)


def test_unknown_until_the_counts_are_read_then_what_was_read():
    p = _preparer()
    assert p.seen(["a", "b"]) == {"a": None, "b": None}  # a write checks every reference
    p.catch_up({"a": 3})
    assert p.seen(["a", "b"]) == {"a": 3, "b": 0}  # a tenant without a row has had no forget


def test_counts_move_on_only_without_a_gap():
    p = _preparer()
    p.catch_up({"a": 3})
    p.forget("a", content_hashes=[], forgets=[5])  # 4's note has not come: 4 may have deleted what is cached
    assert p.seen(["a"]) == {"a": 3}
    p.forget("a", content_hashes=[], forgets=[4])
    assert p.seen(["a"]) == {"a": 5}
    p.forget("a", content_hashes=[], forgets=[2, 5])  # old or repeated: nothing changes
    assert p.seen(["a"]) == {"a": 5}


def test_a_forget_applied_before_the_counts_were_read_is_not_lost():
    """A note that came between the read of the counts and the catch-up (a forget committed just
    after the read) still moves the count: otherwise every later batch would be checked for ever."""
    p = _preparer()
    p.forget("a", content_hashes=[], forgets=[4])  # counts unknown yet: kept aside
    p.catch_up({"a": 3})
    assert p.seen(["a"]) == {"a": 4}


def test_catching_up_forgets_every_stored_content_and_keeps_the_counts_it_read():
    p = _preparer()
    p.catch_up({"a": 1})
    p._known.put(content_key("a", "h1"), ())
    p.catch_up(None)  # the listener reconnected: notes may have been missed
    assert len(p._known) == 0 and p.seen(["a"]) == {"a": None}


def test_the_count_travels_last_and_is_merged_per_tenant():
    out = Forgotten(tenant="a", step_ids=["s1"], content_hashes=[f"{i:064d}" for i in range(200)], forgets=7)
    notes = [orjson.loads(n) for n in announcement(out)]
    assert len(notes) > 1 and [n.get("forgets") for n in notes] == [None] * (len(notes) - 1) + [7]
    assert notes[-1]["contents"] == []
    other = orjson.loads(announcement(Forgotten(tenant="a", content_hashes=["x"], forgets=8))[-1])
    merged = _merged([*notes, other, {"op": "forget", "tenant": "a", "forgets": "9"}])  # not a count: ignored
    whole, sessions, steps, contents, forgets = merged["a"]
    assert forgets == {7, 8} and len(contents) == 200 and steps == {"s1"} and not whole


def test_a_forget_that_deleted_no_content_announces_no_count():
    notes = [orjson.loads(n) for n in announcement(Forgotten(tenant="a", step_ids=["s1"]))]
    assert [n.get("forgets") for n in notes] == [None]
