"""Ids written out by hand (proxy.store.ids) read exactly as the uuid module's."""

from __future__ import annotations

import os
import random
import uuid

from proxy.store.ids import new_id, uuid7_at, uuid_bytes, uuid_text


def test_the_text_of_a_value_is_the_uuid_modules():
    rng = random.Random(7)
    values = [0, 1, (1 << 128) - 1] + [rng.getrandbits(128) for _ in range(5000)]
    for v in values:
        assert uuid_text(v) == str(uuid.UUID(int=v))


def test_new_ids_are_version_7_in_order_and_distinct():
    ids = [new_id() for _ in range(20_000)]  # many share a millisecond: the counter orders them
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)
    parsed = [uuid.UUID(i) for i in ids]
    assert all(u.version == 7 and u.variant == uuid.RFC_4122 and str(u) == i for u, i in zip(parsed, ids, strict=True))
    assert uuid.UUID(uuid7_at(1_700_000_000_000)).version == 7


def test_only_canonical_text_has_bytes():
    for _ in range(2000):
        u = uuid.uuid4()
        assert uuid_bytes(str(u)) == u.bytes
        assert uuid_text(int.from_bytes(uuid_bytes(str(u)), "big")) == str(u)
    u = str(uuid.uuid4())
    for other in (u.upper(), "{" + u + "}", u.replace("-", ""), u[:-1] + "g", u[:8] + " " + u[9:],
                  u[:9] + "-" + u[10:13] + u[8] + u[14:], " " + u[1:], u + "0", "", "step-1"):
        assert uuid_bytes(other) is None, other


def test_a_forked_child_draws_its_own_random_bits():
    new_id()  # the parent holds a block of random bytes now
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its next id's random bits, and leave without cleanup
        os.write(w, new_id()[-12:].encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    child = os.read(r, 64).decode()
    os.close(r)
    assert child and child != new_id()[-12:]
