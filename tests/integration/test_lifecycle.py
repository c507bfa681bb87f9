"""The version lifecycle against PostgreSQL and the proxy (scripted upstream, tiny trainer model).

The held-out split stays out of the trainer's leases; a trainer's version goes through the replay
gate (held-out sessions scored by a task rule, plus an operator suite) and is promoted; its card tells
what changed, why, its gate numbers, whom it served and how to roll back (JSON, Markdown, SQL view).
A candidate that fails an operator suite is rejected and the serving weights are back on the engine;
the operator override is audited and shown on the card.

The scripted upstream prefixes every answer with the name of the weights folder it loaded last
(tests/fake_vllm.py), so which weights answered a replayed case is visible in the answer itself.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest
from sqlalchemy import select, text

from proxy import cli
from proxy.config import TrainSettings
from proxy.governance.policies import Policies
from proxy.store import tables as t
from proxy.store.holdout import held_out
from trainer import lease
from trainer.loop import TrainConfig, run

ADMIN = {"authorization": "Bearer admin-test-key"}




def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _proxy(start_proxy, fake_upstream, url, factory, tiny_dir, tmp_path, *, holdout: float, suite: list[dict]):
    from datetime import UTC, datetime, timedelta

    with factory() as s, s.begin():
        when = datetime.now(UTC) - timedelta(seconds=60)
        s.add(t.ModelVersion(id="base-id", name="base", checkpoint=str(tiny_dir), status="serving", served_at=when,
                             created_at=when, metrics={}))
    policy = tmp_path / "policy.toml"
    policy.write_text(f"[default]\ntraining_consent = true\neval_holdout = {holdout}\n")
    suites = tmp_path / "suites"
    suites.mkdir()
    _write(suites / "ops.jsonl", suite)
    proxy = start_proxy([fake_upstream.url], database_url=url, policy_file=policy, eval_suites=suites,
                        eval_concurrency=1)
    assert proxy.versions.ready.wait(30)
    return proxy, policy


def _session(proxy, sid: str, text_: str, *, task: str | None = None) -> None:
    c = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0)
    headers = {"x-atdp-session-id": sid, **({"x-atdp-task-id": task} if task else {})}
    c.chat.completions.create(model="fake", messages=[{"role": "user", "content": f"#say {text_}"}],
                              extra_headers=headers, logprobs=True)


def _feedback(proxy, sid: str, reward: float) -> None:
    r = httpx.post(f"{proxy.url}/atdp/v1/sessions/{sid}/feedback", json={"reward": reward}, timeout=10)
    assert r.status_code == 200, r.text


def test_trainer_version_passes_the_replay_gate_and_its_card_tells_its_story(
        start_proxy, fake_upstream, own_db, tiny_dir, tmp_path, monkeypatch, capsys):
    url, factory = own_db
    suite = [
        {"task": "greet", "evaluator": "regex", "expected": r"^\[[^\]]+\] hello"},  # how held-out greet steps score
        {"id": "say-hi", "messages": [{"role": "user", "content": "#say hi"}], "evaluator": "regex",
         "expected": r"\] hi$"},
    ]
    proxy, policy = _proxy(start_proxy, fake_upstream, url, factory, tiny_dir, tmp_path, holdout=0.3, suite=suite)

    # Rewarded sessions until both sides of the 30% split are present (ids are random).
    held, kept = [], []
    k = 0
    while (len(held) < 2 or len(kept) < 4) and k < 60:
        sid = f"s{k}"
        _session(proxy, sid, f"hello {k}", task="greet")
        proxy.flush()
        _feedback(proxy, sid, reward=(k % 3) / 2)
        with factory() as s:
            se = s.scalars(select(t.Session).where(t.Session.external_id == sid)).one()
            (held if held_out(se.tenant_id, "greet", se.id, 0.3) else kept).append(se.id)
        k += 1
    assert len(held) >= 2 and len(kept) >= 4

    policies = Policies.load(policy)
    with factory() as s:
        shares = policies.holdout_shares(s)
        assert shares == ({}, 0.3)
        assert lease.count_ready(s) == len(held) + len(kept)  # without the split: every rewarded step
        assert lease.count_ready(s, shares) == len(kept)  # the SQL rule agrees with the Python one
    with factory() as s, s.begin():
        leased = lease.lease(s, owner="probe", ttl_s=60, max_steps=100, holdout=shares)
        sessions = set(s.scalars(select(t.Step.session_id).where(t.Step.id.in_(leased))))
        assert sessions == set(kept)
        lease.release(s, leased, owner="probe")

    cfg = TrainConfig(database_url=url, proxy_url=proxy.url, proxy_key="admin-test-key", policies=policies,
                      checkpoints_dir=tmp_path / "checkpoints", once=True,  # ratio masks off: the fake's logprobs are made up
                      train=TrainSettings(lr=1e-3, ratio_mask_low=0.0, ratio_mask_high=float("inf")))
    (result,) = run(cfg)
    assert result.status == "serving" and result.version == "v1"
    with factory() as s:
        trained = set(s.scalars(select(t.VersionLineage.session_id)))
    assert trained == set(kept)  # the held-out sessions were never trained on

    detail = httpx.get(proxy.url + "/atdp/v1/versions/v1", headers=ADMIN, timeout=10).json()
    assert detail["status"] == "serving" and detail["override"] is None
    gate, safety = detail["gates"]
    n = gate["numbers"]
    assert gate["gate"] == "replay_eval" and gate["state"] == "passed"
    assert safety["gate"] == "safety" and safety["state"] == "passed" and safety["numbers"]["cases"] == n["cases"]
    assert n["suite_cases"] == 1 and n["held_out_cases"] == len(held) and n["cases"] == len(held) + 1
    # the fake's answers differ only in the weights' name, which both rules accept: no difference
    assert n["overall"]["diff_mean"] == 0.0 and n["overall"]["candidate_mean"] == 1.0
    # per tenant: the held-out sessions' tenant, and "ops" (the suite file's name, its cases' default tenant)
    assert {k: c["n"] for k, c in n["tenants"].items()} == {proxy.tenant: len(held), "ops": 1}
    assert n["max_regression"] == {proxy.tenant: 0.05, "ops": 0.05}
    assert fake_upstream.weights == "v1"  # promoted (the restore put base back before the swap)

    _session(proxy, "after", "later")
    proxy.flush()
    card = httpx.get(proxy.url + "/atdp/v1/versions/v1/card", headers=ADMIN, timeout=10).json()
    ch = card["changed"]
    assert ch["parent"] == "base"
    assert ch["lineage"] == {"steps": len(kept), "sessions": len(kept), "tenants": [proxy.tenant], "tasks": ["greet"]}
    with factory() as s:
        rewards = [r for (r,) in s.execute(select(t.VersionLineage.reward))]
    assert ch["reward"]["mean"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-6)  # the card rounds to 6 places
    assert ch["reward"]["min"] == min(rewards) and ch["reward"]["max"] == max(rewards)
    assert ch["training"]["swap_status"] == "serving" and "loss" in ch["training"]
    assert ch["training"]["swap_seconds"] > 0  # the promotion's swap, reported back to the trainer
    assert card["why"] == {"trigger": "trainer schedule", "override": None}
    assert [g["state"] for g in card["gates"]] == ["passed", "passed"]
    assert card["affected"] == {"tenants": {proxy.tenant: 1}, "sessions": 1,
                                "canary": {"tenants": {}, "sessions": 0, "decision": None},
                                "full": {"tenants": {proxy.tenant: 1}, "sessions": 1}}
    rb = card["rollback"]
    assert rb["possible"] and rb["restores"] == "base" and detail["id"] in rb["command"]

    with factory() as s:
        row = s.execute(text("SELECT name, why, trained_steps, parent, rollback_restores FROM atdp_version_cards "
                             "WHERE name = 'v1'")).one()
    assert tuple(row) == ("v1", "trainer schedule", len(kept), "base", "base")

    monkeypatch.setenv("ATDP_DATABASE_URL", url)
    assert cli.main(["versions", "show", "v1"]) == 0
    markdown = capsys.readouterr().out
    with capsys.disabled():  # the card of this run, shown with -s (docs/control-plane.md quotes one)
        print("\n" + markdown)
    assert markdown.startswith("# Version v1 (serving)")
    assert "**replay_eval**: passed" in markdown and f"/atdp/v1/versions/{detail['id']}/rollback" in markdown
    assert cli.main(["versions", "show", "nope"]) == 1

    back = httpx.post(proxy.url + f"/atdp/v1/versions/{detail['id']}/rollback", headers=ADMIN, timeout=30)
    assert back.status_code == 200 and back.json()["name"] == "base", back.text
    after = httpx.get(proxy.url + "/atdp/v1/versions/v1/card", headers=ADMIN, timeout=10).json()
    assert after["version"]["status"] == "rolled_back" and not after["rollback"]["possible"]


def _wait_final(proxy, name: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = httpx.get(proxy.url + f"/atdp/v1/versions/{name}", headers=ADMIN, timeout=10).json()
        if body["status"] not in ("candidate", "evaluating") or time.monotonic() > deadline:
            return body
        time.sleep(0.1)


def test_a_candidate_failing_a_suite_is_rejected_and_the_override_is_audited(
        start_proxy, fake_upstream, own_db, tiny_dir, tmp_path):
    url, factory = own_db
    # The serving weights answer "[w0] hi" (the fake's start) or "[base] hi" (after a restore).
    suite = [{"id": f"hi{i}", "tenant": "acme" if i % 2 else "globex",
              "messages": [{"role": "user", "content": f"#say hi {i}"}], "evaluator": "regex",
              "expected": rf"^\[(w0|base)\] hi {i}$"} for i in range(4)]
    proxy, _ = _proxy(start_proxy, fake_upstream, url, factory, tiny_dir, tmp_path, holdout=0.0, suite=suite)
    post = lambda body: httpx.post(proxy.url + "/atdp/v1/versions", json=body, headers=ADMIN, timeout=60)  # noqa: E731

    r = post({"checkpoint": "/ckpt/bad", "name": "bad", "wait": True})
    assert r.status_code == 200, r.text
    bad = r.json()
    assert bad["status"] == "rejected" and "tenant acme" in bad["error"]
    gate, safety = bad["gates"]
    n = gate["numbers"]
    assert gate["state"] == "failed" and n["cases"] == 4
    assert safety["state"] == "passed"  # the answers differ in words, not in secrets or rules
    assert n["overall"]["serving_mean"] == 1.0 and n["overall"]["candidate_mean"] == 0.0
    assert n["tenants"]["acme"]["ci_high"] == -1.0 and n["tenants"]["globex"]["ci_low"] == -1.0
    assert n["regressions"][0]["candidate"].startswith("[bad]")
    assert fake_upstream.weights == "base" and fake_upstream.version == "base"  # serving weights back
    assert [x.version for x in proxy.state.pool.replicas] == ["base"]
    assert post({"checkpoint": "/ckpt/bad", "name": "bad"}).status_code == 409  # rejected stays rejected

    # Without "wait" the answer comes at once; the gates run in the background.
    r = post({"checkpoint": "/ckpt/bad2", "name": "bad2"})
    assert r.status_code == 202 and r.json()["status"] in ("candidate", "evaluating")
    assert _wait_final(proxy, "bad2")["status"] == "rejected"

    # The operator override: audited, swaps at once, and the card says so.
    r = post({"checkpoint": "/ckpt/forced", "name": "forced", "promote": "now", "reason": "hotfix"})
    assert r.status_code == 200 and r.json()["status"] == "serving", r.text
    assert fake_upstream.weights == "forced"
    detail = httpx.get(proxy.url + "/atdp/v1/versions/forced", headers=ADMIN, timeout=10).json()
    assert detail["override"]["promote"] == "now" and detail["override"]["reason"] == "hotfix"
    assert detail["override"]["actor"] and [g["state"] for g in detail["gates"]] == ["overridden"] * 2
    card = httpx.get(proxy.url + "/atdp/v1/versions/forced/card", headers=ADMIN, timeout=10).json()
    assert card["why"]["trigger"] == "operator override" and card["why"]["override"]["reason"] == "hotfix"
    assert card["rollback"]["restores"] == "base"
    with factory() as s:
        audit = s.scalars(select(t.AuditEvent).where(t.AuditEvent.action == "version.promote_override")).one()
        assert audit.target == detail["id"] and audit.actor == detail["override"]["actor"]

    # Bad input is a 4xx in the API's error format; the routes are the operator's.
    for body in ({"checkpoint": "/x", "promote": "later"}, {"checkpoint": "/x", "wait": "yes"},
                 {"checkpoint": "/x", "surprise": 1}, {"name": "no-checkpoint"},
                 {"checkpoint": "/x", "name": "vé"}):  # names are echoed in x-atdp-model-version: ASCII
        r = post(body)
        assert r.status_code == 422 and r.json()["error"]["message"], (body, r.text)
    assert httpx.get(proxy.url + "/atdp/v1/versions/nope", headers=ADMIN, timeout=10).status_code == 404
    assert httpx.get(proxy.url + "/atdp/v1/versions/nope/card", headers=ADMIN, timeout=10).status_code == 404
    assert httpx.get(proxy.url + "/atdp/v1/versions/forced", timeout=10).status_code == 401
    assert httpx.get(proxy.url + "/atdp/v1/versions/forced/card", timeout=10).status_code == 401


def test_no_evaluation_set_skips_the_gate_and_promotes(start_proxy, fake_upstream, own_db, tiny_dir, tmp_path):
    url, factory = own_db
    proxy, _ = _proxy(start_proxy, fake_upstream, url, factory, tiny_dir, tmp_path, holdout=0.0, suite=[])
    r = httpx.post(proxy.url + "/atdp/v1/versions", json={"checkpoint": "/ckpt/next", "name": "next", "wait": True},
                   headers=ADMIN, timeout=60)
    assert r.status_code == 200 and r.json()["status"] == "serving", r.text
    gate, safety = r.json()["gates"]
    assert safety["state"] == "skipped" and gate["state"] == "skipped" and gate["numbers"]["suite_cases"] == 0 and "no evaluation" in gate["numbers"]["reason"]
    assert r.json()["swap"]["ok"] and len(r.json()["swap"]["replicas"]) == 1
    assert fake_upstream.weights == "next"


def test_a_gate_that_cannot_score_rejects_the_candidate(start_proxy, fake_upstream, own_db, tiny_dir, tmp_path):
    url, factory = own_db
    suite = [{"id": "broken", "messages": [{"role": "user", "content": "#say hi"}], "evaluator": "command",
              "expected": ["false"]}]  # a scorer that exits 1: the gate fails closed
    proxy, _ = _proxy(start_proxy, fake_upstream, url, factory, tiny_dir, tmp_path, holdout=0.0, suite=suite)
    r = httpx.post(proxy.url + "/atdp/v1/versions", json={"checkpoint": "/ckpt/c", "name": "c", "wait": True},
                   headers=ADMIN, timeout=60)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "rejected", r.text
    gate, safety = body["gates"]
    assert safety["state"] == "passed" and gate["state"] == "error" and "exited 1" in gate["numbers"]["error"] and "exited 1" in body["error"]
    assert fake_upstream.weights == "base" and [x.version for x in proxy.state.pool.replicas] == ["base"]
