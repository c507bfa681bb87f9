"""The trainer loop: lease -> batch -> update -> checkpoint -> version -> swap, on a cadence.

Rank 0 alone talks to PostgreSQL and the proxy; it builds the batch (samples and their advantages)
and broadcasts it, every rank trains its share (FSDP2), rank 0 writes the checkpoint and publishes
it. The same code runs as one plain process or under torchrun (gloo on CPU, NCCL on GPU).

One update, in order:
    1. wait until >= min_steps trainable steps exist, or interval_s passed and >= 1 exists
    2. lease up to max_steps (FOR UPDATE SKIP LOCKED); skip (mark) the stale ones
    3. samples from the stored tokens; advantages over the whole batch
    4. train_step (ppo_epochs times) on the model of the serving version
    5. write the checkpoint; register the candidate + lineage; ask the proxy to swap
(1 also waits while `gate`, e.g. `--when diagnosed` (trainer/gate.py), holds.) The in-memory model
continues across updates while its version serves; after a failed swap or a rollback it is reloaded
from the serving version's checkpoint. The optimizer state is saved after every swap under
<checkpoints>/.trainer-state/ and resumed when the model loaded is its version.

An update whose loss or weights are not finite is never published: its candidate is registered
and marked failed at once (lineage kept, steps released), and the next update reloads the serving
version (weights and optimizer state).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from atdp_schema.models import VersionStatus
from proxy.config import TrainSettings
from proxy.governance.policies import Policies
from trainer import dist, numerics
from trainer.batch import (
    Sample,
    build_samples,
    micro_batches,
    sample_counts,
    session_weights,
    split_for_ranks,
    split_stale,
)
from trainer.checkpoint import load_optimizer_state, save_optimizer_state, trainer_state_path
from trainer.display import Display
from trainer.gate import DiagnosisGate
from trainer.loss import PPOOptions, add_proximal_logprobs, group_advantages, train_step
from trainer.numerics import Profile
from trainer.sampling import resolve_logprobs_mode

log = logging.getLogger("atdp.trainer")

WAIT_SLICE_S = 30.0  # rank 0 reports back at least this often, so other ranks' collectives never time out


@dataclass
class TrainConfig:
    database_url: str
    proxy_url: str
    proxy_key: str | None  # a key scoped to versions:write (ATDP_TRAINER_KEY), else the admin key
    checkpoints_dir: Path
    # The tunables: cadence, data, optimisation, numerics (ATDP_TRAIN_* and `atdp train`'s flags;
    # proxy.config.TrainSettings has each one's type, default and meaning).
    train: TrainSettings = field(default_factory=TrainSettings)
    once: bool = False
    poll_s: float = 2.0
    engine_url: str | None = None  # a vLLM replica, for the numerics probe and `behaviour_logprobs: auto`
    engine_api_key: str | None = None
    grad_checkpointing: bool = False
    swap_timeout_s: float = 900.0
    weight_transfer: str = "disk"  # nccl: the engine also gets the weights over NCCL (trainer.weight_transfer)
    owner: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    # Consent is checked again when steps are loaded: the database row over ATDP_POLICY_FILE over the
    # defaults (ATDP_PRODUCTION: no consent unless given). `atdp train` builds it from the settings.
    policies: Policies = field(default_factory=Policies)
    gate: DiagnosisGate | None = None  # --when diagnosed: train only while a policy update is recommended

    def __post_init__(self) -> None:
        # Checked before anything is leased (build_samples would refuse it after the lease).
        if self.train.samples == "trajectory" and self.train.turn_discount != 1.0:
            raise ValueError("turn_discount applies to step samples only: a trajectory gives every turn its reward")

    @property
    def ppo(self) -> PPOOptions:
        return ppo_options(self.train)


def ppo_options(train: TrainSettings) -> PPOOptions:
    """The loss's options from the trainer's settings (0 turns the grad-norm clip and the KL mask off)."""
    return PPOOptions(clip_eps_low=train.clip_low, clip_eps_high=train.clip_high,
                      ratio_mask_low=train.ratio_mask_low, ratio_mask_high=train.ratio_mask_high,
                      kl_mask=train.kl_mask or None, temperature=train.temperature,
                      max_grad_norm=train.max_grad_norm or None, kl_coef=train.kl_coef, kl_ref=train.kl_ref)


@dataclass
class Plan:
    """What rank 0 broadcasts for one update."""

    kind: str  # "train" | "wait" | "stop"
    samples: list[Sample] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    version_id: str | None = None  # the serving version trained from
    version_name: str | None = None
    checkpoint: str | None = None
    session_of: dict[str, str] = field(default_factory=dict)  # step id -> session id
    n_steps: int = 0
    n_stale: int = 0
    n_onpolicy_steps: int = 0  # redacted prompts: trained with the on-policy fallback
    counts: dict[str, int] = field(default_factory=dict)  # batch.sample_counts: trajectory vs single steps
    kl_ref_checkpoint: str | None = None  # the KL penalty's reference model; None = behaviour logprobs
    message: str = ""


@dataclass
class UpdateResult:
    update: int
    version: str
    status: str
    metrics: dict[str, Any]


class Controller:
    """Rank 0's side: the database, the proxy, the display."""

    def __init__(self, cfg: TrainConfig) -> None:
        from proxy.store import db

        self.cfg = cfg
        self.engine = db.make_engine(cfg.database_url)
        self.factory = db.session_factory(self.engine)
        self.run_id: str | None = None
        self.last_update = time.monotonic()
        self.leased: list[str] = []
        self.display = Display(enabled=sys.stdout.isatty())

    @functools.cached_property
    def logprobs_mode(self) -> str:
        """How the engine reports behaviour logprobs ("raw" | "processed"); asked once."""
        return resolve_logprobs_mode(self.cfg.train.behaviour_logprobs, self.cfg.engine_url, api_key=self.cfg.engine_api_key)

    def start_run(self) -> str:
        from proxy.store import tables as t
        from proxy.store.ids import new_id

        self.run_id = new_id()
        skip = ("proxy_key", "database_url", "policies", "train")
        config = _jsonable({**{k: v for k, v in asdict(self.cfg).items() if k not in skip},
                            "train": self.cfg.train.model_dump()})
        with self.factory() as s, s.begin():
            s.add(t.TrainingRun(id=self.run_id, config=config, host=socket.gethostname()))
        return self.run_id

    def end_run(self, status: str) -> None:
        from datetime import UTC, datetime

        from proxy.store import tables as t
        from trainer import lease

        with self.factory() as s, s.begin():
            lease.release(s, self.leased, owner=self.cfg.owner)
            run = s.get(t.TrainingRun, self.run_id) if self.run_id else None
            if run is not None:
                run.status, run.ended_at = status, datetime.now(UTC)
        self.display.close()
        self.engine.dispose()

    # --- 1-3: the next batch ---------------------------------------------------------------------

    def next_plan(self) -> Plan:
        from proxy.store.versions import serving_version
        from trainer import lease

        cfg, train = self.cfg, self.cfg.train
        deadline = time.monotonic() + WAIT_SLICE_S
        while True:
            with self.factory() as s:
                ready = lease.count_ready(s, cfg.policies.holdout_shares(s))
                held = cfg.gate(s) if ready and cfg.gate else None
            due = time.monotonic() - self.last_update >= train.interval_s
            if ready and not held and (cfg.once or ready >= train.min_steps or due):
                break
            if cfg.once:
                return Plan(kind="stop", message=held or "no eligible rewarded steps to train on")
            self.display.phase(held or f"waiting for rewarded steps: {ready}/{train.min_steps}")
            if time.monotonic() >= deadline:
                return Plan(kind="wait")
            time.sleep(cfg.poll_s)

        with self.factory() as s, s.begin():
            current = serving_version(s)
            if current is None:
                return Plan(kind="wait", message="no serving version yet (is the proxy running?)")
            holdout = cfg.policies.holdout_shares(s)  # the replay gate's sessions stay out
            ids = lease.lease(s, owner=cfg.owner, ttl_s=train.lease_ttl_s, max_steps=train.max_steps, holdout=holdout)
        if not ids:  # another trainer took them
            return Plan(kind="wait")
        self.leased = ids
        with self.factory() as s, s.begin():
            loaded = lease.load(s, ids, current=current.name, policies=cfg.policies,
                                processed=self.logprobs_mode == "processed")
            fresh, stale = split_stale(loaded.steps, max_version_lag=train.max_version_lag)
            reasons = dict(loaded.skipped)
            for st in stale:
                lag = "unknown version" if st.version_lag >= lease.UNKNOWN_LAG else f"{st.version_lag} versions"
                reasons[st.step_id] = f"stale: {lag} behind {current.name} (max {train.max_version_lag})"
            samples = build_samples(fresh, mode=train.samples, turn_discount=train.turn_discount, max_len=train.max_len)
            used = {i for smp in samples for i in smp.step_ids}
            for st in fresh:
                if st.step_id not in used:
                    reasons[st.step_id] = f"no trainable token within max_len={train.max_len}"
            lease.skip(s, reasons)
        self.leased = sorted(used)
        if stale:
            log.info("skipped %d stale steps (more than %d versions behind)", len(stale), train.max_version_lag)
        if not samples:
            return Plan(kind="wait", n_stale=len(stale), message="every leased step was skipped")
        samples = session_weights(samples, train.weighting)
        advantages = group_advantages([x.reward for x in samples], [x.group for x in samples],
                                      normalize_std=bool(train.normalize_std), sessions=[x.session_id for x in samples],
                                      sizes=[len(x.step_ids) for x in samples])
        with self.factory() as s:
            kl_ref = reference_checkpoint(s, cfg.ppo, current)
        return Plan(kind="train", samples=samples, advantages=advantages, version_id=current.id,
                    version_name=current.name, checkpoint=current.checkpoint, n_steps=len(used), n_stale=len(stale),
                    session_of={st.step_id: st.session_id for st in fresh if st.step_id in used},
                    n_onpolicy_steps=sum(1 for st in fresh if st.step_id in used and not st.prompt_exact),
                    counts=sample_counts([st for st in fresh if st.step_id in used], samples),
                    kl_ref_checkpoint=kl_ref)

    # --- 5: publish ------------------------------------------------------------------------------

    def publish(self, state: dict[str, torch.Tensor], plan: Plan, stats: dict[str, Any], update: int,
                base_dir: Path) -> UpdateResult:
        from proxy.store import tables as t
        from proxy.store.versions import mark_failed
        from trainer import swap
        from trainer.checkpoint import write_checkpoint
        from trainer.lease import LineageRow
        from trainer.weight_transfer import publish_version

        cfg = self.cfg
        name = swap.pick_name(self.factory)
        out = cfg.checkpoints_dir / name
        while out.exists():
            name += "b"
            out = cfg.checkpoints_dir / name
        problem = non_finite(state, stats)
        if problem is None:
            self.display.phase(f"writing checkpoint {name}")
            write_checkpoint(state, base_dir=base_dir, out_dir=out, dtype=cfg.train.save_dtype)

        lineage = [
            LineageRow(step_id=i, session_id=plan.session_of[i], reward=smp.reward, advantage=adv)
            for smp, adv in zip(plan.samples, plan.advantages, strict=True)
            for i in smp.step_ids
        ]
        metrics = {**stats, "steps": plan.n_steps, "checkpoint": str(out), "samples": len(plan.samples), "stale": plan.n_stale,
                   "exact_steps": plan.n_steps - plan.n_onpolicy_steps, "onpolicy_steps": plan.n_onpolicy_steps,
                   "trained_from": plan.version_name, "sample_mode": cfg.train.samples, **plan.counts}
        version_id, name = swap.register_candidate(
            self.factory, name=name, checkpoint=str(out), parent_id=plan.version_id, run_id=self.run_id,
            lineage=lineage, owner=cfg.owner, metrics=_jsonable(metrics),
        )
        self.leased = []
        if problem is not None:
            # NaN/inf weights must never reach the engine: the candidate (lineage kept, checkpoint
            # not written) fails here, and mark_failed releases its steps for a later update.
            error = f"not published: {problem}; checkpoint not written"
            with self.factory() as s, s.begin():
                mark_failed(s, version_id, error, actor="trainer")
            log.error("update %d: %s", update, error)
            outcome = swap.SwapOutcome(ok=False, version_id=version_id, name=name, status="failed", seconds=None,
                                       error=error)
        else:
            self.display.phase(f"swapping to {name}")
            outcome = publish_version(cfg, state, base_dir, out, functools.partial(  # disk, or NCCL as well
                swap.request_swap, self.factory, proxy_url=cfg.proxy_url, proxy_key=cfg.proxy_key, version_id=version_id,
                name=name, checkpoint=str(out), parent=plan.version_id, timeout_s=cfg.swap_timeout_s),
                save_dtype=cfg.train.save_dtype)
        metrics.update(version=name, swap_status=outcome.status, swap_seconds=outcome.seconds,
                       swap_error=outcome.error)
        with self.factory() as s, s.begin():
            s.add(t.TrainingUpdate(run_id=self.run_id, version_id=version_id, update=update, metrics=_jsonable(metrics)))
        self.last_update = time.monotonic()
        result = UpdateResult(update=update, version=name, status=outcome.status, metrics=metrics)
        self.display.update(result.update, result.version, result.status, result.metrics)
        return result


