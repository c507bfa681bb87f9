"""Paired comparison of two versions' scores on the same cases, and the replay gate's pass rule.

For each case d = score(candidate) - score(serving). Reported per tenant and overall: each version's
mean score, the mean of d and its bootstrap 95% percentile interval (2000 resamples of the cases,
a fixed seed, so the same scores always give the same interval).

Pass rule: every tenant's interval lower bound is at least -max_regression (that tenant's policy),
and overall the candidate is not shown worse: the overall interval's upper bound is at least 0.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import asdict, dataclass

SEED = 20260101
RESAMPLES = 2000


@dataclass(frozen=True)
class Comparison:
    n: int
    candidate_mean: float
    serving_mean: float
    diff_mean: float
    ci_low: float
    ci_high: float

    def as_dict(self) -> dict[str, float | int]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}


@dataclass(frozen=True)
class Pair:
    tenant: str
    candidate: float
    serving: float


def bootstrap_interval(diffs: list[float], *, seed: int = SEED, resamples: int = RESAMPLES,
                       level: float = 0.95) -> tuple[float, float]:
    if not diffs:
        raise ValueError("no differences to bootstrap")
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    tail = (1.0 - level) / 2
    return means[int(tail * (resamples - 1))], means[int((1.0 - tail) * (resamples - 1))]


def compare(pairs: list[Pair]) -> Comparison:
    diffs = [p.candidate - p.serving for p in pairs]
    low, high = bootstrap_interval(diffs)
    n = len(pairs)
    return Comparison(n=n, candidate_mean=sum(p.candidate for p in pairs) / n,
                      serving_mean=sum(p.serving for p in pairs) / n, diff_mean=sum(diffs) / n,
                      ci_low=low, ci_high=high)


@dataclass(frozen=True)
class Verdict:
    passed: bool
    overall: Comparison
    tenants: dict[str, Comparison]
    reasons: list[str]  # why it failed (empty when it passed)


def decide(pairs: list[Pair], max_regression: dict[str, float]) -> Verdict:
    by_tenant: dict[str, list[Pair]] = defaultdict(list)
    for p in pairs:
        by_tenant[p.tenant].append(p)
    tenants = {tenant: compare(ps) for tenant, ps in sorted(by_tenant.items())}
    overall = compare(pairs)
    reasons = [
        f"tenant {tenant}: interval lower bound {c.ci_low:+.3f} < -max_regression (-{max_regression[tenant]})"
        for tenant, c in tenants.items() if c.ci_low < -max_regression[tenant]
    ]
    if overall.ci_high < 0:
        reasons.append(f"overall worse: mean difference {overall.diff_mean:+.3f}, interval "
                       f"[{overall.ci_low:+.3f}, {overall.ci_high:+.3f}] entirely below 0")
    return Verdict(passed=not reasons, overall=overall, tenants=tenants, reasons=reasons)
