"""The canary's sequential decision: time-uniform confidence sequences, valid when checked after
every observation (docs/control-plane.md, "Gate 3: canary").

One arm's observations x_1, x_2, ... lie in [0, 1] (rewards rescaled to [0, 1]; a call's error or
tool failure is 0 or 1). Such a variable is sub-Gaussian with variance proxy sigma^2 = 1/4
(Hoeffding). For S_n = sum(x_i - mu) and V_n = sigma^2 n, Robbins' normal mixture (Howard et al.
2021, "Time-uniform, nonparametric, nonasymptotic confidence sequences", eq. 3.7 and section 3.5)
is a nonnegative supermartingale

    M_n = sqrt(rho / (V_n + rho)) * exp(S_n^2 / (2 (V_n + rho)))

so by Ville's inequality P(exists n: M_n >= 1/alpha) <= alpha, i.e. with probability >= 1 - alpha,
for every n at once,

    |mean_n - mu| <= radius(n) = sqrt(2 (V_n + rho) * log(sqrt((V_n + rho) / rho) / alpha)) / n.

rho > 0 is fixed up front (any value keeps the guarantee; it sets where the boundary is tightest).
Two arms: each arm's sequence at alpha / 2 (a union bound) gives a sequence for the difference
candidate - serving at level alpha:  [lo_c - hi_s, hi_c - lo_s].

Decisions (margins >= 0, in the [0, 1] units):
- promote  when the difference's lower bound >= -promote_margin (the candidate is shown not worse
  than serving by more than the margin);
- rollback when the reward difference's upper bound < -reward_drop (a reward drop is shown), or when
  an error or tool-failure rate difference's lower bound > its margin (a rate rise is shown).
Each rollback trigger uses alpha / (number of triggers), so all of them together raise a false
alarm with probability <= alpha; the promotion's false-promotion rate is <= alpha on its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

SIGMA2 = 0.25  # Hoeffding's variance proxy of a variable bounded in [0, 1]
RHO_AT = 50  # rho is chosen so the boundary is near its tightest around this many observations


def rho_for(n0: int, alpha: float) -> float:
    """The mixture's rho that makes the boundary nearly tightest at n0 observations (Howard et al.,
    eq. 3.8's approximation); any rho > 0 keeps the coverage guarantee."""
    la = 2 * math.log(1 / alpha)
    return SIGMA2 * n0 / (la + math.log(1 + la))


def radius(n: int, alpha: float, rho: float | None = None) -> float:
    """Half-width of the time-uniform (1 - alpha) confidence sequence for a [0, 1] mean after n
    observations (infinite for n = 0)."""
    if n <= 0:
        return math.inf
    rho = rho if rho is not None else rho_for(RHO_AT, alpha)
    v = SIGMA2 * n + rho
    return math.sqrt(2 * v * math.log(math.sqrt(v / rho) / alpha)) / n


@dataclass(frozen=True)
class Interval:
    n_candidate: int
    n_serving: int
    candidate_mean: float
    serving_mean: float
    diff: float
    low: float  # time-uniform bounds of candidate - serving
    high: float

    def as_dict(self) -> dict[str, float | int]:
        return {k: round(v, 6) if isinstance(v, float) and math.isfinite(v) else v for k, v in asdict(self).items()}


@dataclass
class Arm:
    """Running count and sum of one arm's [0, 1] observations."""

    n: int = 0
    total: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        self.total += x

    @classmethod
    def of(cls, xs: Iterable[float]) -> Arm:
        arm = cls()
        for x in xs:
            arm.add(x)
        return arm


