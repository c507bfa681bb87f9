"""Token storage helpers: the prefix check (the parent's cached `array('i')` against a prompt list), version runs."""

from __future__ import annotations

import random
from array import array

from proxy.store.tokens import common_prefix


def _naive(a: list[int], b: list[int]) -> int:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


def test_array_and_list_mixed_agree_with_a_plain_scan():
    rng = random.Random(5)
    for _ in range(3000):
        a = [rng.randrange(4) for _ in range(rng.randrange(0, 700))]
        b = a[: rng.randrange(0, len(a) + 1)] + [rng.randrange(4) for _ in range(rng.randrange(0, 700))]
        want = _naive(a, b)
        assert common_prefix(a, b) == want
        assert common_prefix(array("i", a), b) == want
        assert common_prefix(a, array("i", b)) == want
        assert common_prefix(array("i", a), array("i", b)) == want


def test_a_long_shared_history_is_found_whole():
    parent = array("i", range(40_000))
    prompt = list(range(40_000)) + [7, 8, 9]
    assert common_prefix(parent, prompt) == 40_000
    prompt[39_999] = -1  # the last shared id differs (a re-tokenised boundary)
    assert common_prefix(parent, prompt) == 39_999


def test_run_length_encoding_of_versions_round_trips():
    from proxy.store.tokens import rle, unrle

    assert rle(["v1"] * 5) == [["v1", 5]]
    assert rle(["v1", "v1", "v2", "v1"]) == [["v1", 2], ["v2", 1], ["v1", 1]]
    assert rle([]) == []
    for values in (["a"], ["a", "b"], ["b", "b", "b", "a"], ["a", "a", "b", "b"]):
        assert unrle(rle(values)) == values
