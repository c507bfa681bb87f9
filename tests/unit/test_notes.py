"""proxy.store.notes.split: announcements spread over payloads PostgreSQL accepts."""

from __future__ import annotations

import orjson
import pytest

from proxy.store.notes import split


def test_nothing_to_spread_is_one_note_with_every_key():
    assert [orjson.loads(n) for n in split({"op": "x"}, {"a": [], "b": []})] == [{"op": "x", "a": [], "b": []}]


def test_items_fill_notes_in_order_and_none_is_lost_or_repeated():
    items = [f"{i:04d}" * 5 for i in range(300)]
    notes = split({"op": "x"}, {"a": items[:200], "b": items[200:]}, limit=600)
    assert all(len(n.encode()) <= 600 for n in notes) and len(notes) > 10
    parsed = [orjson.loads(n) for n in notes]
    assert [x for p in parsed for x in p["a"]] == items[:200]
    assert [x for p in parsed for x in p["b"]] == items[200:]


def test_an_item_larger_than_a_note_is_refused():
    with pytest.raises(ValueError):
        split({"op": "x"}, {"a": ["y" * 700]}, limit=600)
