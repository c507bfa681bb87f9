"""Feedback right after a response: `once_durable` must wait for a step the writer commits while the
feedback's own lookup runs (the lookup's snapshot lacks the row, and by the time it answers 404 the
step has left the in-flight set; asking the set only afterwards answered 404, seen in CI)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from proxy.control.feedback import once_durable
from proxy.errors import ApiError
from proxy.record.durability import InFlight


def _step(session: str, step: str) -> SimpleNamespace:
    return SimpleNamespace(step_id=step, session=SimpleNamespace(external_id=session))


def test_a_write_that_commits_during_the_lookup_is_waited_for_not_a_404() -> None:
    inflight = InFlight()
    step = _step("s2", "st-1")
    inflight.add(step)
    state = SimpleNamespace(recorder=SimpleNamespace(inflight=inflight))
    looks = []

    async def look() -> str:
        looks.append(1)
        if len(looks) == 1:
            inflight.done([step])  # the writer commits after the lookup took its snapshot
            raise ApiError(404, "session not found")
        return "found"

    assert asyncio.run(once_durable(state, "s2", None, look)) == "found"
    assert len(looks) == 2


def test_a_session_nobody_answered_is_still_a_404_at_once() -> None:
    state = SimpleNamespace(recorder=SimpleNamespace(inflight=InFlight()))

    async def look() -> str:
        raise ApiError(404, "session not found")

    with pytest.raises(ApiError) as e:
        asyncio.run(once_durable(state, "nobody", None, look))
    assert e.value.status == 404
