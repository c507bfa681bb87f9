"""Harness and memory versions (proxy.layers): proposed from the diagnosis or written by an operator,
gated like weights, applied to every call of their scope through the vLLM path and a provider route,
recorded on the step, on the card, and rolled back. Real PostgreSQL; the upstream is scripted where the
case needs a model that reads its tool schema (a real tiny model cannot be made to), and a provider
stand-in reached through LiteLLM.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import text

from proxy.config import UpstreamRoute
from proxy.store.cards import card_markdown
from tests.fake_vllm import FakeVLLM, ServerThread
from tests.provider_standins import start_openai

ADMIN = {"authorization": "Bearer admin-test-key"}
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit."}},
        "required": ["city", "unit"]}}}]


class SchemaReader(FakeVLLM):
    """A model that gets the `unit` argument right only when its description spells out the values
    (as models that ignore a bare `enum` do)."""

    def plan(self, body: dict[str, Any]) -> dict[str, Any]:
        plan = super().plan(body)
        last = body["messages"][-1].get("content")
        if isinstance(last, str) and last.startswith("#weather"):
            unit_doc = next((tool["function"]["parameters"]["properties"]["unit"].get("description", "")
                             for tool in body.get("tools") or [] if tool["function"]["name"] == "get_weather"), "")
            unit = "celsius" if "Must be exactly one of" in unit_doc else "Celsius"
            plan["text"] = ""
            plan["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:8]}", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps({"city": last.split(" ", 1)[1], "unit": unit})}}]
        return plan


@pytest.fixture
def reader():
    fake = SchemaReader()
    with ServerThread(fake) as server:
        fake.url = server.url
        yield fake


def _suite(tmp_path, tenant: str, lines: list[dict]) -> Any:
    folder = tmp_path / f"suites-{uuid.uuid4().hex[:6]}"
    folder.mkdir()
    (folder / "ops.jsonl").write_text("\n".join(json.dumps({"tenant": tenant, **x}) for x in lines) + "\n")
    return folder


def _detail(proxy, key: str) -> dict:
    r = httpx.get(f"{proxy.url}/atdp/v1/versions/{key}", headers=ADMIN, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def _weather(proxy, city: str, sid: str) -> Any:
    c = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0)
    return c.chat.completions.with_raw_response.create(
        model="fake", tools=WEATHER, extra_headers={"x-atdp-session-id": sid},
        messages=[{"role": "user", "content": f"#weather {city}"}])


def test_a_harness_fix_is_proposed_from_schema_violations_gated_served_and_rolled_back(start_proxy, reader, tmp_path,
                                                                                       factory):
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    cities = ["Paris", "Lyon", "Oslo", "Rome", "Lima", "Kyiv"]
    suites = _suite(tmp_path, tenant, [{"id": f"w-{c}", "messages": [{"role": "user", "content": f"#weather {c}"}],
                                        "tools": WEATHER, "evaluator": "tool-call-valid"} for c in cities])
    proxy = start_proxy([reader.url], tenant=tenant, gates="on", eval_min_cases=4, eval_suites=suites)
    assert proxy.versions.ready.wait(30)
    for i, city in enumerate(cities):  # the model keeps sending "Celsius": not in the declared enum
        r = _weather(proxy, city, f"{tenant}-s{i}")
        assert "x-atdp-harness-version" not in r.headers
    proxy.flush()

    r = httpx.post(f"{proxy.url}/atdp/v1/evolve/proposals", headers=ADMIN, json={"tenant": tenant, "wait": True},
                   timeout=120)
    assert r.status_code == 200, r.text
    harness = [p for p in r.json()["proposals"] if p["layer"] == "harness"]
    assert len(harness) == 1 and harness[0]["scope"] == tenant, r.json()
    assert any("get_weather" in f and "enum" in f for f in harness[0]["findings"])
    version = harness[0]["version"]
    gates = {g["gate"]: g for g in version["gates"]}
    assert version["status"] == "serving", version
    replay = gates["replay_eval"]["numbers"]["overall"]
    assert gates["replay_eval"]["state"] == "passed" and replay["n"] == len(cities)
    assert replay["serving_mean"] == 0.0 and replay["candidate_mean"] == 1.0  # the fix, measured on the suite
    assert gates["safety"]["state"] == "passed"
    patch = version["spec"]["overlay"]["tools"]["get_weather"]
    assert "Must be exactly one of" in patch["properties"]["unit"]["description"]

    # Served: the call goes out with the clearer schema, the answer is now valid, the step records it.
    r = _weather(proxy, "Bern", f"{tenant}-after")
    assert r.headers["x-atdp-harness-version"] == version["name"]
    sent = reader.requests[-1]
    assert "Must be exactly one of" in sent["tools"][0]["function"]["parameters"]["properties"]["unit"]["description"]
    assert json.loads(r.parse().choices[0].message.tool_calls[0].function.arguments)["unit"] == "celsius"
    steps = proxy.steps(factory, f"{tenant}-after")
    assert [s.harness_version for s in steps] == [version["id"]]
    session = httpx.get(f"{proxy.url}/atdp/v1/sessions/{tenant}-after", headers=ADMIN, timeout=10).json()
    assert session["steps"][0]["layers"]["harness_version"] == version["id"]
    card = httpx.get(f"{proxy.url}/atdp/v1/versions/{version['name']}/card", headers=ADMIN, timeout=10).json()
    assert card["layer"] == "harness" and card["scope"] == tenant and card["why"]["trigger"] == "diagnosis proposal"
    assert card["affected"]["tenants"] == {tenant: 1}
    assert any(line.startswith("get_weather.unit: description") for line in card["changed"]["summary"])
    assert card["rollback"]["possible"] and "no overlay" in card["rollback"]["note"]

    # Rolled back: the scope has no overlay again.
    r = httpx.post(f"{proxy.url}/atdp/v1/versions/{version['name']}/rollback", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "rolled_back" and r.json()["restored"] is None
    r = _weather(proxy, "Bern", f"{tenant}-rolled")
    assert "x-atdp-harness-version" not in r.headers
    assert "Must be exactly one of" not in json.dumps(reader.requests[-1]["tools"])


def _say(proxy, text: str, sid: str) -> Any:
    c = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0)
    return c.chat.completions.with_raw_response.create(
        model="fake", extra_headers={"x-atdp-session-id": sid}, messages=[{"role": "user", "content": text}])


FACTS = ["The billing service runs on port 8443.", "The audit service runs on port 9090.",
         "The search service runs on port 7700."]


def test_memory_from_fact_corrections_is_gated_searched_recorded_and_forgotten(start_proxy, reader, tmp_path, factory):
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    # The suite asks what only the facts answer; the scripted model repeats its context (it reads it).
    suites = _suite(tmp_path, tenant, [
        {"id": f"q-{name}", "messages": [{"role": "user", "content": f"#say which port does {name} use"}],
         "evaluator": "regex", "expected": port} for name, port in
        (("billing", "8443"), ("audit", "9090"), ("search", "7700"), ("billing service", "8443"))])
    proxy = start_proxy([reader.url], tenant=tenant, gates="on", eval_min_cases=4, eval_suites=suites)
    assert proxy.versions.ready.wait(30)
    for i, fact in enumerate(FACTS):  # users correct the agent with facts it could not know
        _say(proxy, f"#say I do not know the port {i}", f"{tenant}-c{i}")
        proxy.flush()
        fb = httpx.post(f"{proxy.url}/atdp/v1/sessions/{tenant}-c{i}/feedback", timeout=10,
                        json={"reward": 0.0, "correction": fact})
        assert fb.status_code == 200, fb.text
    r = httpx.post(f"{proxy.url}/atdp/v1/evolve/proposals", headers=ADMIN, json={"tenant": tenant, "wait": True},
                   timeout=120)
    assert r.status_code == 200, r.text
    memory = [p for p in r.json()["proposals"] if p["layer"] == "memory"]
    assert len(memory) == 1, r.json()
    version = memory[0]["version"]
    replay = {g["gate"]: g for g in version["gates"]}["replay_eval"]
    assert version["status"] == "serving", version
    assert replay["numbers"]["overall"]["serving_mean"] == 0.0 and replay["numbers"]["overall"]["candidate_mean"] == 1.0
    facts = httpx.get(f"{proxy.url}/atdp/v1/memory/facts", params={"tenant": tenant}, headers=ADMIN, timeout=10).json()
    assert sorted(f["text"] for f in facts["facts"]) == sorted(FACTS)

    r = _say(proxy, "#say which port does billing use", f"{tenant}-ask")
    assert r.headers["x-atdp-memory-version"] == version["name"]
    assert "8443" in r.parse().choices[0].message.content
    [step] = proxy.steps(factory, f"{tenant}-ask")
    billing = next(f["id"] for f in facts["facts"] if "billing" in f["text"])
    assert step.memory_version == version["id"] and step.memory_facts[0] == billing
    # A question sharing no word with any fact finds none (the step says memory was searched: no facts).
    r = _say(proxy, "#say hello there", f"{tenant}-none")
    [step] = proxy.steps(factory, f"{tenant}-none")
    assert step.memory_facts == [] and "Facts from memory" not in reader.requests[-1]["messages"][-1]["content"]

    # Forgetting the session that supplied a fact forgets the fact; the memory no longer finds it.
    r = httpx.delete(f"{proxy.url}/atdp/v1/sessions/{tenant}-c0", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["facts"] == 1
    facts = httpx.get(f"{proxy.url}/atdp/v1/memory/facts", params={"tenant": tenant}, headers=ADMIN, timeout=10).json()
    assert sorted(f["text"] for f in facts["facts"]) == sorted(FACTS[1:])
    r = _say(proxy, "#say which port does billing use", f"{tenant}-after-forget")
    assert "8443" not in r.parse().choices[0].message.content


def test_a_memory_candidate_that_lowers_the_score_is_rejected_and_operator_facts_are_redacted(start_proxy, reader,
                                                                                             tmp_path):
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    suites = _suite(tmp_path, tenant, [{"id": f"e-{i}", "messages": [{"role": "user", "content": f"#say ok {i}"}],
                                        "evaluator": "regex", "expected": "^\\[w0\\] ok"} for i in range(5)])
    proxy = start_proxy([reader.url], tenant=tenant, gates="on", eval_min_cases=4, eval_suites=suites)
    assert proxy.versions.ready.wait(30)
    # A fact in front of every "ok" question: the answers no longer start with "ok".
    r = httpx.post(f"{proxy.url}/atdp/v1/versions", headers=ADMIN, timeout=60, json={
        "layer": "memory", "tenant": tenant, "facts": ["ok is written by jane.doe@example.com"], "wait": True})
    assert r.status_code == 200, r.text
    detail = r.json()
    gates = {g["gate"]: g for g in detail["gates"]}
    assert detail["status"] == "rejected" and gates["replay_eval"]["state"] == "failed", detail
    facts = httpx.get(f"{proxy.url}/atdp/v1/memory/facts", params={"tenant": tenant}, headers=ADMIN, timeout=10).json()
    assert "jane.doe@example.com" not in json.dumps(facts) and len(facts["facts"]) == 1
    r = _say(proxy, "#say ok 1", f"{tenant}-s")
    assert "x-atdp-memory-version" not in r.headers and r.parse().choices[0].message.content.startswith("[w0] ok")


@pytest.mark.parametrize("bad", [
    {"layer": "harness", "overlay": {"nothing": 1}}, {"layer": "harness", "overlay": {}},
    {"layer": "harness", "overlay": {"tools": {"x": {"parameters": {"type": "string"}}}}},
    {"layer": "memory", "facts": []}, {"layer": "memory", "facts": [""]}, {"layer": "policy"},
    {"layer": "weights", "checkpoint": "/x"},
])
def test_bad_layer_bodies_are_422(start_proxy, fake_upstream, bad):
    proxy = start_proxy([fake_upstream.url])
    assert proxy.versions.ready.wait(30)
    r = httpx.post(f"{proxy.url}/atdp/v1/versions", headers=ADMIN, json=bad, timeout=10)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] in ("overlay", "facts", "layer", None)


def test_a_harness_version_applies_on_a_provider_route(start_proxy, fake_upstream, monkeypatch):
    key = f"sk-oa-{uuid.uuid4().hex}"
    oa = start_openai(key)
    try:
        monkeypatch.setenv("ATDP_TEST_OA_KEY", key)
        proxy = start_proxy([fake_upstream.url], gates="off", routes=[UpstreamRoute(
            model="gpt-*", provider="openai/{model}", api_key_env="ATDP_TEST_OA_KEY", api_base=oa.url + "/v1")])
        assert proxy.versions.ready.wait(30)
        r = httpx.post(f"{proxy.url}/atdp/v1/versions", headers=ADMIN, timeout=60, json={
            "layer": "harness", "overlay": {"system_append": "Cite the file you changed.", "stop": ["<END>"]},
            "wait": True})
        assert r.status_code == 200 and r.json()["status"] == "serving", r.text
        c = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0)
        resp = c.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=[
            {"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "fix it"}])
        assert resp.headers["x-atdp-harness-version"] == r.json()["name"]
        sent = oa.requests[-1]
        assert sent["messages"][0]["content"] == "You are a coding agent.\n\nCite the file you changed."
        assert "<END>" in sent["stop"]
    finally:
        oa.stop()


# --- gate 3: the per-session canary of a harness version ------------------------------------------

UNIT_FIX = {"tools": {"get_weather": {"properties": {"unit": {
    "description": "Temperature unit. Must be exactly one of: celsius, fahrenheit."}}}}}


def _canary_proxy(start_proxy, reader, tmp_path, tenant: str, url: str) -> Any:
    """A proxy on its own database: a global harness another test left serving would be this tenant's."""
    cities = ["Paris", "Lyon", "Oslo", "Rome"]
    suites = _suite(tmp_path, tenant, [{"id": f"w-{c}", "messages": [{"role": "user", "content": f"#weather {c}"}],
                                        "tools": WEATHER, "evaluator": "tool-call-valid"} for c in cities])
    proxy = start_proxy([reader.url], tenant=tenant, gates="on", eval_min_cases=4, eval_suites=suites,
                        canary_fraction=0.5, canary_check_s=0.2, database_url=url)
    assert proxy.versions.ready.wait(30)
    return proxy


