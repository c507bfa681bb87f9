"""Tenant policy: validation, TOML loading, eligibility decisions, reward combination."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.governance.policy import PolicyError, TenantPolicy, decide_eligibility, load_policies
from proxy.governance.redaction import RedactionConfig
from proxy.governance.secrets import SECRET_ENTITIES
from proxy.store.rewards import combine_rewards

CONSENTED = TenantPolicy(training_consent=True)


def test_defaults_and_round_trip() -> None:
    p = TenantPolicy()
    assert (p.training_consent, p.retention_days, p.reward_combine) == (False, 90, "last")
    assert (p.secrets_eligibility, p.pii_eligibility, p.error_eligibility) == (
        "quarantined",
        "eligible",
        "debug_only",
    )
    custom = TenantPolicy(
        training_consent=True,
        retention_days=None,
        reward_min=0.0,
        reward_max=10.0,
        reward_combine="mean",
        redaction_entities=["EMAIL_ADDRESS", "API_KEY"],  # type: ignore[arg-type]
        redaction_style="hash",
        redaction_allow_list=["ops@acme.io"],  # type: ignore[arg-type]
    )
    d = custom.to_dict()
    assert d["redaction_entities"] == ["EMAIL_ADDRESS", "API_KEY"] and d["retention_days"] is None
    assert TenantPolicy.from_dict(d) == custom
    assert custom.redaction_config(salt=b"k") == RedactionConfig(
        entities=("EMAIL_ADDRESS", "API_KEY"), style="hash", allow_list=("ops@acme.io",), salt=b"k"
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"training_consnt": True}, "unknown policy keys"),
        ({"training_consent": "yes"}, "training_consent"),
        ({"retention_days": 0}, "retention_days"),
        ({"retention_days": True}, "retention_days"),
        ({"reward_min": 1.0, "reward_max": 1.0}, "reward_min"),
        ({"reward_max": float("inf")}, "reward_max"),
        ({"reward_combine": "median"}, "reward_combine"),
        ({"secrets_eligibility": "maybe"}, "secrets_eligibility"),
        ({"redaction_style": "mask"}, "redaction_style"),
        ({"redaction_entities": "EMAIL_ADDRESS"}, "redaction_entities"),
    ],
)
def test_invalid_policies_raise_clear_errors(data: dict, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        TenantPolicy.from_dict(data)


def test_load_policies_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "policies.toml"
    path.write_text(
        "[default]\ntraining_consent = true\nretention_days = 30\n\n"
        '[acme]\nreward_combine = "mean"\nredaction_style = "hash"\nredaction_allow_list = ["ops@acme.io"]\n\n'
        '[globex]\ntraining_consent = false\nsecrets_eligibility = "audit_only"\n'
    )
    policies = load_policies(path)
    assert set(policies) == {"default", "acme", "globex"}
    assert policies["acme"].training_consent is True and policies["acme"].retention_days == 30  # inherited
    assert policies["acme"].reward_combine == "mean"
    assert policies["acme"].redaction_allow_list == ("ops@acme.io",)
    assert policies["globex"].training_consent is False
    assert policies["globex"].secrets_eligibility == "audit_only"

    path.write_text('[default]\n[acme]\nreward_combine = "median"\n')
    with pytest.raises(PolicyError, match=r"\[acme\].*reward_combine"):
        load_policies(path)
    path.write_text("retention_days = 3\n")
    with pytest.raises(PolicyError, match="must be a table"):
        load_policies(path)
    path.write_text("[default\n")
    with pytest.raises(PolicyError, match="policies.toml"):
        load_policies(path)


def test_eligibility_decisions() -> None:
    ok = {"status": "ok", "redaction_counts": {}, "tokens_available": True}
    assert decide_eligibility(CONSENTED, **ok) == ("eligible", "ok")
    assert decide_eligibility(TenantPolicy(), **ok) == ("audit_only", "no training consent")
    assert decide_eligibility(CONSENTED, **{**ok, "status": "error"}) == ("debug_only", "step status error")
    assert decide_eligibility(CONSENTED, **{**ok, "status": "aborted"})[0] == "debug_only"
    eligibility, reason = decide_eligibility(
        CONSENTED, **{**ok, "redaction_counts": {"API_KEY": 2, "EMAIL_ADDRESS": 1}}
    )
    assert (eligibility, reason) == ("quarantined", "secrets redacted: API_KEY")
    # PII is redacted before storage: eligible by default, stricter tenants can say otherwise.
    assert decide_eligibility(CONSENTED, **{**ok, "redaction_counts": {"EMAIL_ADDRESS": 1}}) == (
        "eligible",
        "ok",
    )
    strict = TenantPolicy(training_consent=True, pii_eligibility="debug_only")
    assert decide_eligibility(strict, **{**ok, "redaction_counts": {"PHONE_NUMBER": 1}}) == (
        "debug_only",
        "pii redacted: PHONE_NUMBER",
    )
    assert decide_eligibility(CONSENTED, **{**ok, "redaction_counts": {"API_KEY": 0}}) == ("eligible", "ok")
    assert decide_eligibility(CONSENTED, **{**ok, "tokens_available": False}) == (
        "audit_only",
        "token ids not captured",
    )
    # The strictest rule wins: a secret (quarantined) beats an error (debug_only) and missing consent.
    assert decide_eligibility(
        TenantPolicy(), status="error", redaction_counts={"JWT": 1}, tokens_available=False
    )[0] == ("quarantined")
    assert decide_eligibility(CONSENTED, **{**ok, "status": "deleted"}) == ("deleted", "deleted")


def test_every_secret_entity_quarantines() -> None:
    for entity in SECRET_ENTITIES:
        assert decide_eligibility(
            CONSENTED, status="ok", redaction_counts={entity: 1}, tokens_available=True
        )[0] == ("quarantined")


def test_combine_and_clamp_rewards() -> None:
    values = [0.5, -1.0, 2.0]
    assert combine_rewards(values, "last") == 2.0
    assert combine_rewards(values, "mean") == pytest.approx(0.5)
    assert combine_rewards(values, "min") == -1.0
    assert combine_rewards(values, "max") == 2.0
    assert combine_rewards(values, "sum") == pytest.approx(1.5)
    with pytest.raises(ValueError, match="no rewards"):
        combine_rewards([], "mean")
    with pytest.raises(ValueError, match="reward_combine"):
        combine_rewards(values, "median")
    assert TenantPolicy().clamp_reward(3.0) == 1.0 and TenantPolicy().clamp_reward(-3.0) == -1.0
