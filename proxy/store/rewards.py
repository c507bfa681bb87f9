"""How several rewards of one step or session combine into one number (a tenant's policy names which)."""

from __future__ import annotations

import math

REWARD_COMBINE: tuple[str, ...] = ("last", "mean", "min", "max", "sum")


def combine_rewards(values: list[float], how: str) -> float:
    """Several feedback rewards for one step into one number."""
    if not values:
        raise ValueError("no rewards to combine")
    if how == "last":
        return float(values[-1])
    if how == "mean":
        return math.fsum(values) / len(values)
    if how == "min":
        return float(min(values))
    if how == "max":
        return float(max(values))
    if how == "sum":
        return math.fsum(values)
    raise ValueError(f"reward_combine must be one of {list(REWARD_COMBINE)}, not {how!r}")