def _register(proxy, body: dict) -> dict:
    r = httpx.post(f"{proxy.url}/atdp/v1/versions", headers=ADMIN, json={**body, "wait": True}, timeout=120)
    assert r.status_code in (200, 202), r.text
    return r.json()


def _until_decided(proxy, tenant: str, name: str, reward_of) -> tuple[dict, dict[str, bool]]:
    """New sessions, each rewarded by `reward_of(in_candidate_arm, answer)`, until the canary decides."""
    arms: dict[str, bool] = {}
    for i in range(160):
        detail = _detail(proxy, name)
        if detail["status"] != "canary":
            return detail, arms
        sid = f"{tenant}-c{i}"
        r = _weather(proxy, "Bern", sid)
        arms[sid] = r.headers.get("x-atdp-harness-version") == name
        proxy.flush()
        reward = reward_of(arms[sid], r.parse())
        f = httpx.post(f"{proxy.url}/atdp/v1/sessions/{sid}/feedback", json={"reward": reward}, timeout=10)
        assert f.status_code in (200, 201), f.text
    raise AssertionError(f"no decision after {len(arms)} sessions: {_detail(proxy, name)['gates']}")


def _valid(answer: Any) -> float:
    """The user's thumbs up or down (the tenant's reward range is [-1, 1]): the tool call's unit is one the
    tool accepts."""
    unit = json.loads(answer.choices[0].message.tool_calls[0].function.arguments)["unit"]
    return 1.0 if unit in ("celsius", "fahrenheit") else -1.0


