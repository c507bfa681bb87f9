"""Gate 3, the canary, on real engines: two vLLM servers (CPU, the tiny model) as two replica groups,
the proxy in front, PostgreSQL behind, the official OpenAI SDK as the agent.

The tests drive the rewards themselves, through the feedback API (`POST .../feedback`), as an
evaluator or a user would: that is what makes a candidate "good" or its live reward "drop" here.
- a good candidate (the base weights moved as training moves them) passes to canary, serves only
  its share of new sessions (sticky: every step of a session has one version, the one its arm
  serves), and is promoted once the sequential test shows it is not worse (every session rewarded
  1.0, whichever version served it; promote margin 0.25 so a few dozen sessions suffice);
- a candidate whose sessions are rewarded -1 while the serving version's get +1 is rolled back
  automatically, while other traffic keeps flowing: 0 failed calls.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from sqlalchemy import select

from proxy.store import tables as t

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]  # a second engine starts; 2 shared cores
ADMIN = {"authorization": "Bearer admin-test-key"}
MAX_SESSIONS = 240


@pytest.fixture(scope="module")
def second_vllm(vllm_python: str, tiny_model_dir: Path):
    """A second engine with the same base weights: the canary's own replica group."""
    from proxy.demo.vllm import VLLMServer
    from tests.vllm_fixtures import SERVED_NAME

    server = VLLMServer(python=vllm_python, model_dir=tiny_model_dir, served_name=SERVED_NAME,
                        extra_args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    server.start()
    try:
        server.wait_ready(timeout=600)
        yield server
    finally:
        server.stop()


def _restore(*urls: str, model_dir: Path) -> None:
    from tests.vllm_fixtures import swap_weights

    for url in urls:  # the first server is shared by the test session: it serves the base again
        if httpx.get(url + "/weight_info", timeout=10).json().get("weight_version") != "base":
            swap_weights(url, model_dir, "base")


def _session(client: openai.OpenAI, sid: str, turns: int = 2) -> None:
    """A short conversation: each turn sends the history back, like an agent does."""
    messages = [{"role": "user", "content": f"hello {sid}"}]
    for turn in range(turns):
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                           extra_headers={"x-atdp-session-id": sid})
        messages += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                     {"role": "user", "content": f"and {turn}?"}]


def _reward(proxy, sid: str, value: float) -> None:
    r = httpx.post(f"{proxy.url}/atdp/v1/sessions/{sid}/feedback", json={"reward": value, "source": "evaluator"},
                   timeout=60)
    assert r.status_code in (200, 201), r.text


def _versions_by_session(factory, tenant: str) -> dict[str, set[str]]:
    with factory() as s:
        rows = s.execute(select(t.Session.external_id, t.Step.model_version)
                         .join(t.Step, t.Step.session_id == t.Session.id).where(t.Session.tenant_id == tenant)).all()
    out: dict[str, set[str]] = {}
    for sid, version in rows:
        out.setdefault(sid, set()).add(version)
    return out


def _arms(factory, version_id: str) -> dict[str, str]:
    with factory() as s:
        return dict(s.execute(select(t.CanarySession.session_id, t.CanarySession.arm)
                              .where(t.CanarySession.version_id == version_id)).all())


def _status(proxy, name: str) -> dict:
    return httpx.get(f"{proxy.url}/atdp/v1/versions/{name}", headers=ADMIN, timeout=30).json()


def _settled(proxy, name: str, rewarded: int, timeout: float = 300.0) -> str:
    """Wait until the monitor has checked the test after the latest reward (the gate shows it), or has
    decided; returns the status. So no session of the loop starts while a decision is on its way."""
    deadline = time.monotonic() + timeout
    while True:
        detail = _status(proxy, name)
        gate = next((g for g in detail["gates"] if g["gate"] == "canary"), None)
        seen = (gate or {}).get("numbers", {}).get("observations", 0)
        if detail["status"] != "canary" or (seen >= rewarded and proxy.state.canary.active is not None):
            return detail["status"]
        assert time.monotonic() < deadline, f"the monitor did not check after reward {rewarded}: {detail}"
        time.sleep(0.1)


