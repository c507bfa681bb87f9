"""The diagnosis's fast path (grouping in PostgreSQL, proxy.evolve.gather.TOOL_GROUPS and friends)
gives exactly the findings and stats of the reference path (every row read and counted in Python),
on the scenario stores seeded through the proxy and on the console's bulk-seeded store."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest

from proxy.evolve.diagnose import diagnose
from proxy.evolve.rules import Rules
from proxy.store import db
from tests.console_seed import seed as console_seed
from tests.diagnosis_seed import seed_harness, seed_memory, seed_policy, tenant_key

RULE_SETS = [Rules(), Rules(min_failures=1, spread_min_tenants=1, min_schema_violations=1),
             Rules(max_rows=7, examples=2), Rules(window_days=0.5, min_drift_steps=1, drift_psi=0.0)]


def _both(factory, rules: Rules, tenant: str | None) -> tuple[dict, dict]:
    now = datetime.now(UTC)
    with factory() as s:
        fast = diagnose(s, rules, tenant=tenant, now=now).to_dict()
        reference = diagnose(s, rules, tenant=tenant, now=now, reference=True).to_dict()
    return fast, reference


def test_fast_path_matches_the_reference_on_the_scenario_stores(new_database, start_proxy, fake_upstream):
    url = new_database("atdp_diagfast")
    db.upgrade(url)
    engine = db.make_engine(url)
    factory = db.session_factory(engine)
    proxy = start_proxy([fake_upstream.url], database_url=url)
    other = f"t-{uuid.uuid4().hex[:8]}"
    key = tenant_key(factory, other)
    seed_harness(proxy, other_key=key)
    seed_memory(proxy)
    seed_policy(proxy, other_key=key)
    proxy.flush()
    kinds = set()
    for rules in RULE_SETS:
        for tenant in (None, other):
            fast, reference = _both(factory, rules, tenant)
            assert fast == reference
            kinds |= {f["kind"] for f in fast["findings"]}
    # the comparison covers every tool rule and the corrections
    assert {"tool_failure_cluster", "schema_violation", "corrections"} <= kinds
    engine.dispose()


@pytest.mark.parametrize("rules", RULE_SETS[:2] + RULE_SETS[3:])
def test_fast_path_matches_the_reference_on_the_console_store(new_database, rules):
    url = new_database("atdp_diagfast")
    db.upgrade(url)
    engine = db.make_engine(url)
    console_seed(engine, sessions=600)
    factory = db.session_factory(engine)
    for tenant in (None, "globex"):
        fast, reference = _both(factory, rules, tenant)
        assert fast == reference
        assert fast["stats"]["tool_calls"] > 0 and fast["stats"]["rewards"]
    assert reference["stats"]["drift"] is not None  # the console store has a trained version: drift compared
    engine.dispose()
