"""The canary's confidence sequences keep their error rates when checked after every observation.

Simulation: many independent streams, each checked after every single observation (the way the
canary monitor looks at them). A fixed-sample interval checked like that overshoots alpha by a wide
margin (shown below as the contrast); the time-uniform sequences must not.
"""

from __future__ import annotations

import math
import random

from proxy.evaluation.sequential import Arm, Margins, Observation, compare, decide, radius

ALPHA = 0.05
STREAMS = 200
LENGTH = 800


def test_radius_shrinks_and_is_infinite_without_data():
    assert radius(0, ALPHA) == math.inf
    rs = [radius(n, ALPHA) for n in (10, 100, 1000, 10000)]
    assert rs == sorted(rs, reverse=True)
    # Always wider than the fixed-n Hoeffding interval at the same level (the price of peeking).
    for n in (10, 100, 1000):
        assert radius(n, ALPHA) > math.sqrt(math.log(2 / ALPHA) / (2 * n))


def test_one_arm_sequence_covers_the_mean_at_every_n_at_once():
    """P(exists n <= LENGTH: |mean_n - p| > radius(n)) <= alpha, for Bernoulli(0.5) (the worst case
    for Hoeffding's variance proxy) and a skewed Bernoulli(0.1)."""
    rng = random.Random(1)
    for p in (0.5, 0.1):
        misses = naive_misses = 0
        for _ in range(STREAMS):
            total, missed, naive = 0.0, False, False
            for n in range(1, LENGTH + 1):
                total += rng.random() < p
                err = abs(total / n - p)
                missed |= err > radius(n, ALPHA)
                # A fixed-n 95% normal interval, checked after every observation.
                naive |= n >= 10 and err > 1.96 * math.sqrt(p * (1 - p) / n)
            misses += missed
            naive_misses += naive
        assert misses / STREAMS <= ALPHA, (p, misses)
        assert naive_misses / STREAMS > 2 * ALPHA, (p, naive_misses)  # peeking breaks the naive one


def _stream(rng: random.Random, p_candidate: float, p_serving: float, n: int) -> list[Observation]:
    out = []
    for i in range(n):
        arm = "candidate" if i % 2 == 0 else "serving"
        p = p_candidate if arm == "candidate" else p_serving
        out.append(Observation(arm, 1.0 if rng.random() < p else 0.0))
    return out


def _verdicts(p_candidate: float, p_serving: float, margins: Margins, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    counts = {"promote": 0, "rollback": 0, "continue": 0}
    for _ in range(STREAMS):
        d = decide(_stream(rng, p_candidate, p_serving, LENGTH), [], [], margins)
        counts[d.verdict] += 1
    return counts


def test_false_promotion_rate_stays_under_alpha():
    """The candidate is truly worse than the margin allows (0.5 - 0.15 vs 0.5, margin 0.1)."""
    m = Margins(alpha=ALPHA, promote_margin=0.1, reward_drop=0.2)
    counts = _verdicts(0.35, 0.5, m, seed=2)
    assert counts["promote"] / STREAMS <= ALPHA, counts


def test_false_rollback_rate_stays_under_alpha():
    """The candidate is exactly as good (0.5 vs 0.5): any rollback is a false alarm."""
    m = Margins(alpha=ALPHA, promote_margin=0.25, reward_drop=0.0)
    counts = _verdicts(0.5, 0.5, m, seed=3)
    assert counts["rollback"] / STREAMS <= ALPHA, counts
    # And the test has power: an equal candidate is promoted in most streams within 800 sessions
    # (400 per arm: the difference's half-width is about 0.18 there, under the 0.25 margin).
    assert counts["promote"] / STREAMS > 0.8, counts


def test_a_clearly_worse_candidate_is_rolled_back_early():
    m = Margins(alpha=ALPHA, promote_margin=0.1, reward_drop=0.0)
    rng = random.Random(4)
    stops = []
    for _ in range(100):
        d = decide(_stream(rng, 0.1, 0.9, 400), [], [], m)
        assert d.verdict == "rollback", d
        stops.append(d.at_reward)
    assert max(stops) < 100, stops  # well before the stream ends


def test_rate_triggers_roll_back_and_block_promotion():
    m = Margins(alpha=ALPHA, promote_margin=0.5, error_rise=0.02)
    rewards = [Observation("candidate" if i % 2 else "serving", 1.0) for i in range(200)]
    errors = [Observation("candidate", 1.0 if i % 3 == 0 else 0.0) for i in range(300)] + \
             [Observation("serving", 0.0) for _ in range(300)]
    d = decide(rewards, errors, [], m)
    assert d.verdict == "rollback" and "error rate up" in d.reasons[0], d
    assert d.errors.low > 0.02
    # Without the errors the same rewards promote.
    assert decide(rewards, [], [], m).verdict == "promote"


def test_compare_needs_both_arms():
    i = compare(Arm.of([1.0, 1.0]), Arm(), ALPHA)
    assert i.low == -math.inf and i.high == math.inf
    assert decide([Observation("candidate", 1.0)] * 50, [], [], Margins()).verdict == "continue"
