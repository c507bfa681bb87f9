"""A lone proxy's keys are kept a while, bounded, for a switch to shared (proxy.store.links.LinkStore.offer)."""

from __future__ import annotations

import asyncio

from proxy.store.links import LinkRow, LinkStore

NOWHERE = "postgresql://atdp@127.0.0.1:1/none"  # nothing listens: a publish fails at once


def rows(k: int) -> list[LinkRow]:
    return [LinkRow(f"t{k}", "t", f"s{k}", "sess"), LinkRow(f"i{k}", "i", f"s{k}", "sess")]


def test_a_lone_proxy_keeps_its_recent_keys_bounded_and_publishes_nothing():
    links = LinkStore(NOWHERE, ttl_s=3600, shared=False, may_share=True, recent_entries=10)
    for k in range(8):
        assert links.offer(rows(k)) is None
    assert links._recent_rows == 10 and [rs[0].step_id for _, rs in links._recent] == ["s3", "s4", "s5", "s6", "s7"]
    links.recent_s = 0.0  # now older than the window: the next offer lets them go
    links.offer(rows(8))
    assert [rs[0].step_id for _, rs in links._recent] == ["s8"]


def test_a_proxy_that_never_shares_keeps_nothing():
    links = LinkStore(NOWHERE, ttl_s=3600, shared=False, may_share=False)
    assert links.offer(rows(0)) is None and not links._recent


def test_the_switch_publishes_the_kept_keys_and_then_every_call():
    async def run() -> None:
        links = LinkStore(NOWHERE, ttl_s=3600, shared=False, may_share=True, timeout_s=5.0)
        links._unknown[b"x" * 16] = 0.0
        assert links.go_shared() is None  # nothing kept: nothing to publish
        assert links.shared and not links._unknown  # others' keys may now answer what was unknown
        links.go_lone()
        links.offer(rows(0))
        links.offer(rows(1))
        sent = links.go_shared()
        assert sent is not None and not links._recent
        assert [r.step_id for r in links._pending[0][0]] == ["s0", "s0", "s1", "s1"]
        assert await links.settle(sent) is False and links.failures == 1  # no database: the call goes on
        later = links.offer(rows(2))
        assert later is not None and await links.settle(later) is False
        await links.close()

    asyncio.run(run())


def test_a_forget_drops_the_kept_keys_of_its_steps():
    links = LinkStore(NOWHERE, ttl_s=3600, shared=False, may_share=True)
    links.offer(rows(0))
    links.offer([LinkRow("t1", "t", "s1", "sess"), LinkRow("i1", "i", "s1", "sess", "s0", 3)])  # s0's child
    links.offer(rows(2))
    assert links.forget({"s0"}) == 3  # s0's keys, and the input key naming s0 as its parent
    assert [(r.hash, r.step_id) for _, rs in links._recent for r in rs] == [("t1", "s1"), ("t2", "s2"), ("i2", "s2")]
    assert links._recent_rows == 3