def compare(candidate: Arm, serving: Arm, alpha: float) -> Interval:
    """The confidence sequence of mean(candidate) - mean(serving) at the current sample sizes."""
    nc, ns = candidate.n, serving.n
    mc = candidate.total / nc if nc else math.nan
    ms = serving.total / ns if ns else math.nan
    if not (nc and ns):
        return Interval(nc, ns, mc, ms, math.nan, -math.inf, math.inf)
    rc, rs = radius(nc, alpha / 2), radius(ns, alpha / 2)
    # A mean of [0, 1] values lies in [0, 1]: clip each arm's interval before subtracting.
    lo_c, hi_c = max(0.0, mc - rc), min(1.0, mc + rc)
    lo_s, hi_s = max(0.0, ms - rs), min(1.0, ms + rs)
    return Interval(nc, ns, mc, ms, mc - ms, lo_c - hi_s, hi_c - lo_s)


@dataclass(frozen=True)
class Margins:
    alpha: float = 0.05
    promote_margin: float = 0.05  # the candidate may be at most this much worse (reward, [0, 1] units)
    reward_drop: float = 0.0  # rollback when a drop larger than this is shown
    error_rise: float = 0.02  # rollback when an error-rate rise larger than this is shown
    tool_failure_rise: float = 0.05  # the same for tool failures


@dataclass(frozen=True)
class Observation:
    arm: str  # "candidate" | "serving"
    value: float  # in [0, 1]


@dataclass(frozen=True)
class Decision:
    verdict: str  # "promote" | "rollback" | "continue"
    reasons: list[str]
    reward: Interval
    errors: Interval
    tool_failures: Interval
    at_reward: int  # how many rewarded sessions had arrived when the verdict was reached


ROLLBACK_TRIGGERS = 3  # reward drop, error-rate rise, tool-failure-rate rise


def _split(obs: Iterable[Observation]) -> tuple[Arm, Arm]:
    c, s = Arm(), Arm()
    for o in obs:
        (c if o.arm == "candidate" else s).add(o.value)
    return c, s


def decide(rewards: Sequence[Observation], errors: Sequence[Observation], tool_failures: Sequence[Observation],
           m: Margins) -> Decision:
    """Walk the rewarded sessions in arrival order and stop at the first crossing (the same verdict as
    checking after every session); the rate triggers are checked on everything seen so far (their
    sequences are time-uniform too, so checking them now is as valid as at any earlier time)."""
    a_trigger = m.alpha / ROLLBACK_TRIGGERS
    err = compare(*_split(errors), a_trigger)
    tool = compare(*_split(tool_failures), a_trigger)
    rate_reasons = []
    if err.low > m.error_rise:
        rate_reasons.append(f"error rate up: candidate {err.candidate_mean:.3f} vs serving {err.serving_mean:.3f}, "
                            f"difference >= {err.low:.3f} > {m.error_rise}")
    if tool.low > m.tool_failure_rise:
        rate_reasons.append(f"tool-failure rate up: candidate {tool.candidate_mean:.3f} vs serving "
                            f"{tool.serving_mean:.3f}, difference >= {tool.low:.3f} > {m.tool_failure_rise}")
    c, s = Arm(), Arm()
    cmp = compare(c, s, m.alpha)
    for i, o in enumerate(rewards, 1):
        (c if o.arm == "candidate" else s).add(o.value)
        if not (c.n and s.n):
            continue
        cmp = compare(c, s, m.alpha)
        drop = compare(c, s, a_trigger) if a_trigger != m.alpha else cmp
        if drop.high < -m.reward_drop:
            reason = (f"reward drop: candidate {drop.candidate_mean:.3f} vs serving {drop.serving_mean:.3f}, "
                      f"difference <= {drop.high:.3f} < -{m.reward_drop}")
            return Decision("rollback", [reason, *rate_reasons], drop, err, tool, i)
        if cmp.low >= -m.promote_margin and not rate_reasons:
            reason = (f"not worse: candidate {cmp.candidate_mean:.3f} vs serving {cmp.serving_mean:.3f}, "
                      f"difference >= {cmp.low:.3f} >= -{m.promote_margin}")
            return Decision("promote", [reason], cmp, err, tool, i)
    if rate_reasons:
        return Decision("rollback", rate_reasons, cmp, err, tool, len(rewards))
    return Decision("continue", [], cmp, err, tool, len(rewards))
