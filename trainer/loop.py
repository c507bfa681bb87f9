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
The in-memory model continues across updates while its version serves; after a failed swap or a
rollback it is reloaded from the serving version's checkpoint (optimizer state starts afresh).
"""

from __future__ import annotations

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
from proxy.governance.policies import Policies
from trainer import dist
from trainer.batch import Sample, build_samples, micro_batches, split_for_ranks, split_stale
from trainer.loss import PPOOptions, add_proximal_logprobs, group_advantages, train_step

log = logging.getLogger("atdp.trainer")

WAIT_SLICE_S = 30.0  # rank 0 reports back at least this often, so other ranks' collectives never time out


@dataclass
class TrainConfig:
    database_url: str
    proxy_url: str
    admin_key: str | None
    checkpoints_dir: Path
    # cadence
    min_steps: int = 32
    interval_s: float = 300.0
    once: bool = False
    max_updates: int | None = None
    poll_s: float = 2.0
    # data
    max_steps: int = 512
    max_version_lag: int = 4
    lease_ttl_s: float = 1800.0
    mode: str = "auto"
    turn_discount: float = 1.0
    max_len: int = 4096
    micro_batch_tokens: int = 8192
    normalize_std: bool = True
    # optimisation
    lr: float = 1e-5
    weight_decay: float = 0.0
    ppo_epochs: int = 1
    ppo: PPOOptions = field(default_factory=PPOOptions)
    dtype: str = "fp32"  # master weights
    compute_dtype: str | None = None  # "bf16": bf16 forward/backward under FSDP2
    save_dtype: str = "fp32"
    engine_numerics: str | None = None  # "bf16": round where a bf16 engine rounds (trainer/model.py)
    grad_checkpointing: bool = False
    lora_r: int = 0
    seed: int = 0
    swap_timeout_s: float = 900.0
    owner: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    # Consent is checked again when steps are loaded: the database row over ATDP_POLICY_FILE over the
    # defaults (ATDP_PRODUCTION: no consent unless given). `atdp train` builds it from the settings.
    policies: Policies = field(default_factory=Policies)


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

    def start_run(self) -> str:
        from proxy.store import tables as t
        from proxy.store.ids import new_id

        self.run_id = new_id()
        config = _jsonable({k: v for k, v in asdict(self.cfg).items() if k not in ("admin_key", "database_url", "policies")})
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

        cfg = self.cfg
        deadline = time.monotonic() + WAIT_SLICE_S
        while True:
            with self.factory() as s:
                ready = lease.count_ready(s)
            due = time.monotonic() - self.last_update >= cfg.interval_s
            if ready and (cfg.once or ready >= cfg.min_steps or due):
                break
            if cfg.once:
                return Plan(kind="stop", message="no eligible rewarded steps to train on")
            self.display.phase(f"waiting for rewarded steps: {ready}/{cfg.min_steps}")
            if time.monotonic() >= deadline:
                return Plan(kind="wait")
            time.sleep(cfg.poll_s)

        with self.factory() as s, s.begin():
            current = serving_version(s)
            if current is None:
                return Plan(kind="wait", message="no serving version yet (is the proxy running?)")
            ids = lease.lease(s, owner=cfg.owner, ttl_s=cfg.lease_ttl_s, max_steps=cfg.max_steps)
        if not ids:  # another trainer took them
            return Plan(kind="wait")
        self.leased = ids
        with self.factory() as s, s.begin():
            loaded = lease.load(s, ids, current=current.name, policies=cfg.policies)
            fresh, stale = split_stale(loaded.steps, max_version_lag=cfg.max_version_lag)
            reasons = dict(loaded.skipped)
            for st in stale:
                lag = "unknown version" if st.version_lag >= lease.UNKNOWN_LAG else f"{st.version_lag} versions"
                reasons[st.step_id] = f"stale: {lag} behind {current.name} (max {cfg.max_version_lag})"
            samples = build_samples(fresh, mode=cfg.mode, turn_discount=cfg.turn_discount, max_len=cfg.max_len)
            used = {i for smp in samples for i in smp.step_ids}
            for st in fresh:
                if st.step_id not in used:
                    reasons[st.step_id] = f"no trainable token within max_len={cfg.max_len}"
            lease.skip(s, reasons)
        self.leased = sorted(used)
        if stale:
            log.info("skipped %d stale steps (more than %d versions behind)", len(stale), cfg.max_version_lag)
        if not samples:
            return Plan(kind="wait", n_stale=len(stale), message="every leased step was skipped")
        advantages = group_advantages([x.reward for x in samples], [x.group for x in samples],
                                      normalize_std=cfg.normalize_std)
        return Plan(kind="train", samples=samples, advantages=advantages, version_id=current.id,
                    version_name=current.name, checkpoint=current.checkpoint, n_steps=len(used), n_stale=len(stale),
                    session_of={st.step_id: st.session_id for st in fresh if st.step_id in used})

    # --- 5: publish ------------------------------------------------------------------------------

    def publish(self, state: dict[str, torch.Tensor], plan: Plan, stats: dict[str, Any], update: int,
                base_dir: Path) -> UpdateResult:
        from proxy.store import tables as t
        from trainer import swap
        from trainer.checkpoint import write_checkpoint
        from trainer.lease import LineageRow

        cfg = self.cfg
        name = swap.pick_name(self.factory)
        out = cfg.checkpoints_dir / name
        while out.exists():
            name += "b"
            out = cfg.checkpoints_dir / name
        self.display.phase(f"writing checkpoint {name}")
        write_checkpoint(state, base_dir=base_dir, out_dir=out, dtype=cfg.save_dtype)

        lineage = [
            LineageRow(step_id=i, session_id=plan.session_of[i], reward=smp.reward, advantage=adv)
            for smp, adv in zip(plan.samples, plan.advantages, strict=True)
            for i in smp.step_ids
        ]
        metrics = {**stats, "steps": plan.n_steps, "checkpoint": str(out), "samples": len(plan.samples), "stale": plan.n_stale,
                   "trained_from": plan.version_name}
        version_id, name = swap.register_candidate(
            self.factory, name=name, checkpoint=str(out), parent_id=plan.version_id, run_id=self.run_id,
            lineage=lineage, owner=cfg.owner, metrics=metrics,
        )
        self.leased = []
        self.display.phase(f"swapping to {name}")
        outcome = swap.request_swap(
            self.factory, proxy_url=cfg.proxy_url, admin_key=cfg.admin_key, version_id=version_id, name=name,
            checkpoint=str(out), parent=plan.version_id, timeout_s=cfg.swap_timeout_s,
        )
        metrics.update(version=name, swap_status=outcome.status, swap_seconds=outcome.seconds,
                       swap_error=outcome.error)
        with self.factory() as s, s.begin():
            s.add(t.TrainingUpdate(run_id=self.run_id, version_id=version_id, update=update, metrics=_jsonable(metrics)))
        self.last_update = time.monotonic()
        result = UpdateResult(update=update, version=name, status=outcome.status, metrics=metrics)
        self.display.update(result)
        return result


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


class Display:
    """A one-line progress display on a terminal (rich); plain log lines otherwise."""

    def __init__(self, *, enabled: bool) -> None:
        self.progress = None
        if enabled:
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
            self.task = self.progress.add_task("starting", total=None)
            self.progress.start()

    def phase(self, text: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, description=text)

    def update(self, r: UpdateResult) -> None:
        m = r.metrics
        line = (
            f"update {r.update} -> {r.version} [{r.status}] reward {m.get('reward_mean', float('nan')):.3f}"
            f"±{m.get('reward_std', float('nan')):.3f} loss {m['loss']:.4f} clip {m['clip_frac']:.3f} "
            f"masked {m['masked_frac']:.3f} |Δlogp| {m['mean_abs_logp_diff']:.4f} "
            f"tok/s {m['tokens_per_s']:.0f} steps {m['steps']} stale {m['stale']}"
        )
        log.info(line)
        if self.progress is not None:
            self.progress.console.print(line)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


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

    def ensure(self, version: str, checkpoint: str) -> None:
        from trainer.model import LoraOptions, load_model, shard

        if self.model is not None and self.version == version:
            return
        cfg = self.cfg
        lora = LoraOptions(r=cfg.lora_r, alpha=2 * cfg.lora_r) if cfg.lora_r else None
        self.model = load_model(checkpoint, dtype=cfg.dtype, grad_checkpointing=cfg.grad_checkpointing, lora=lora,
                                engine_numerics=cfg.engine_numerics)
        shard(self.model, compute_dtype=cfg.compute_dtype)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.version, self.checkpoint = version, Path(checkpoint)
        log.info("rank %d: model loaded from %s (%s)", dist.rank(), checkpoint, version)

    def update(self, plan: Plan) -> dict[str, Any]:
        cfg = self.cfg
        mine, my_adv = split_for_ranks(plan.samples, plan.advantages, rank=dist.rank(), world=dist.world_size())
        mbs = micro_batches(mine, my_adv, pad_id=_pad_id(self.model), max_tokens=cfg.micro_batch_tokens)
        # Every rank must run as many micro-batches for the proximal pass (collectives).
        if cfg.ppo_epochs > 1:
            add_proximal_logprobs(self.model, mbs, temperature=cfg.ppo.temperature)
        rewards = [x.reward for x in plan.samples]
        stats: dict[str, Any] = {}
        for _ in range(cfg.ppo_epochs):
            stats = train_step(self.model, self.optimizer, mbs, cfg.ppo, rewards=rewards)
        return stats


def run(cfg: TrainConfig) -> list[UpdateResult]:
    """Train until stopped (or one update with cfg.once / cfg.max_updates). Returns rank 0's results."""
    from trainer.checkpoint import gather_full_state_dict

    rank, _world = dist.init()
    torch.manual_seed(cfg.seed + rank)
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
            else:
                policy.version = None  # reload the serving version next time
            update += 1
            if cfg.once or (cfg.max_updates is not None and update >= cfg.max_updates):
                break
        status = "finished"
    finally:
        if ctl:
            ctl.end_run(status)
        dist.barrier()
    return results