def non_finite(state: dict[str, torch.Tensor], stats: dict[str, Any]) -> str | None:
    """Why these weights must not be published (a non-finite loss or weight), or None."""
    import math

    loss = stats.get("loss")
    if loss is None or not math.isfinite(loss):
        return f"non-finite loss {loss}"
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        return f"non-finite weights in {len(bad)} tensors ({', '.join(bad[:3])})"
    return None


def reference_checkpoint(s, opts: PPOOptions, current) -> str | None:
    """The KL penalty's reference model: None for the behaviour logprobs (or no penalty), the root
    of the serving version's lineage for "base", else the checkpoint path as given."""
    from proxy.store import tables as t

    if not opts.kl_coef or opts.kl_ref == "behaviour":
        return None
    if opts.kl_ref != "base":
        return opts.kl_ref
    version = current
    while version.parent_id is not None:  # parents always exist: versions are never deleted
        version = s.get(t.ModelVersion, version.parent_id)
    return version.checkpoint


def _jsonable(value: Any) -> Any:
    """JSON for PostgreSQL: paths as strings, non-finite floats as strings ("inf", "nan")."""
    import math

    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return str(value) if isinstance(value, Path) else value


def _pad_id(model) -> int:
    config = getattr(model, "config", None)
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(config, attr, None)
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int):
            return value
    return 0


