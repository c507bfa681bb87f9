"""Notes every proxy on one database hears: PostgreSQL's LISTEN/NOTIFY on one channel.

Swaps and canaries (proxy.rollout.swapbus, canarybus) and forgets (proxy.governance.forget) announce
on it. A note queued with `NOTIFY` inside a transaction is delivered when, and only if, it commits.
"""

from __future__ import annotations

from collections.abc import Sequence

import orjson
from sqlalchemy import text

CHANNEL = "atdp_swaps"
NOTIFY = text(f"SELECT pg_notify('{CHANNEL}', :payload)")
# PostgreSQL refuses a payload of 8,000 bytes or more (the default build); headroom for the JSON.
MAX_PAYLOAD = 7_600


def split(base: dict[str, object], lists: dict[str, Sequence[str]], limit: int = MAX_PAYLOAD) -> list[str]:
    """`base` with `lists` spread over as few payloads under `limit` bytes as fit: every item once, in
    one payload; each payload carries `base` and every key of `lists` (empty where nothing is left)."""
    empty = {**base, **{k: [] for k in lists}}
    room = limit - len(orjson.dumps(empty))
    out: list[str] = []
    part: dict[str, list[str]] = {k: [] for k in lists}
    used = 0
    for key, items in lists.items():
        for item in items:
            size = len(orjson.dumps(item)) + 1  # the comma
            if size > room:
                raise ValueError(f"a {key} item of {size} bytes cannot fit in a note")
            if used + size > room:
                out.append(orjson.dumps({**base, **part}).decode())
                part, used = {k: [] for k in lists}, 0
            part[key].append(item)
            used += size
    if used or not out:
        out.append(orjson.dumps({**base, **part}).decode())
    return out
