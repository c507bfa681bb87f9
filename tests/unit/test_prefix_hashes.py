"""The continuation keys are shared between proxies (`continuation_links`) and stored as steps'
`transcript_hash`: however `prefix_hashes` computes them, they are the documented chain,
h[i] = chain_hash(h[i-1], sha256(key[i])), seeded by the tenant."""

from __future__ import annotations

import hashlib
import random

from proxy.sessions import match_key, prefix_hashes
from proxy.store.content import chain_hash


def _reference(tenant: str, keys: list[bytes], start: str | None = None) -> list[str]:
    h = start or hashlib.sha256(tenant.encode()).hexdigest()
    out = []
    for k in keys:
        h = chain_hash(h, hashlib.sha256(k).hexdigest())
        out.append(h)
    return out


def test_prefix_hashes_are_the_documented_chain() -> None:
    rng = random.Random(4)
    for n in (0, 1, 2, 50):
        keys = [rng.randbytes(rng.randrange(0, 3000)) for _ in range(n)]
        for tenant in ("acme", "ténant ✓"):
            assert prefix_hashes(tenant, keys) == _reference(tenant, keys)
            start = hashlib.sha256(b"earlier").hexdigest()
            assert prefix_hashes(tenant, keys, start=start) == _reference(tenant, keys, start)


def test_a_known_value_does_not_move() -> None:
    # Pinned: a change here re-keys every live session (other proxies and stored steps hold these).
    keys = [match_key({"role": "user", "content": "hi"}), match_key({"role": "assistant", "content": "hello"})]
    assert prefix_hashes("acme", keys)[-1] == "21958d5fd9c17cd00eeec8c5b6f97346f67d9f9b065735de5d85027d48f0b01a"