class Policy:
    """The model being trained (every rank), and which version it currently equals."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.model = None
        self.optimizer = None
        self.version: str | None = None
        self.checkpoint: Path | None = None
        self.numerics: Profile | None = None  # resolved once: the engine's kernels do not change
        self.resumed = False  # the optimizer state was loaded from .trainer-state
        self.ref_model = None  # the KL penalty's frozen reference, kept while its checkpoint is the same
        self.ref_checkpoint: str | None = None

    def resolve_numerics(self, checkpoint: str) -> Profile:
        """The engine's numerics profile, probed by rank 0 against the weights it serves now."""
        cfg, train = self.cfg, self.cfg.train
        if train.dtype != "fp32" or train.compute_dtype:
            return "fp32"  # emulation needs fp32 compute to round from
        if self.numerics is None:
            profile = numerics.resolve(train.engine_numerics, checkpoint, cfg.engine_url, api_key=cfg.engine_api_key) \
                if dist.is_main() else None
            self.numerics = dist.broadcast_object(profile)
        return self.numerics

    def ensure(self, version: str, checkpoint: str) -> None:
        from trainer.model import LoraOptions, load_model, shard

        if self.model is not None and self.version == version:
            return
        cfg, train = self.cfg, self.cfg.train
        lora = LoraOptions(r=train.lora_r, alpha=2 * train.lora_r) if train.lora_r else None
        self.model = load_model(checkpoint, dtype=train.dtype, grad_checkpointing=cfg.grad_checkpointing, lora=lora,
                                engine_numerics=self.resolve_numerics(checkpoint))
        shard(self.model, compute_dtype=train.compute_dtype or None)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay)
        self.version, self.checkpoint = version, Path(checkpoint)
        # LoRA adapters are merged into each checkpoint and start afresh on load: their moments
        # would belong to adapters that no longer exist.
        self.resumed = train.optimizer_state == "keep" and not train.lora_r and load_optimizer_state(
            self.model, self.optimizer, trainer_state_path(cfg.checkpoints_dir), version=version,
            checkpoint=checkpoint)
        log.info("rank %d: model loaded from %s (%s), optimizer state %s", dist.rank(), checkpoint, version,
                 "resumed" if self.resumed else "fresh")

    def save_state(self) -> None:
        """The optimizer state of the version now in memory (a collective)."""
        if self.cfg.train.optimizer_state == "keep" and not self.cfg.train.lora_r:
            save_optimizer_state(self.model, self.optimizer, trainer_state_path(self.cfg.checkpoints_dir),
                                 version=self.version, checkpoint=str(self.checkpoint))

    def reference(self, checkpoint: str):
        """The frozen reference policy for the KL penalty (sharded like the policy)."""
        from trainer.model import load_model, shard

        if self.ref_model is None or self.ref_checkpoint != checkpoint:
            self.ref_model = None  # free the old one first
            train = self.cfg.train
            ref = load_model(checkpoint, dtype=train.dtype, grad_checkpointing=False,
                             engine_numerics=self.resolve_numerics(checkpoint))
            ref.requires_grad_(False)
            self.ref_model, self.ref_checkpoint = shard(ref, compute_dtype=train.compute_dtype or None), checkpoint
        return self.ref_model

    def update(self, plan: Plan) -> dict[str, Any]:
        train, ppo = self.cfg.train, self.cfg.ppo
        mine, my_adv = split_for_ranks(plan.samples, plan.advantages, rank=dist.rank(), world=dist.world_size())
        mbs = micro_batches(mine, my_adv, pad_id=_pad_id(self.model), max_tokens=train.micro_batch_tokens)
        # Every rank must run as many micro-batches for the proximal pass (collectives).
        if train.ppo_epochs > 1:
            add_proximal_logprobs(self.model, mbs, temperature=ppo.temperature)
        if ppo.kl_coef and plan.kl_ref_checkpoint:
            add_proximal_logprobs(self.reference(plan.kl_ref_checkpoint), mbs, temperature=ppo.temperature,
                                  key="ref_logprobs")
        rewards = [x.reward for x in plan.samples]
        stats: dict[str, Any] = {}
        for _ in range(train.ppo_epochs):
            stats = train_step(self.model, self.optimizer, mbs, ppo, rewards=rewards)
        stats["optimizer_resumed"] = self.resumed
        return stats


