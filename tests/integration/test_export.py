"""`atdp export`: ATDP JSON, JSONL samples and Parquet from sessions captured through the real proxy."""

from __future__ import annotations

import io
import json

import httpx
import jsonschema
import openai
import pyarrow.parquet as pq
import pytest
from sqlalchemy import select, update

import atdp_schema
from proxy.cli import main
from proxy.store import tables as t
from proxy.store.db import transaction
from proxy.tools.export import ExportFilter, export, iter_sessions
from tests.fake_vllm import render
from tests.session_builders import agent_session


@pytest.fixture
def recorded(start_proxy, fake_upstream, factory, monkeypatch, db_url):
    monkeypatch.setenv("ATDP_DATABASE_URL", db_url)
    proxy = start_proxy([fake_upstream.url])
    a = agent_session(proxy, tool_results=("the notes say hi", "2 passed"), task_id="fix-bug")
    b = agent_session(proxy, tool_results=(), final="#say plain answer")
    c = "s-failing-" + proxy.tenant
    with pytest.raises(openai.BadRequestError):  # an error step without tokens: kept, never eligible
        agent_session(proxy, session_id=c, tool_results=(), final="#fail400")
    proxy.flush()
    steps = proxy.steps(factory, a)
    httpx.post(f"{proxy.url}/atdp/v1/sessions/{a}/feedback", json={"reward": 0.8})
    httpx.post(f"{proxy.url}/atdp/v1/sessions/{a}/feedback", json={"reward": -0.4, "step_id": steps[1].id})
    return proxy, (a, b, c), steps


def run_cli(capsysbinary, *argv) -> bytes:
    assert main(["export", *argv]) == 0
    return capsysbinary.readouterr().out


def test_jsonl_samples_rebuild_full_prompts_and_carry_rewards(recorded, capsysbinary, fake_upstream):
    proxy, (a, b, c), steps = recorded
    lines = run_cli(capsysbinary, "--tenant", proxy.tenant, "--format", "jsonl").splitlines()
    samples = [json.loads(x) for x in lines]
    assert [s["session_id"] for s in samples] == [a, a, a, b, c]
    by_step = {s["step_id"]: s for s in samples}
    # Prompt ids are the full prompts vLLM saw (the fake renders one id per byte of the chat template).
    sent = [r for r in fake_upstream.requests if r["messages"][0]["content"] == "You are a coding agent."]
    for st, request in zip(steps, sent[:3], strict=True):
        sample = by_step[st.id]
        assert sample["prompt_ids"] == list(render(request["messages"]))
        assert sample["output_ids"] == st.output_token_ids
        assert sample["behaviour_logprobs"] == pytest.approx(st.output_logprobs)
        assert sample["versions"] == [st.model_version] * len(st.output_token_ids) and st.model_version
        assert sample["loss_mask"] == [1] * len(st.output_token_ids)
        assert sample["task_id"] == "fix-bug" and sample["token_source"] == "engine"
    assert steps[1].prompt_prefix_len > 0  # stored as a suffix, exported whole
    assert [by_step[st.id]["reward"] for st in steps] == [0.8, -0.4, 0.8]  # step reward wins over session reward
    assert samples[3]["reward"] is None
    assert samples[4]["eligibility"] in ("debug_only", "audit_only") and samples[4]["output_ids"] == []


def test_eligible_keeps_only_trainable_steps(recorded, capsysbinary):
    proxy, (a, b, c), steps = recorded
    samples = [json.loads(x) for x in run_cli(capsysbinary, "--tenant", proxy.tenant, "--format", "jsonl", "--eligible").splitlines()]
    assert [s["session_id"] for s in samples] == [a, a, a, b]
    assert all(s["eligibility"] == "eligible" and s["token_source"] in ("engine", "rederived") for s in samples)


