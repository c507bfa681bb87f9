"""`ATDP_STREAM_INTERVAL` on a streamed request: a floor under what the client asked vLLM for."""

from __future__ import annotations

import pytest

from proxy.call import with_stream_interval


@pytest.mark.parametrize(("asked", "sent"), [
    (None, 4),  # not asked: the proxy's interval
    (1, 4),  # smaller: raised, as vLLM raises it to its own --stream-interval
    (4, 4),
    (9, 9),  # larger: the client's stands
])
def test_the_interval_is_a_floor(asked, sent):
    body = {"model": "m", "stream": True} | ({} if asked is None else {"stream_interval": asked})
    out = with_stream_interval(body, 4)
    assert out["stream_interval"] == sent
    assert {k: v for k, v in out.items() if k != "stream_interval"} == {"model": "m", "stream": True}
    assert body.get("stream_interval") == asked  # the door's body is not changed in place


@pytest.mark.parametrize("asked", ["8", 2.0, True, [4], {"n": 4}, -1, 0])
def test_a_value_that_is_not_a_positive_integer_is_passed_on_for_vllm_to_refuse(asked):
    body = {"stream": True, "stream_interval": asked}
    assert with_stream_interval(body, 4) is body
