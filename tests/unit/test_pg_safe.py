"""What PostgreSQL's text and JSONB refuse (a DataError that once left a candidate `evaluating`
forever: a gate's numbers quote model answers, and a tiny model emitted a NUL)."""

import math

from proxy.store.write import pg_safe


def test_nul_characters_become_the_replacement_character_everywhere():
    value = {"a\x00": ["x\x00y", {"k": "\x00"}], "n": 1, "ok": "plain"}
    assert pg_safe(value) == {"a\ufffd": ["x\ufffdy", {"k": "\ufffd"}], "n": 1, "ok": "plain"}


def test_non_finite_numbers_become_null_and_finite_ones_stay():
    value = {"mean": math.nan, "hi": math.inf, "lo": -math.inf, "x": 0.25, "flag": True}
    assert pg_safe(value) == {"mean": None, "hi": None, "lo": None, "x": 0.25, "flag": True}