def test_atdp_json_document_validates_and_filters(recorded, capsysbinary, factory):
    proxy, (a, b, c), steps = recorded
    with transaction(factory) as s:
        # What a trainer writes: its candidate version, the lineage, and the steps it trained on.
        s.add(t.ModelVersion(id=f"ver-{proxy.tenant}", name=f"v-{proxy.tenant}", checkpoint="/ckpt/1", status="candidate"))
        s.flush()
        s.add(t.VersionLineage(version_id=f"ver-{proxy.tenant}", step_id=steps[0].id, session_id=steps[0].session_id, reward=0.8))
        s.execute(update(t.Step).where(t.Step.id == steps[0].id).values(trained_version_id=f"ver-{proxy.tenant}"))
    doc = json.loads(run_cli(capsysbinary, "--tenant", proxy.tenant))
    jsonschema.validate(doc, atdp_schema.json_schema())
    assert [x["id"] for x in doc["sessions"]] == [a, b, c]
    assert doc["sessions"][0]["reward"] == 0.8 and len(doc["sessions"][0]["steps"]) == 3
    assert doc["sessions"][0]["steps"][0]["trained_in"] == [f"ver-{proxy.tenant}"]
    versions = {v["id"]: v for v in doc["versions"]}
    assert versions[f"ver-{proxy.tenant}"]["lineage"] == [steps[0].id]
    # Every version a step names (by id or name) and that is registered comes with the document.
    with factory() as s:
        registered = s.scalars(select(t.ModelVersion).where(t.ModelVersion.name == steps[0].model_version)).all()
    assert {v.id for v in registered} <= set(versions)
    one = json.loads(run_cli(capsysbinary, "--session", b, "--tenant", proxy.tenant))
    assert [x["id"] for x in one["sessions"]] == [b] and f"ver-{proxy.tenant}" not in {v["id"] for v in one["versions"]}
    eligible = json.loads(run_cli(capsysbinary, "--tenant", proxy.tenant, "--eligible"))
    jsonschema.validate(eligible, atdp_schema.json_schema())
    assert [x["id"] for x in eligible["sessions"]] == [a, b]  # c has no trainable step
    later = json.loads(run_cli(capsysbinary, "--tenant", proxy.tenant, "--since", "2999-01-01T00:00:00Z"))
    assert later["sessions"] == []


def test_parquet_has_the_jsonl_columns(recorded, capsysbinary, tmp_path):
    proxy, sessions, steps = recorded
    jsonl = [json.loads(x) for x in run_cli(capsysbinary, "--tenant", proxy.tenant, "--format", "jsonl").splitlines()]
    out = tmp_path / "samples.parquet"
    assert main(["export", "--tenant", proxy.tenant, "--format", "parquet", "--out", str(out)]) == 0
    table = pq.read_table(out)
    assert table.column_names == list(jsonl[0])
    rows = table.to_pylist()
    assert len(rows) == len(jsonl)
    for got, want in zip(rows, jsonl, strict=True):
        assert got["prompt_ids"] == want["prompt_ids"] and got["output_ids"] == want["output_ids"]
        assert got["loss_mask"] == want["loss_mask"] and got["versions"] == want["versions"]
        assert got["reward"] == want["reward"]  # float64 both ways (None stays None)
        assert got["behaviour_logprobs"] == pytest.approx(want["behaviour_logprobs"], abs=1e-6)
    assert main(["export", "--format", "parquet"]) == 2  # parquet needs a file


def test_every_export_is_audited(recorded, capsysbinary, factory, tmp_path):
    proxy, sessions, steps = recorded
    out = tmp_path / "x.jsonl"
    assert main(["export", "--tenant", proxy.tenant, "--format", "jsonl", "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 5
    with factory() as s:
        row = s.scalars(select(t.AuditEvent).where(t.AuditEvent.tenant_id == proxy.tenant, t.AuditEvent.action == "export")
                        .order_by(t.AuditEvent.id.desc())).first()
    assert row.actor == "cli" and row.target == str(out)
    assert row.details["format"] == "jsonl" and row.details["steps"] == 5 and row.details["sessions"] == 3
    assert row.details["filter"]["tenant"] == proxy.tenant


def test_export_streams_in_batches(recorded, factory):
    proxy, (a, b, c), steps = recorded
    with factory() as s:
        # Batches of one session: the keyset pagination must visit each session exactly once, in order.
        assert [x.external_id for x in iter_sessions(s, ExportFilter(tenant=proxy.tenant), batch_size=1)] == [a, b, c]
        buf = io.BytesIO()
        stats = export(s, ExportFilter(tenant=proxy.tenant), "jsonl", buf, policies=proxy.state.policies, batch_size=1)
        # Nothing of earlier sessions is held: the identity map is emptied after each session.
        assert len(s.identity_map) == 0
    assert (stats.sessions, stats.steps) == (3, 5) and len(buf.getvalue().splitlines()) == 5