def run(cfg: TrainConfig) -> list[UpdateResult]:
    """Train until stopped (or one update with cfg.once / cfg.train.max_updates). Returns rank 0's results."""
    from trainer.checkpoint import gather_full_state_dict

    rank, _world = dist.init()
    torch.manual_seed(cfg.train.seed + rank)
    ctl = Controller(cfg) if rank == 0 else None
    policy = Policy(cfg)
    results: list[UpdateResult] = []
    status = VersionStatus.failed
    try:
        dist.broadcast_object(ctl.start_run() if ctl else None)
        update = 0
        while True:
            plan: Plan = dist.broadcast_object(ctl.next_plan() if ctl else None)
            if plan.kind == "stop":
                if plan.message:
                    log.info(plan.message)
                break
            if plan.kind == "wait":
                continue
            policy.ensure(plan.version_name, plan.checkpoint)
            if ctl:
                ctl.display.phase(f"training on {plan.n_steps} steps ({len(plan.samples)} samples)")
            stats = policy.update(plan)
            state = gather_full_state_dict(policy.model)  # collective
            result = ctl.publish(state, plan, stats, update, policy.checkpoint) if ctl else None
            result = dist.broadcast_object(result)
            results.append(result)
            if result.status == VersionStatus.serving:
                policy.version = result.version  # the weights in memory are the serving ones now
                policy.checkpoint = Path(result.metrics["checkpoint"])
                policy.resumed = cfg.train.optimizer_state == "keep"  # the next update continues this state
                policy.save_state()  # collective: a later --once run resumes it
            else:
                policy.version = None  # reload the serving version next time
            update += 1
            if cfg.once or (cfg.train.max_updates and update >= cfg.train.max_updates):
                break
        status = "finished"
    finally:
        if ctl:
            ctl.end_run(status)
        dist.barrier()
    return results
