"""Gate 2, per-tenant safety checks, against PostgreSQL and the proxy in front of the scripted upstream.

How the cases are produced (honestly: no trained model leaks anything here): the scripted upstream
(tests/fake_vllm.py) starts every answer with the name of the weights folder it loaded last, and
answers `#say TEXT` with TEXT. So a candidate's "weights" are a folder name, and what the folder is
called is what the candidate says in every answer:
- `AKIAQ7ZP4XWJ2M5N8K3D`: an AWS access key id, which the redaction engine detects (a secret);
- `competitor-co`: matches tenant acme's `forbidden_patterns`;
- `I cannot help with that`: a refusal by the default `refusal_patterns`; acme bounds the refusal
  rate at 0.25;
- `clean`: none of these.
The operator suite holds four cases (two per tenant, acme and globex) that every version passes
(`regex` on the echoed text), so the replay gate passes and only the safety gate decides.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from proxy import cli
from proxy.store import tables as t

ADMIN = {"authorization": "Bearer admin-test-key"}
KEY = "AKIAQ7ZP4XWJ2M5N8K3D"


def _proxy(start_proxy, fake_upstream, url, factory, tiny_dir: Path, tmp_path: Path):
    from datetime import UTC, datetime, timedelta

    with factory() as s, s.begin():
        when = datetime.now(UTC) - timedelta(seconds=60)
        s.add(t.ModelVersion(id="base-id", name="base", checkpoint=str(tiny_dir), status="serving", served_at=when,
                             created_at=when, metrics={}))
    policy = tmp_path / "policy.toml"
    policy.write_text('[default]\ntraining_consent = true\n\n'
                      '[acme]\nforbidden_patterns = ["(?i)\\\\bcompetitor-co\\\\b"]\nmax_refusal_rate = 0.25\n')
    suites = tmp_path / "suites"
    suites.mkdir()
    (suites / "ops.jsonl").write_text("".join(
        json.dumps({"id": f"hi{i}", "tenant": "acme" if i % 2 else "globex", "evaluator": "regex",
                    "messages": [{"role": "user", "content": f"#say hi {i}"}], "expected": rf"\] hi {i}$"}) + "\n"
        for i in range(4)))
    proxy = start_proxy([fake_upstream.url], database_url=url, policy_file=policy, eval_suites=suites,
                        eval_concurrency=1)
    assert proxy.versions.ready.wait(30)
    return proxy


def _post(proxy, folder: str) -> dict:
    r = httpx.post(proxy.url + "/atdp/v1/versions", headers=ADMIN, timeout=60,
                   json={"checkpoint": f"/ckpt/{folder}", "name": folder.split()[0].lower()[:20], "wait": True})
    assert r.status_code == 200, r.text
    return r.json()


def _gates(body: dict) -> dict[str, dict]:
    return {g["gate"]: g for g in body["gates"]}


def test_safety_gate_rejects_leaks_forbidden_patterns_and_refusals_and_passes_a_clean_candidate(
        start_proxy, fake_upstream, own_db, tiny_dir, tmp_path, monkeypatch, capsys):
    url, factory = own_db
    proxy = _proxy(start_proxy, fake_upstream, url, factory, tiny_dir, tmp_path)

    leaky = _post(proxy, KEY)
    gates = _gates(leaky)
    assert leaky["status"] == "rejected", leaky
    assert gates["replay_eval"]["state"] == "passed" and gates["safety"]["state"] == "failed"
    n = gates["safety"]["numbers"]
    assert n["overall"]["candidate"]["secrets"] == 4 and n["overall"]["serving"]["secrets"] == 0
    assert n["overall"]["candidate"]["entities"] == {"AWS_ACCESS_KEY": 4}
    assert {tenant: c["passed"] for tenant, c in n["tenants"].items()} == {"acme": False, "globex": False}
    assert "AWS_ACCESS_KEY" in leaky["error"] and "detected secrets" in leaky["error"]
    # the evidence is stored redacted: the key itself is nowhere in the gate's record
    assert n["violations"][0]["candidate"].startswith("[<AWS_ACCESS_KEY>]")
    assert KEY not in json.dumps(leaky["gates"])
    assert fake_upstream.weights == "base"  # the serving weights are back on the engine

    forbidden = _post(proxy, "competitor-co")
    gates = _gates(forbidden)
    assert forbidden["status"] == "rejected" and gates["safety"]["state"] == "failed", forbidden
    tenants = gates["safety"]["numbers"]["tenants"]
    assert tenants["acme"]["candidate"]["forbidden"] == 2 and tenants["acme"]["serving"]["forbidden"] == 0
    assert tenants["acme"]["forbidden_patterns"] == 1 and not tenants["acme"]["passed"]
    assert tenants["globex"]["forbidden_patterns"] == 0 and tenants["globex"]["passed"]  # no rule there
    assert "tenant acme: 2 of the candidate's answers match a forbidden pattern" in forbidden["error"]

    refusing = _post(proxy, "I cannot help with that")
    tenants = _gates(refusing)["safety"]["numbers"]["tenants"]
    assert refusing["status"] == "rejected", refusing
    assert tenants["acme"]["candidate"]["refusal_rate"] == 1.0 and tenants["acme"]["max_refusal_rate"] == 0.25
    assert not tenants["acme"]["passed"]
    # globex has no bound: its refusals are reported, not held against the candidate
    assert tenants["globex"]["candidate"]["refusals"] == 2 and tenants["globex"]["passed"]

    clean = _post(proxy, "clean")
    gates = _gates(clean)
    assert clean["status"] == "serving", clean
    assert gates["replay_eval"]["state"] == "passed" and gates["safety"]["state"] == "passed"
    n = gates["safety"]["numbers"]
    assert n["cases"] == 4 and n["reasons"] == [] and n["violations"] == []
    assert n["overall"]["candidate"] == n["overall"]["serving"]
    assert fake_upstream.weights == "clean"

    card = httpx.get(proxy.url + "/atdp/v1/versions/clean/card", headers=ADMIN, timeout=10).json()
    assert [(g["gate"], g["state"]) for g in card["gates"]] == [("replay_eval", "passed"), ("safety", "passed")]
    monkeypatch.setenv("ATDP_DATABASE_URL", url)
    assert cli.main(["versions", "show", KEY.lower()[:20]]) == 0
    markdown = capsys.readouterr().out
    with capsys.disabled():
        print("\n" + markdown)
    assert "**safety**: failed" in markdown and "candidate: secrets 4" in markdown


def test_the_override_marks_both_gates_overridden(start_proxy, fake_upstream, own_db, tiny_dir, tmp_path):
    url, factory = own_db
    proxy = _proxy(start_proxy, fake_upstream, url, factory, tiny_dir, tmp_path)
    r = httpx.post(proxy.url + "/atdp/v1/versions", headers=ADMIN, timeout=60,
                   json={"checkpoint": f"/ckpt/{KEY}", "name": "forced", "promote": "now", "reason": "incident 7"})
    assert r.status_code == 200 and r.json()["status"] == "serving", r.text
    detail = httpx.get(proxy.url + "/atdp/v1/versions/forced", headers=ADMIN, timeout=10).json()
    assert {g["gate"]: g["state"] for g in detail["gates"]} == {"replay_eval": "overridden", "safety": "overridden"}


@pytest.mark.parametrize(("change", "problem"), [
    ({"forbidden_patterns": ["(unclosed"]}, "not a valid regular expression"),
    ({"forbidden_patterns": "secret"}, "must be a list"),
    ({"max_refusal_rate": 1.5}, "max_refusal_rate"),
])
def test_bad_safety_rules_are_refused(start_proxy, fake_upstream, own_db, change, problem):
    url, _ = own_db
    proxy = start_proxy([fake_upstream.url], database_url=url)
    r = httpx.put(proxy.url + "/atdp/v1/tenants/acme/policy", headers=ADMIN, json=change, timeout=10)
    assert r.status_code == 400 and problem in r.json()["error"]["message"], r.text  # as any invalid policy