def test_good_candidate_canaries_on_its_share_sticky_and_is_promoted(start_proxy, vllm_server, second_vllm, own_db,
                                                                    tmp_path):
    from tests.vllm_fixtures import trained_looking_checkpoint

    url, factory = own_db
    cand = trained_looking_checkpoint(vllm_server.model_dir, tmp_path / "good")
    proxy = start_proxy([vllm_server.base_url, second_vllm.base_url], database_url=url, canary_fraction=0.5,
                        canary_replicas=1, canary_promote_margin=0.25, canary_check_s=0.5)
    assert proxy.versions.ready.wait(60)
    client = openai.OpenAI(base_url=proxy.v1, api_key="open-mode", max_retries=0)
    try:
        # A session that began (and was stored) before the canary keeps the serving version to its end.
        _session(client, "pre", turns=1)
        proxy.flush()
        r = httpx.post(proxy.url + "/atdp/v1/versions", json={"checkpoint": str(cand), "name": "good", "wait": True},
                       headers=ADMIN, timeout=300)
        assert r.status_code == 200 and r.json()["status"] == "canary", r.text
        version_id = r.json()["id"]
        listing = httpx.get(proxy.url + "/atdp/v1/versions", headers=ADMIN, timeout=30).json()
        assert sorted(rep["version"] for rep in listing["replicas"]) == ["base", "good"] and listing["canary"] == "good"
        _session(client, "pre", turns=1)  # continues (history sent back): not a new session

        n = 0
        status = "canary"
        while status == "canary" and n < MAX_SESSIONS:
            sid = f"s{n}"
            _session(client, sid)
            proxy.flush()
            _reward(proxy, sid, 1.0)  # the test's evaluator: every session is fine, whatever served it
            n += 1
            status = _settled(proxy, "good", n)
        detail = _status(proxy, "good")
        gate = next(g for g in detail["gates"] if g["gate"] == "canary")
        numbers = gate["numbers"]
        print(f"promoted after {n} sessions (decided at reward {numbers['decided_at_observation']}, promotion "
              f"{numbers['promotion']}):", numbers["difference"]["reward"], numbers["arms"])
        assert detail["status"] == "serving" and gate["state"] == "passed", detail
        assert numbers["verdict"] == "promote" and numbers["promotion"]["ok"]

        proxy.flush()
        arms = _arms(factory, version_id)
        served = _versions_by_session(factory, proxy.tenant)
        assert arms["pre"] == "before" and served["pre"] == {"base"}
        new = [f"s{i}" for i in range(n)]
        assert all(arms[sid] in ("candidate", "serving") for sid in new)
        for sid in new:  # sticky, and the version is the arm's
            assert served[sid] == {"good" if arms[sid] == "candidate" else "base"}, (sid, arms[sid], served[sid])
        share = sum(arms[sid] == "candidate" for sid in new) / n
        assert 0.3 < share < 0.7, share  # its share of new sessions (fraction 0.5)
        # Promoted: every replica serves the candidate, new sessions get it.
        listing = httpx.get(proxy.url + "/atdp/v1/versions", headers=ADMIN, timeout=30).json()
        assert [rep["version"] for rep in listing["replicas"]] == ["good", "good"] and listing["canary"] is None
        _session(client, "after", turns=1)
        proxy.flush()
        assert _versions_by_session(factory, proxy.tenant)["after"] == {"good"}
        card = httpx.get(proxy.url + "/atdp/v1/versions/good/card", headers=ADMIN, timeout=30).json()
        in_canary = sum(arms[sid] == "candidate" for sid in new)
        assert card["affected"]["canary"] == {"tenants": {proxy.tenant: in_canary}, "sessions": in_canary,
                                              "decision": "promoted"}
        assert card["affected"]["full"] == {"tenants": {proxy.tenant: 1}, "sessions": 1}  # "after"
        from proxy.store.cards import card_markdown

        print(card_markdown(card))
    finally:
        _restore(vllm_server.base_url, second_vllm.base_url, model_dir=vllm_server.model_dir)


def test_canary_whose_reward_drops_is_rolled_back_with_no_failed_call(start_proxy, vllm_server, second_vllm, own_db,
                                                                      tiny_model_dir_b):
    url, factory = own_db
    proxy = start_proxy([vllm_server.base_url, second_vllm.base_url], database_url=url, canary_fraction=0.5,
                        canary_replicas=1, canary_check_s=0.5)
    assert proxy.versions.ready.wait(60)
    client = openai.OpenAI(base_url=proxy.v1, api_key="open-mode", max_retries=0)
    failures: list[str] = []
    calls = [0]
    stop = threading.Event()

    def background() -> None:  # other traffic all along, through the rollback's swap
        bg = openai.OpenAI(base_url=proxy.v1, api_key="open-mode", max_retries=0)
        i = 0
        while not stop.is_set():
            try:
                _session(bg, f"bg{i}", turns=1)
                calls[0] += 1
            except Exception as e:  # counted, not raised: the assertion below reports them
                failures.append(f"{type(e).__name__}: {e}")
            i += 1

    try:
        r = httpx.post(proxy.url + "/atdp/v1/versions",
                       json={"checkpoint": str(tiny_model_dir_b), "name": "drop", "wait": True},
                       headers=ADMIN, timeout=300)
        assert r.status_code == 200 and r.json()["status"] == "canary", r.text
        version_id = r.json()["id"]
        worker = threading.Thread(target=background, daemon=True)
        worker.start()
        n = 0
        status = "canary"
        while status == "canary" and n < MAX_SESSIONS:
            sid = f"s{n}"
            _session(client, sid)
            proxy.flush()
            (version,) = _versions_by_session(factory, proxy.tenant)[sid]
            _reward(proxy, sid, -1.0 if version == "drop" else 1.0)  # the candidate's sessions go badly
            n += 1
            status = _settled(proxy, "drop", n)
        for k in range(3):  # traffic after the decision, too
            _session(client, f"late{k}")
        stop.set()
        worker.join(120)
        detail = _status(proxy, "drop")
        gate = next(g for g in detail["gates"] if g["gate"] == "canary")
        numbers = gate["numbers"]
        print(f"rolled back after {n} sessions ({calls[0]} background calls):", numbers["reasons"],
              numbers["difference"]["reward"], numbers["rollback"])
        assert detail["status"] == "rolled_back" and gate["state"] == "failed", detail
        assert numbers["verdict"] == "rollback" and "reward drop" in numbers["reasons"][0]
        assert numbers["rollback"]["ok"]
        assert failures == [] and calls[0] > 0, failures  # 0 failed calls
        listing = httpx.get(proxy.url + "/atdp/v1/versions", headers=ADMIN, timeout=30).json()
        assert [rep["version"] for rep in listing["replicas"]] == ["base", "base"]
        proxy.flush()
        arms = _arms(factory, version_id)
        served = _versions_by_session(factory, proxy.tenant)
        for sid in (f"s{i}" for i in range(n)):
            assert served[sid] == {"drop" if arms[sid] == "candidate" else "base"}, (sid, arms[sid], served[sid])
        for sid in ("late0", "late1", "late2"):
            assert served[sid] == {"base"}
    finally:
        stop.set()
        _restore(vllm_server.base_url, second_vllm.base_url, model_dir=vllm_server.model_dir)
