"""`atdp export`: ATDP JSON, JSONL samples and Parquet from sessions captured through the real proxy."""

from __future__ import annotations

import io
import json
from pathlib import Path

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


# --- ATIF ------------------------------------------------------------------------------------------

ATIF_SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "data" / "atif-v1.4.schema.json").read_text())


def check_atif(traj: dict) -> None:
    """The vendored ATIF v1.4 schema, and the RFC's cross-field rules Harbor's models check."""
    jsonschema.Draft202012Validator(ATIF_SCHEMA, format_checker=jsonschema.FormatChecker()).validate(traj)
    assert [st["step_id"] for st in traj["steps"]] == list(range(1, len(traj["steps"]) + 1))
    for st in traj["steps"]:
        if st["source"] != "agent":
            assert not {"model_name", "reasoning_content", "tool_calls", "metrics"} & set(st)
        calls = {c["tool_call_id"] for c in st.get("tool_calls", [])}
        for r in st.get("observation", {}).get("results", []):
            assert r.get("source_call_id") is None or r["source_call_id"] in calls


def test_atif_trajectories_validate_and_carry_tokens(recorded, capsysbinary, fake_upstream):
    proxy, (a, b, c), steps = recorded
    lines = run_cli(capsysbinary, "--tenant", proxy.tenant, "--format", "atif").splitlines()
    trajs = [json.loads(x) for x in lines]
    assert [x["session_id"] for x in trajs] == [a, b, c]
    for traj in trajs:
        check_atif(traj)
        assert traj["schema_version"] == "ATIF-v1.4"
    ta = trajs[0]
    assert [st["source"] for st in ta["steps"]] == ["system", "user", "agent", "user", "agent", "user", "agent"]
    assert ta["steps"][0]["message"] == "You are a coding agent."
    agents = [st for st in ta["steps"] if st["source"] == "agent"]
    sent = [r for r in fake_upstream.requests if r["messages"][0]["content"] == "You are a coding agent."]
    for st, record, request in zip(agents, steps, sent[:3], strict=True):
        assert st["metrics"]["prompt_token_ids"] == list(render(request["messages"]))
        assert st["metrics"]["completion_token_ids"] == record.output_token_ids
        assert st["metrics"]["logprobs"] == pytest.approx(record.output_logprobs)
        assert st["metrics"]["completion_tokens"] == len(record.output_token_ids)
        assert st["extra"]["atdp"]["step_id"] == record.id and st["extra"]["atdp"]["model_version"] == record.model_version
        assert st["extra"]["atdp"]["governance"]["eligibility"] == "eligible"
    # Each tool result is the observation of the agent step whose call it answers.
    (call,) = agents[0]["tool_calls"]
    assert call["function_name"] == "read_file" and call["arguments"] == {"path": "f0.txt"}
    assert agents[0]["observation"]["results"] == [{"source_call_id": call["tool_call_id"], "content": "the notes say hi"}]
    assert agents[1]["observation"]["results"][0]["content"] == "2 passed"
    assert [st["extra"]["atdp"]["reward"] for st in agents] == [None, -0.4, None]
    assert ta["extra"]["atdp"]["reward"] == 0.8 and ta["extra"]["atdp"]["task_id"] == "fix-bug"
    assert ta["final_metrics"]["total_completion_tokens"] == sum(len(s.output_token_ids) for s in steps)
    # The failed step has no token ids: still an agent step, with its error as an extension.
    failed = [st for st in trajs[2]["steps"] if st["source"] == "agent"][-1]
    assert "completion_token_ids" not in failed["metrics"] and failed["extra"]["atdp"]["error"]["status_code"] == 400
    # One session: one line, a valid ATIF file on its own; --eligible leaves out c (nothing trainable).
    (one,) = run_cli(capsysbinary, "--session", b, "--tenant", proxy.tenant, "--format", "atif").splitlines()
    check_atif(json.loads(one))
    eligible = [json.loads(x) for x in run_cli(capsysbinary, "--tenant", proxy.tenant, "--format", "atif",
                                                   "--eligible").splitlines()]
    assert [x["session_id"] for x in eligible] == [a, b]


def test_atif_exports_the_redacted_store(start_proxy, fake_upstream, factory, monkeypatch, db_url, capsysbinary):
    monkeypatch.setenv("ATDP_DATABASE_URL", db_url)
    proxy = start_proxy([fake_upstream.url])
    sid = agent_session(proxy, tool_results=("customer maria.gonzalez@fastmail.com, card 4111 1111 1111 1111",))
    proxy.flush()
    out = run_cli(capsysbinary, "--session", sid, "--tenant", proxy.tenant, "--format", "atif").decode()
    check_atif(json.loads(out))
    assert "maria.gonzalez@fastmail.com" not in out and "4111 1111 1111 1111" not in out
    assert "<EMAIL_ADDRESS" in out and "<CREDIT_CARD" in out


def test_atif_mapping_of_other_message_shapes() -> None:
    """Anthropic blocks and Responses items flatten to ATIF strings; unknown-call results stay unlinked."""
    from datetime import UTC, datetime

    from atdp_schema import models as m
    from proxy.tools.export_atif import trajectory

    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    step = m.Step(
        id="st-1", session_id="s-1", seq=1, status="ok", model="fake",
        observation=m.Observation(
            api="messages", system=m.ContentRef(hash="h0", content=[{"type": "text", "text": "Be brief."}]),
            history_len=0,
            messages=[m.Message(hash="h1", role="developer", content="extra rules"),
                      m.Message(hash="h2", role="user", content=[{"type": "text", "text": "hi"}, {"type": "image"}]),
                      m.Message(hash="h3", role="user", content=[{"type": "tool_result", "tool_use_id": "toolu_x"}])],
            tool_results=[m.ToolResult(tool_call_id="toolu_x", content=[{"type": "text", "text": "ok"}])]),
        action=m.Action(text="", reasoning="think", tool_calls=[m.ToolCall(id="fc_1", name="run", arguments="not json")]),
        tokens=m.TokenRecord(source="none"), timings=m.Timings(started_at=now), usage=m.Usage(cost=0.5),
        governance=m.Governance(eligibility="audit_only"),
    )
    doc = m.Session(id="s-1", tenant="t", status="open", started_at=now, steps=[step])
    traj = trajectory(doc)
    check_atif(traj)
    assert [(st["source"], st["message"]) for st in traj["steps"]] == [
        ("system", "Be brief."), ("system", "extra rules"), ("user", 'hi\n{"type":"image"}'), ("system", ""),
        ("agent", "")]
    assert traj["steps"][3]["observation"] == {"results": [{"content": "ok"}]}  # its call is not in the export
    agent = traj["steps"][4]
    assert agent["tool_calls"][0]["arguments"] == {"_raw": "not json"} and agent["reasoning_content"] == "think"
    assert agent["metrics"]["extra"] == {"atdp_cost": 0.5} and traj["agent"] == {
        "name": "unknown", "version": "unknown", "model_name": "fake",
        "extra": {"atdp": {"note": "the client's own version is not recorded by the proxy"}}}
    assert traj["steps"][0]["timestamp"] == "2026-01-02T03:04:05Z"