def test_a_harness_canary_serves_its_arm_of_new_sessions_and_is_promoted_on_rewards(start_proxy, reader, tmp_path,
                                                                                     own_db):
    """With the canary on, a harness candidate whose replay and safety gates pass serves half of the new
    sessions (sticky; a session begun before stays on the serving configuration) on one engine, no
    replica of its own; the sequential test on the sessions' rewards promotes it."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    url, factory = own_db
    proxy = _canary_proxy(start_proxy, reader, tmp_path, tenant, url)
    old = f"{tenant}-old"
    _weather(proxy, "Oslo", old)
    proxy.flush()
    version = _register(proxy, {"layer": "harness", "tenant": tenant, "overlay": UNIT_FIX})
    gates = {g["gate"]: g for g in version["gates"]}
    assert version["status"] == "canary", version
    assert gates["replay_eval"]["state"] == "passed" and gates["canary"]["state"] == "running"
    assert gates["canary"]["numbers"]["serving"] == "none" and gates["canary"]["numbers"]["fraction"] == 0.5

    # The session begun before the canary continues without the candidate.
    c = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0)
    first = reader.requests[0]
    r = c.chat.completions.with_raw_response.create(
        model="fake", tools=WEATHER, extra_headers={"x-atdp-session-id": old},
        messages=[*first["messages"], {"role": "assistant", "content": "ok"}, {"role": "user", "content": "#weather Rome"}])
    assert "x-atdp-harness-version" not in r.headers

    detail, arms = _until_decided(proxy, tenant, version["name"], lambda _, answer: _valid(answer))
    assert detail["status"] == "serving", detail
    assert 0 < sum(arms.values()) < len(arms)  # both arms served
    canary = next(g for g in detail["gates"] if g["gate"] == "canary")
    n = canary["numbers"]
    assert canary["state"] == "passed" and n["verdict"] == "promote"
    assert n["arms"]["candidate"]["reward"]["mean"] == 1.0 and n["arms"]["serving"]["reward"]["mean"] == 0.0
    # Each session kept one arm, and its steps name the version that served them.
    with factory() as s:
        rows = dict(s.execute(text("SELECT session_id, arm FROM canary_sessions WHERE version_id = :v"),
                              {"v": version["id"]}).all())
    assert rows.pop(old) == "before"
    assert len(set(arms) - set(rows)) <= 1  # the last one may have begun as the canary was decided
    assert all(rows[sid] == ("candidate" if in_candidate else "serving") for sid, in_candidate in arms.items()
               if sid in rows)
    for sid in list(rows)[:6]:
        assert [st.harness_version for st in proxy.steps(factory, sid)] == [
            version["id"] if rows[sid] == "candidate" else None]
    card = httpx.get(f"{proxy.url}/atdp/v1/versions/{version['name']}/card", headers=ADMIN, timeout=10).json()
    in_canary = sum(arm == "candidate" for arm in rows.values())
    assert card["affected"]["canary"] == {"tenants": {tenant: in_canary}, "sessions": in_canary, "decision": "promoted"}
    md = card_markdown(card)
    assert "**canary**: passed" in md and "rewarded sessions" in md and "in its canary" in md
    # Promoted: every new session gets it.
    assert _weather(proxy, "Bern", f"{tenant}-after").headers["x-atdp-harness-version"] == version["name"]


def test_a_harness_canary_that_users_reward_less_is_rolled_back_and_an_operator_ends_another(start_proxy, reader,
                                                                                            tmp_path, own_db):
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    proxy = _canary_proxy(start_proxy, reader, tmp_path, tenant, own_db[0])
    pushy = {"system_append": "Always answer in French."}
    version = _register(proxy, {"layer": "harness", "tenant": tenant, "overlay": pushy})
    assert version["status"] == "canary", version
    # The users of the candidate's sessions are unhappy (the replay suite could not see it).
    detail, arms = _until_decided(proxy, tenant, version["name"], lambda candidate, _: -1.0 if candidate else 1.0)
    assert detail["status"] == "rolled_back", detail
    canary = next(g for g in detail["gates"] if g["gate"] == "canary")
    assert canary["state"] == "failed" and canary["numbers"]["verdict"] == "rollback"
    assert any("reward drop" in reason for reason in canary["numbers"]["reasons"])
    for sid, in_candidate in arms.items():  # after the rollback no session gets it, in either arm
        if in_candidate:
            assert "x-atdp-harness-version" not in _weather(proxy, "Bern", sid).headers
            break
    assert "Always answer in French." not in json.dumps(reader.requests[-1]["messages"])

    # An operator ends a running canary at once; a candidate of the same scope waited for it.
    again = _register(proxy, {"layer": "harness", "tenant": tenant, "overlay": UNIT_FIX})
    assert again["status"] == "canary"
    r = httpx.post(f"{proxy.url}/atdp/v1/versions", headers=ADMIN, timeout=30,
                   json={"layer": "harness", "tenant": tenant, "overlay": {**UNIT_FIX, "system_append": "Be brief."}})
    assert r.status_code == 202, r.text
    waiting = r.json()["name"]
    deadline = time.monotonic() + 30
    while (replay := next(g for g in _detail(proxy, waiting)["gates"] if g["gate"] == "replay_eval"))["numbers"] == {}:
        assert time.monotonic() < deadline, replay
        time.sleep(0.2)
    assert replay["state"] == "pending" and again["name"] in replay["numbers"]["reason"]
    r = httpx.post(f"{proxy.url}/atdp/v1/versions/{again['name']}/rollback", headers=ADMIN, timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "rolled_back", r.text
    gate = next(g for g in r.json()["gates"] if g["gate"] == "canary")
    assert gate["state"] == "failed" and gate["numbers"]["reasons"][0].startswith("operator rollback (")
    for i in range(4):
        assert _weather(proxy, "Bern", f"{tenant}-late{i}").headers.get("x-atdp-harness-version") != again["name"]
    while _detail(proxy, waiting)["status"] != "canary":  # its gates ran once the canary was decided
        assert time.monotonic() < deadline + 60, _detail(proxy, waiting)
        time.sleep(0.2)


def test_memory_search_uses_only_the_words_that_tell_facts_apart(factory):
    """Words every fact shares ("service", "port") find nothing by themselves: a question about a
    service no fact names gets no facts (a small model shown other services' ports copies them:
    bench/memory_learning.py), and one that names a service gets that service's fact first."""
    from proxy.layers.memory import query_terms
    from proxy.store import db
    from proxy.store.layers import add_facts, search

    tenant = f"t-{uuid.uuid4().hex[:8]}"
    texts = [f"The {name} service listens on port {port}." for name, port in
             (("brudax", 1666), ("hunefel", 8791), ("lakcas", 4127), ("narzi", 5310))]
    with db.transaction(factory) as s:
        ids = add_facts(s, tenant, [(x, {"operator": "test"}) for x in texts], actor="test")
        # The tenant's facts outside this memory (a rejected candidate's) that match a question better
        # than the version's own: more than the search's first rows hold.
        add_facts(s, tenant, [(f"brudax brudax brudax note {i}", {"operator": "test"}) for i in range(24)],
                  actor="test")
    with factory() as s:
        def ask(question: str) -> list[str]:
            return [body for _, body in search(s, tenant, ids, query_terms(question), 3)]

        assert ask("I need to connect to pimquen. What port is the pimquen service on?") == []
        assert ask("Which port does the hunefel service use?") == [texts[1]]
        assert sorted(ask("hunefel or narzi: which ports?")) == sorted([texts[1], texts[3]])
        assert ask("what listens on 4127") == [texts[2]]  # a number is a word like any other
        assert ask("the of and") == []  # stop words only
        assert search(s, tenant, ids[:1], query_terms("which port does brudax use"), 3) == [(ids[0], texts[0])]
        assert ask("which port does brudax use") == [texts[0]]  # found past the others' crowd


