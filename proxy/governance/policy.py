"""Tenant policy: consent, retention, reward handling, and which steps may train.

This module is the pure part: the policy dataclass, loading it from TOML and the eligibility decision.
Applying policy to stored rows (forget, retention sweeps) lives in `proxy.governance.forget`; the
token guard in `proxy.governance.tokens`.

Eligibility levels, from most to least usable:
- `eligible`: may be leased by the trainer.
- `debug_only`: kept for inspection and replay, never trained on.
- `audit_only`: kept as a record of what happened, never exported for training or debugging.
- `quarantined`: held back until an operator looks (e.g. a secret was found in it).
- `deleted`: forgotten; only the tombstone remains.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

from atdp_schema.models import Eligibility, StepStatus
from proxy.governance.ner import DEFAULT_NER_MODEL
from proxy.governance.redaction import SECRET_ENTITIES, RedactionConfig
from proxy.store.rewards import REWARD_COMBINE

# From most to least usable; a stricter level wins when several rules apply.
ELIGIBILITY_LEVELS: tuple[str, ...] = tuple(level.value for level in Eligibility)
# A step's own statuses (StepStatus) plus the failure spellings older records and clients use.
ERROR_STATUSES = frozenset({StepStatus.error, StepStatus.aborted, "timeout", "upstream_error", "cancelled"})



# English refusals as instruction-tuned models phrase them ("I can't help with that", "I'm sorry, but I
# cannot ..."). Only counted unless a tenant sets max_refusal_rate.
DEFAULT_REFUSAL_PATTERNS: tuple[str, ...] = (
    r"(?i)\bI(?:'m| am)? (?:sorry|afraid),? (?:but )?I (?:can(?:no|')t|won't|will not|am unable|'m unable)",
    r"(?i)\bI (?:can(?:no|')t|won't|will not|am not able to|'m not able to|am unable to|'m unable to) "
    r"(?:help|assist|comply|provide|do that|answer)",
)


class PolicyError(ValueError):
    """A policy file or dict that does not describe a valid policy."""


@dataclass
class TenantPolicy:
    training_consent: bool = False
    retention_days: int | None = 90  # None: keep forever
    reward_min: float = -1.0
    reward_max: float = 1.0
    reward_combine: Literal["last", "mean", "min", "max", "sum"] = "last"
    secrets_eligibility: str = Eligibility.quarantined
    pii_eligibility: str = Eligibility.eligible  # PII is redacted before storage; this is for stricter tenants
    error_eligibility: str = Eligibility.debug_only
    # Redaction settings of this tenant (the deployment supplies the salt and the NER model).
    redaction_entities: tuple[str, ...] | None = None
    redaction_style: Literal["placeholder", "hash"] = "placeholder"
    redaction_allow_list: tuple[str, ...] = ()
    # The control plane (docs/control-plane.md). Share of sessions held out of training from the first
    # one, as the replay gate's evaluation set (those rewarded are its cases), so gates have cases
    # without an operator suite; 0 keeps every session trainable.
    eval_holdout: float = 0.1
    # Replay gate: a candidate fails when a tenant's paired-difference 95% interval reaches below
    # -max_regression (score units, 0..1).
    max_regression: float = 0.05
    # Safety gate (docs/control-plane.md), on the replay gate's answers. Regexes (Python `re`) that a
    # tenant's answers must not match; none by default.
    forbidden_patterns: tuple[str, ...] = ()
    # What counts as a refusal (regexes, any of them matching the answer); reported always, bounded
    # only when max_refusal_rate is set (a share of the tenant's cases, 0..1; None: no bound).
    refusal_patterns: tuple[str, ...] = DEFAULT_REFUSAL_PATTERNS
    max_refusal_rate: float | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.training_consent, bool):
            raise PolicyError("training_consent must be true or false")
        if self.retention_days is not None and (
            isinstance(self.retention_days, bool)
            or not isinstance(self.retention_days, int)
            or self.retention_days < 1
        ):
            raise PolicyError(
                f"retention_days must be a positive integer or absent, not {self.retention_days!r}"
            )
        for name in ("reward_min", "reward_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise PolicyError(f"{name} must be a finite number, not {value!r}")
        if self.reward_min >= self.reward_max:
            raise PolicyError(f"reward_min ({self.reward_min}) must be below reward_max ({self.reward_max})")
        if self.reward_combine not in REWARD_COMBINE:
            raise PolicyError(
                f"reward_combine must be one of {list(REWARD_COMBINE)}, not {self.reward_combine!r}"
            )
        for name, low, high in (("eval_holdout", 0.0, 0.5), ("max_regression", 0.0, 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise PolicyError(f"{name} must be a number from {low} to {high}, not {value!r}")
        for name in ("secrets_eligibility", "pii_eligibility", "error_eligibility"):
            value = getattr(self, name)
            if value not in ELIGIBILITY_LEVELS:
                raise PolicyError(f"{name} must be one of {list(ELIGIBILITY_LEVELS)}, not {value!r}")
        for name in ("forbidden_patterns", "refusal_patterns"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise PolicyError(f"{name} must be a list of regular expressions")
            for pattern in value:
                try:
                    re.compile(pattern)
                except re.error as exc:
                    raise PolicyError(f"{name}: {pattern!r} is not a valid regular expression ({exc})") from None
            setattr(self, name, tuple(value))
        rate = self.max_refusal_rate
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0):
            raise PolicyError(f"max_refusal_rate must be a number from 0 to 1 or absent, not {rate!r}")
        if self.redaction_style not in ("placeholder", "hash"):
            raise PolicyError(
                f"redaction_style must be 'placeholder' or 'hash', not {self.redaction_style!r}"
            )
        if self.redaction_entities is not None:
            if isinstance(self.redaction_entities, str) or not all(
                isinstance(e, str) for e in self.redaction_entities
            ):
                raise PolicyError("redaction_entities must be a list of entity names")
            self.redaction_entities = tuple(self.redaction_entities)
        if isinstance(self.redaction_allow_list, str) or not all(
            isinstance(v, str) for v in self.redaction_allow_list
        ):
            raise PolicyError("redaction_allow_list must be a list of strings")
        self.redaction_allow_list = tuple(self.redaction_allow_list)

    def redaction_config(self, *, salt: bytes = b"", ner_model: str | None = DEFAULT_NER_MODEL) -> RedactionConfig:
        return RedactionConfig(
            entities=self.redaction_entities,
            style=self.redaction_style,
            allow_list=self.redaction_allow_list,
            salt=salt,
            ner_model=ner_model,
        )

    def clamp_reward(self, value: float) -> float:
        return min(self.reward_max, max(self.reward_min, value))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("redaction_entities", "redaction_allow_list", "forbidden_patterns", "refusal_patterns"):
            if out[key] is not None:
                out[key] = list(out[key])
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, base: TenantPolicy | None = None) -> TenantPolicy:
        """Build from a mapping; fields it lacks come from `base` (or the defaults). Unknown keys are
        errors, not silently ignored: a typo in a consent flag must not pass."""
        if not isinstance(data, dict):
            raise PolicyError(f"a policy must be a table, not {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PolicyError(f"unknown policy keys {unknown}; known: {sorted(known)}")
        merged = (base or cls()).to_dict()
        merged.update(data)
        try:
            return cls(**merged)
        except TypeError as exc:  # pragma: no cover - guarded by the unknown-key check
            raise PolicyError(str(exc)) from exc


def load_policies(path: str | Path) -> dict[str, TenantPolicy]:
    """Policies from TOML: a `[default]` table and one table per tenant; a tenant table overrides
    only the keys it names. Tenants without a table get `result["default"]`."""
    try:
        raw = tomllib.loads(Path(path).read_text())
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{path}: {exc}") from exc
    for name, table in raw.items():
        if not isinstance(table, dict):
            raise PolicyError(f"{path}: top-level key {name!r} must be a table ([{name}])")
    try:
        default = TenantPolicy.from_dict(raw.get("default", {}))
    except PolicyError as exc:
        raise PolicyError(f"{path}: [default]: {exc}") from exc
    policies = {"default": default}
    for tenant, table in raw.items():
        if tenant == "default":
            continue
        try:
            policies[tenant] = TenantPolicy.from_dict(table, base=default)
        except PolicyError as exc:
            raise PolicyError(f"{path}: [{tenant}]: {exc}") from exc
    return policies


# The reason's prefix for a step whose tokens may come from either side of a keep-mode swap.
VERSION_AMBIGUOUS = "version_ambiguous"
PROVIDER_REASON = "ok: provider model, no engine tokens (supervised export only)"


def decide_eligibility(
    policy: TenantPolicy,
    *,
    status: str,
    redaction_counts: dict[str, int],
    tokens_available: bool,
    provider: str | None = None,
    version_window: tuple[str, str] | None = None,
) -> tuple[str, str]:
    """The eligibility of one captured step and why. The strictest applicable rule wins.

    `version_window` (before, after): a keep-mode swap overlapped the call and no engine reported
    which version sampled which token; such a step is never trained on (`version_ambiguous`).

    A provider step (`provider`: the LiteLLM model it went to) has no engine ids by nature: it can be
    `eligible`, for supervised / distillation export; the trainer's lease and the RL export also
    require engine (or re-derived) token ids, so it is never used for PPO."""
    candidates: list[tuple[str, str]] = []
    if status == Eligibility.deleted:
        return Eligibility.deleted, "deleted"
    if not policy.training_consent:
        candidates.append((Eligibility.audit_only, "no training consent"))
    if status in ERROR_STATUSES:
        candidates.append((policy.error_eligibility, f"step status {status}"))
    secrets = sorted(e for e, n in redaction_counts.items() if n > 0 and e in SECRET_ENTITIES)
    if secrets:
        candidates.append((policy.secrets_eligibility, "secrets redacted: " + ", ".join(secrets)))
    pii = sorted(e for e, n in redaction_counts.items() if n > 0 and e not in SECRET_ENTITIES)
    if pii:
        candidates.append((policy.pii_eligibility, "pii redacted: " + ", ".join(pii)))
    if not tokens_available and status not in ERROR_STATUSES and provider is None:
        # A failed call has nothing to train on anyway; it stays debuggable under the error rule.
        candidates.append((Eligibility.audit_only, "token ids not captured"))
    if version_window is not None and tokens_available:
        candidates.append((Eligibility.debug_only, f"{VERSION_AMBIGUOUS}: {version_window[0]} -> {version_window[1]}"))
    if not candidates:
        return Eligibility.eligible, PROVIDER_REASON if provider is not None else "ok"
    # Strictest first: deleted > quarantined > audit_only > debug_only > eligible.
    rank = {level: i for i, level in enumerate(ELIGIBILITY_LEVELS)}
    worst = max(candidates, key=lambda c: rank[c[0]])
    if worst[0] == Eligibility.eligible:
        return Eligibility.eligible, PROVIDER_REASON if provider is not None else "ok"
    return worst


