"""`too_deep`: JSON nesting past the limit is found at the limit exactly, and no depth crashes it."""

from proxy.shapes import MAX_DEPTH, too_deep


def _nested(levels: int, leaf: object = 1) -> object:
    x = leaf
    for i in range(levels):
        x = [x] if i % 2 else {"k": x, "s": "text"}
    return x


def test_the_limit_is_exact_in_lists_and_dicts():
    for levels in (0, 1, MAX_DEPTH - 1, MAX_DEPTH):
        assert not too_deep(_nested(levels)), levels
    assert too_deep(_nested(MAX_DEPTH + 1))
    assert too_deep({"tools": [{"a": 1}], "deep": _nested(MAX_DEPTH)})  # one level more under a key
    assert not too_deep({"tools": [{"a": 1}], "deep": _nested(MAX_DEPTH - 1)})
    assert too_deep(_nested(3), limit=2) and not too_deep(_nested(2), limit=2)


def test_a_body_far_past_the_limit_is_refused_without_recursing_into_it():
    assert too_deep(_nested(200_000))  # the walk stops at the limit: no RecursionError
    assert not too_deep("[[[[" * 1000)  # a string is a leaf, whatever it holds
