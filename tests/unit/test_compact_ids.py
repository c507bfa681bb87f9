"""Token ids and logprobs packed by struct (proxy.record.capture) are exactly what `array("i" or
"f", ...)` makes, and what array refuses is refused (or kept) the same way."""

from __future__ import annotations

import random
from array import array

import pytest

from proxy.record.capture import _extend_ids, _packed, compact_ids, compact_logprobs


def test_packed_ids_equal_arrays_own():
    rng = random.Random(3)
    for n in (0, 1, 7, 31, 32, 1000, 40_000):
        ids = [rng.randrange(-(2**31), 2**31) for _ in range(n)]
        packed = _packed("i", ids)
        assert packed.typecode == "i" and packed == array("i", ids)
    assert _packed("i", [True, 2]) == array("i", [True, 2])


@pytest.mark.parametrize("bad, error", [([1, 2**31], OverflowError), ([-(2**31) - 1], OverflowError),
                                        ([1, 2.0], TypeError), ([1, "2"], TypeError), ([None], TypeError)])
@pytest.mark.parametrize("length", [1, 100])  # short lists go through array itself
def test_what_array_refuses_is_refused_alike(bad, error, length):
    bad = [7] * (length - 1) + bad
    with pytest.raises(error):
        array("i", bad)
    with pytest.raises(error):
        _packed("i", bad)


def test_compact_ids_keeps_wide_and_odd_ids_as_before():
    assert compact_ids([1, 2**40]) == array("q", [1, 2**40])
    assert compact_ids([1, None]) == [1, None]
    ids = array("i", [1, 2])
    assert _extend_ids(ids, [3, 4]) == array("i", [1, 2, 3, 4])
    assert _extend_ids(array("i", [1]), [2, 2**40]) == [1, 2, 2**40]  # nothing half-appended
    assert _extend_ids(array("q", [2**40]), [5]) == array("q", [2**40, 5])


def test_packed_logprobs_are_arrays_own_bit_for_bit():
    rng = random.Random(5)
    for n in (0, 5, 31, 32, 500):
        values = [rng.uniform(-30.0, 0.0) for _ in range(n)] + [-0.0, 1e-45, -1e300, float("-inf"), float("nan"), 2]
        assert compact_logprobs(values).tobytes() == array("f", values).tobytes()
    assert compact_logprobs([0.5] * 40 + ["x"]) == [0.5] * 40 + ["x"]  # not numbers: kept as they came
