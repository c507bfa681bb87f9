"""A swap asked for while the database cannot be reached is refused with a 503 (nothing touched, the
operator may retry), never a 500."""

from __future__ import annotations

import asyncio

import pytest

from proxy.errors import ApiError
from proxy.rollout.swapbus import SwapBus
from proxy.upstream import ReplicaPool


def test_driving_with_the_database_unreachable_is_a_503() -> None:
    # Port 1 on loopback: nothing listens, the connection is refused at once.
    bus = SwapBus("postgresql://postgres@127.0.0.1:1/atdp", ReplicaPool(["http://127.0.0.1:9"]), drain_timeout_s=1.0)

    async def drive() -> None:
        async with bus.driving():
            pytest.fail("a driver without a database")

    with pytest.raises(ApiError) as caught:
        asyncio.run(drive())
    assert caught.value.status == 503 and caught.value.headers.get("retry-after") == "5"
