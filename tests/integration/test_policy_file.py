"""ATDP_POLICY_FILE and ATDP_PRODUCTION reach every process that applies policy, not only the writer:
the proxy's own routes (policy GET, reward clamping) and the trainer's consent check at lease time."""

from __future__ import annotations

import argparse

import httpx
import openai

from proxy.config import read_settings
from proxy.store import tables as t
from trainer import lease
from trainer.main import train_config

ADMIN = {"authorization": "Bearer admin-test-key"}
POLICY_FILE = """
[default]
retention_days = 30

[acme]
training_consent = true
reward_max = 5.0
"""


def _env(tmp_path, db_url: str) -> dict[str, str]:
    path = tmp_path / "policies.toml"
    path.write_text(POLICY_FILE)
    return {"ATDP_PRODUCTION": "1", "ATDP_POLICY_FILE": str(path), "ATDP_HOME": str(tmp_path / "home"),
            "ATDP_DATABASE_URL": db_url}


def test_the_proxy_serves_and_applies_the_policy_file(start_proxy, fake_upstream, tmp_path, db_url):
    settings = read_settings(_env(tmp_path, db_url))
    assert settings.production and settings.policy_file is not None
    proxy = start_proxy([fake_upstream.url], production=settings.production, policy_file=settings.policy_file)

    acme = httpx.get(f"{proxy.url}/atdp/v1/tenants/acme/policy", headers=ADMIN, timeout=10).json()["policy"]
    assert acme["training_consent"] is True and acme["reward_max"] == 5.0 and acme["retention_days"] == 30
    other = httpx.get(f"{proxy.url}/atdp/v1/tenants/other/policy", headers=ADMIN, timeout=10).json()["policy"]
    assert other["training_consent"] is False and other["retention_days"] == 30  # production: no consent

    # Reward clamping in the proxy process uses the file's range too (open mode: the test's tenant).
    c = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0)
    c.chat.completions.create(model="fake", messages=[{"role": "user", "content": "#say hi"}],
                              extra_headers={"x-atdp-session-id": "clamped"})
    proxy.flush()
    r = httpx.post(f"{proxy.url}/atdp/v1/sessions/clamped/feedback", json={"reward": 2.0}, timeout=10)
    assert r.status_code == 422 and "[-1.0, 1.0]" in r.text  # the default range: the tenant has no table


def test_the_trainer_refuses_steps_of_a_tenant_without_consent(start_proxy, fake_upstream, factory, tmp_path,
                                                              db_url):
    # Recorded while consent was on (a local proxy, no policy file): eligible, rewarded steps.
    proxy = start_proxy([fake_upstream.url])
    c = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0)
    c.chat.completions.create(model="fake", messages=[{"role": "user", "content": "#say hi"}],
                              extra_headers={"x-atdp-session-id": "no-consent"})
    proxy.flush()
    r = httpx.post(f"{proxy.url}/atdp/v1/sessions/no-consent/feedback", json={"reward": 1.0}, timeout=10)
    assert r.status_code == 200, r.text
    (step,) = proxy.steps(factory, "no-consent")
    assert step.eligibility == "eligible"

    # The trainer runs in production with the policy file: this tenant has no table, so no consent.
    settings = read_settings(_env(tmp_path, db_url))
    args = argparse.Namespace(once=True, proxy_url=None)  # no flag: the trainer settings are the settings
    policies = train_config(args, settings).policies
    assert policies.base("acme").training_consent and not policies.base(proxy.tenant).training_consent
    with factory() as s, s.begin():
        current = t.get_step(s, step.id).model_version or "base"
        loaded = lease.load(s, [step.id], current=current, policies=policies)
    assert loaded.steps == []
    assert loaded.skipped == {step.id: "no training consent (checked at training time)"}
