"""Work leases in PostgreSQL: which captured steps a trainer may train on, and the bookkeeping after.

A step is trainable when
    eligibility = 'eligible', token_source in ('engine', 'rederived'), it has output tokens,
    trained_version_id IS NULL, skipped_reason IS NULL, its session is not held out for evaluation
    (the tenant's `eval_holdout` share, proxy.store.holdout), and it is rewarded:
    a feedback row with a reward names the step, or its session has session-level rewards.
A lease sets `lease_owner` and `lease_expires_at` (database clock) on rows locked with
`FOR UPDATE SKIP LOCKED`: two trainers never take the same step, and a crashed trainer's steps come
back once its lease expires.

Reward of a step: its step-level rewards if it has any, else its session's session-level rewards,
either list combined by the tenant's `reward_combine` (proxy.governance.combine_rewards).

Version lag (see docs/training.md): versions that have ever served (`served_at` set) are ranked by
`created_at`; lag = |rank(current serving) - rank(v)| for each version v stamped on the step's output
tokens, and the step's lag is the largest (its oldest token). A token version the store does not
know counts as infinitely stale.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import and_, exists, func, or_, select, update
from sqlalchemy.orm import Session

from atdp_schema.models import Eligibility, TokenSource
from proxy.governance.policies import Policies
from proxy.store import tables as t
from proxy.store.holdout import held_out_sql
from proxy.store.rewards import combine_rewards
from proxy.store.tokens import TRAINABLE_SOURCES, rebuild_prompt_ids, unrle
from trainer.batch import StepTokens
from trainer.sampling import PLAIN
from trainer.sampling import from_params as sampling_of

UNKNOWN_LAG = 1_000_000


Holdout = tuple[dict[str, float], float]  # ({tenant: eval_holdout share}, default share): Policies.holdout_shares
NO_HOLDOUT: Holdout = ({}, 0.0)


def _trainable(holdout: Holdout = NO_HOLDOUT):
    step_reward = exists().where(t.Feedback.step_id == t.Step.id, t.Feedback.reward.is_not(None))
    session_reward = exists().where(
        t.Feedback.session_id == t.Step.session_id, t.Feedback.step_id.is_(None), t.Feedback.reward.is_not(None)
    )
    return and_(
        t.Step.eligibility == Eligibility.eligible,
        t.Step.token_source.in_(TRAINABLE_SOURCES),
        func.cardinality(t.Step.output_token_ids) > 0,
        t.Step.trained_version_id.is_(None),
        t.Step.skipped_reason.is_(None),
        or_(step_reward, session_reward),
        # The replay gate's evaluation set (proxy.store.holdout): never trained on.
        ~exists().where(t.Session.id == t.Step.session_id, held_out_sql(*holdout)),
    )


def _free():
    return or_(t.Step.lease_owner.is_(None), t.Step.lease_expires_at < func.now())


def count_ready(s: Session, holdout: Holdout = NO_HOLDOUT) -> int:
    """Trainable steps nobody holds a live lease on."""
    return s.scalar(select(func.count()).select_from(t.Step).where(_trainable(holdout), _free())) or 0


def lease(s: Session, *, owner: str, ttl_s: float, max_steps: int, holdout: Holdout = NO_HOLDOUT) -> list[str]:
    """Take up to max_steps trainable steps (oldest first) for `owner`; commits nothing itself.
    `holdout`: the tenants' evaluation shares; their held-out sessions are never leased."""
    ids = list(
        s.scalars(
            select(t.Step.id)
            .where(_trainable(holdout), _free())
            .order_by(t.Step.started_at, t.Step.seq)
            .limit(max_steps)
            .with_for_update(of=t.Step, skip_locked=True)
        )
    )
    if ids:
        s.execute(
            update(t.Step)
            .where(t.Step.id.in_(ids))
            .values(lease_owner=owner, lease_expires_at=func.now() + timedelta(seconds=ttl_s))
        )
    return ids


def release(s: Session, ids: list[str], *, owner: str) -> None:
    """Give steps back without training on them (only the owner's leases)."""
    if ids:
        s.execute(
            update(t.Step)
            .where(t.Step.id.in_(ids), t.Step.lease_owner == owner)
            .values(lease_owner=None, lease_expires_at=None)
        )


def skip(s: Session, reasons: dict[str, str]) -> None:
    """Mark steps as not to be trained on (`steps.skipped_reason`) and drop their leases."""
    for step_id, reason in reasons.items():
        s.execute(
            update(t.Step)
            .where(t.Step.id == step_id)
            .values(skipped_reason=reason[:500], lease_owner=None, lease_expires_at=None)
        )


def version_ranks(s: Session) -> dict[str, int]:
    """{version name: rank} over versions that have served, in order of creation."""
    names = s.scalars(
        select(t.ModelVersion.name)
        .where(t.ModelVersion.served_at.is_not(None), t.ModelVersion.layer == "policy")
        .order_by(t.ModelVersion.created_at, t.ModelVersion.id)
    )
    return {name: i for i, name in enumerate(names)}