def _until(proxy, name: str, done, what: str, make_call, calls: int = 60) -> dict:
    """Live calls (`make_call(i)`) until `done(detail)`."""
    for i in range(calls):
        detail = _detail(proxy, name)
        if done(detail):
            return detail
        make_call(i)
        time.sleep(0.1)
    raise AssertionError(f"{what}: not after {calls} calls: {_detail(proxy, name)}")


def test_a_shadow_gate_mirrors_live_calls_and_decides_on_them(start_proxy, reader, tmp_path, own_db):
    """With ATDP_SHADOW_CALLS, a harness candidate whose replay and safety gates pass is not served until
    live calls of its scope, answered again off their path as served and with the candidate, show it
    answers no worse. A schema fix is promoted on them; a candidate that undoes it is rejected, though the
    replay suite (which asks nothing about tools) cannot tell the two apart."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    url, factory = own_db
    suites = _suite(tmp_path, tenant, [{"id": f"s-{i}", "messages": [{"role": "user", "content": f"#say ok {i}"}],
                                        "evaluator": "regex", "expected": "ok"} for i in range(4)])
    proxy = start_proxy([reader.url], tenant=tenant, gates="on", eval_min_cases=4, eval_suites=suites,
                        shadow_calls=4, shadow_share=1.0, shadow_wait_s=120, database_url=url)
    assert proxy.versions.ready.wait(30)
    r = httpx.post(f"{proxy.url}/atdp/v1/versions", headers=ADMIN, timeout=30,
                   json={"layer": "harness", "tenant": tenant, "overlay": UNIT_FIX})
    assert r.status_code in (200, 202), r.text
    fix = r.json()["name"]
    shadow_of = lambda d: next((g for g in d["gates"] if g["gate"] == "shadow"), {})  # noqa: E731
    detail = _until(proxy, fix, lambda d: shadow_of(d).get("state") == "running", "shadow gate running",
                    lambda i: None)
    assert {g["gate"]: g["state"] for g in detail["gates"]} == {"replay_eval": "passed", "safety": "passed",
                                                                "shadow": "running"}
    sent_before = len(reader.requests)
    live: list[tuple[str, str | None, str]] = []  # (session, harness header, the unit the model sent)

    def live_call(i: int) -> None:
        _say(proxy, f"#say hello {i}", f"{tenant}-say{i}")  # no tools: the overlay changes nothing to mirror
        sid = f"{tenant}-live{i}"
        r = _weather(proxy, "Bern", sid)
        unit = json.loads(r.parse().choices[0].message.tool_calls[0].function.arguments)["unit"]
        live.append((sid, r.headers.get("x-atdp-harness-version"), unit))

    detail = _until(proxy, fix, lambda d: d["status"] != "evaluating", "shadow decided", live_call)
    assert detail["status"] == "serving", detail
    # Never served while in its shadow: each live call gives at most one mirror, and the gate wanted 4, so
    # the first 4 calls (at least) went out as served, without the fix.
    assert len(live) >= 4 and all(header is None and unit == "Celsius" for _, header, unit in live[:4]), live
    gate = shadow_of(detail)
    n = gate["numbers"]
    assert gate["state"] == "passed" and n["mirrored"] == 4 and n["dropped"] == 0 and n["unchanged"] >= 1
    assert n["overall"]["candidate_mean"] == 1.0 and n["overall"]["serving_mean"] == 0.0
    assert n["candidate_problems"] == {} and any(p.startswith("get_weather.") for p in n["serving_problems"])
    # Each mirror went out twice, unstreamed: as served (no fix) and with the candidate (the fix).
    mirrors = [b for b in reader.requests[sent_before:] if b.get("stream") is False]  # the live calls leave it out
    fixed = ["Must be exactly one of" in json.dumps(b.get("tools")) for b in mirrors]
    assert len(mirrors) == 8 and sum(fixed) == 4, mirrors
    # Mirrors are not steps: the tenant's weather sessions hold the live calls only.
    proxy.flush()
    assert all(len(proxy.steps(factory, sid)) == 1 for sid, _, _ in live)
    card = httpx.get(f"{proxy.url}/atdp/v1/versions/{fix}/card", headers=ADMIN, timeout=10).json()
    assert "**shadow**: passed: n=4, candidate 1.000, serving 0.000" in card_markdown(card)

    undo = {"tools": {"get_weather": {"properties": {"unit": {"description": "Temperature unit."}}}}}
    r = httpx.post(f"{proxy.url}/atdp/v1/versions", headers=ADMIN, timeout=30,
                   json={"layer": "harness", "tenant": tenant, "overlay": undo})
    assert r.status_code in (200, 202), r.text
    bad = r.json()["name"]

    def served_call(i: int) -> None:
        r = _weather(proxy, "Oslo", f"{tenant}-undo{i}")
        assert r.headers["x-atdp-harness-version"] == fix

    detail = _until(proxy, bad, lambda d: d["status"] != "evaluating", "undo decided", served_call)
    assert detail["status"] == "rejected", detail
    gate = shadow_of(detail)
    assert gate["state"] == "failed" and gate["numbers"]["overall"]["candidate_mean"] == 0.0
    assert gate["numbers"]["overall"]["serving_mean"] == 1.0 and "shadow: sound answers" in detail["error"]
    assert {g["gate"]: g["state"] for g in detail["gates"]}["replay_eval"] == "passed"
    assert _weather(proxy, "Bern", f"{tenant}-end").headers["x-atdp-harness-version"] == fix