def version_lag(versions: list[str], ranks: dict[str, int], current: str) -> int:
    if current not in ranks:
        return UNKNOWN_LAG
    lags = [abs(ranks[current] - ranks[v]) if v in ranks else UNKNOWN_LAG for v in set(versions)]
    return max(lags, default=0)


@dataclass
class Loaded:
    steps: list[StepTokens]
    tenant_of: dict[str, str]  # step id -> tenant
    skipped: dict[str, str]  # step id -> reason (not trainable after all: no consent, lost prefix)


def load(s: Session, ids: list[str], *, current: str, policies: Policies, processed: bool = False) -> Loaded:
    """The leased steps as StepTokens (full prompt ids, rewards, version lags); consent is checked
    again here, under `policies` (the database row over ATDP_POLICY_FILE over the defaults).
    `processed`: the engine reported processed logprobs, so each step carries its sampling."""
    rows = {st.id: st for st in s.scalars(select(t.Step).where(t.Step.id.in_(ids)))}
    sessions = {x.id: x for x in s.scalars(select(t.Session).where(t.Session.id.in_({r.session_id for r in rows.values()})))}
    feedback = s.execute(
        select(t.Feedback.session_id, t.Feedback.step_id, t.Feedback.reward)
        .where(t.Feedback.session_id.in_(list(sessions)), t.Feedback.reward.is_not(None))
        .order_by(t.Feedback.created_at, t.Feedback.id)
    ).all()
    step_rewards: dict[str, list[float]] = defaultdict(list)
    session_rewards: dict[str, list[float]] = defaultdict(list)
    for session_id, step_id, reward in feedback:
        (step_rewards[step_id] if step_id else session_rewards[session_id]).append(reward)

    by_tenant = {tenant: policies.policy_for(s, tenant) for tenant in {r.tenant_id for r in rows.values()}}
    ranks = version_ranks(s)
    skipped: dict[str, str] = {}
    prompts: dict[str, list[int]] = {}
    for step_id, st in rows.items():
        try:
            prompts[step_id] = rebuild_prompt_ids({step_id: st}, fetch=lambda i, sid: t.get_step(s, i, sid))[step_id]
        except LookupError as e:
            skipped[step_id] = f"prompt ids lost: {e}"

    steps: list[StepTokens] = []
    for step_id, st in rows.items():
        policy = by_tenant[st.tenant_id]
        if step_id in skipped:
            continue
        if not policy.training_consent:
            skipped[step_id] = "no training consent (checked at training time)"
            continue
        values = step_rewards.get(step_id) or session_rewards.get(st.session_id)
        if not values:  # feedback removed since the lease query
            skipped[step_id] = "no reward"
            continue
        versions = unrle(st.output_versions)
        n = len(st.output_token_ids)
        if len(versions) != n:  # never expected; a step that is inconsistent is not trained on
            skipped[step_id] = f"{len(versions)} token versions for {n} output tokens"
            continue
        steps.append(
            StepTokens(
                step_id=step_id,
                session_id=st.session_id,
                task_id=sessions[st.session_id].task_id,
                seq=st.seq,
                prompt_ids=prompts[step_id],
                output_ids=list(st.output_token_ids),
                behaviour_logprobs=[float(x) for x in st.output_logprobs] or [float("nan")] * n,
                output_versions=versions,
                output_mask=list(st.output_mask) if st.output_mask is not None else [1] * n,
                prompt_exact=st.token_source == TokenSource.engine,
                reward=combine_rewards(values, policy.reward_combine),
                version_lag=version_lag(versions, ranks, current),
                tenant_id=st.tenant_id,
                sampling=sampling_of(st.params) if processed else PLAIN,
            )
        )
    return Loaded(steps=steps, tenant_of={i: r.tenant_id for i, r in rows.items()}, skipped=skipped)


@dataclass
class LineageRow:
    step_id: str
    session_id: str
    reward: float
    advantage: float


class LeaseLost(RuntimeError):
    """Steps a trainer meant to complete are no longer leased to it (expired, or another owner's)."""


def complete(s: Session, *, version_id: str, lineage: list[LineageRow], owner: str) -> None:
    """Record which steps trained `version_id`, mark them trained and drop their leases.

    Only steps `owner` still holds a live lease on (database clock) may be completed: a lease that
    expired may have gone to another trainer, whose update must not be credited to this version.
    Raises LeaseLost, having changed nothing the caller's transaction keeps (it should roll back).
    """
    ids = sorted({r.step_id for r in lineage})
    if ids:
        held = set(s.scalars(
            update(t.Step)
            .where(t.Step.id.in_(ids), t.Step.lease_owner == owner, t.Step.lease_expires_at >= func.now())
            .values(trained_version_id=version_id, lease_owner=None, lease_expires_at=None)
            .returning(t.Step.id)
            .execution_options(synchronize_session=False)
        ))
        if len(held) != len(ids):
            raise LeaseLost(f"{len(ids) - len(held)} of {len(ids)} steps are no longer leased to {owner!r} "
                            "(expired or taken by another trainer)")
    for row in lineage:
        s.add(t.VersionLineage(version_id=version_id, step_id=row.step_id, session_id=row.session_id,
                               reward=row.reward, advantage=row.advantage))
