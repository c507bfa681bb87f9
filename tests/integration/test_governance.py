"""Governance in the running proxy: policy admin API, forget, retention, audit, eligibility, clean token ids."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from sqlalchemy import func, select, update

from proxy.cli import main as cli_main
from proxy.governance.tokens import ByteCodec, TokenGuard, find_tokenizer, load_codec
from proxy.store import tables as t
from proxy.store.tokens import full_prompt_ids

ADMIN = {"authorization": "Bearer admin-test-key"}
EMAIL, PHONE = "maria.gonzalez@fastmail.com", "+1 (415) 555-0132"


def chat(proxy, content, *, session=None, tenant=None, history=(), key=None):
    headers = {}
    if session:
        headers["x-atdp-session-id"] = session
    if tenant:  # the admin key acts for the tenant it names
        headers.update(ADMIN, **{"x-atdp-tenant": tenant})
    if key:
        headers["authorization"] = f"Bearer {key}"
    messages = [*history, {"role": "user", "content": content}]
    r = httpx.post(proxy.v1 + "/chat/completions", headers=headers, timeout=30,
                   json={"model": "fake", "messages": messages})
    assert r.status_code == 200, r.text
    return messages + [r.json()["choices"][0]["message"]]


def decoded(s, step, codec=ByteCodec()) -> tuple[str, str]:
    prompt = b"".join(codec.token_bytes(full_prompt_ids(s, step))).decode(errors="replace")
    return prompt, b"".join(codec.token_bytes(step.output_token_ids)).decode(errors="replace")


# --- policy API and audit ---------------------------------------------------------------------------


def test_policy_admin_api_is_validated_and_audited(start_proxy, fake_upstream):
    proxy = start_proxy([fake_upstream.url])
    url = f"{proxy.url}/atdp/v1/tenants/{proxy.tenant}/policy"
    r = httpx.get(url)  # open mode: the caller is this tenant, reading its own policy
    assert r.status_code == 200 and r.json()["policy"]["training_consent"] is True  # local mode: consent on
    assert httpx.get(f"{proxy.url}/atdp/v1/tenants/someone-else/policy").status_code == 403
    assert httpx.put(url, json={"retention_days": 7}).status_code == 401  # writing needs the admin key

    r = httpx.put(url, headers=ADMIN, json={"training_consent": False, "retention_days": 7})
    assert r.status_code == 200, r.text
    assert r.json()["policy"]["training_consent"] is False and r.json()["policy"]["retention_days"] == 7
    assert httpx.get(url, headers=ADMIN).json()["policy"]["retention_days"] == 7
    for bad in ({"retention_days": 0}, {"training_consnet": True}, {"secrets_eligibility": "fine"}, []):
        r = httpx.put(url, headers=ADMIN, json=bad)
        assert r.status_code == 400, (bad, r.text)
    assert httpx.get(url).json()["policy"]["retention_days"] == 7  # rejected changes changed nothing

    httpx.put(url, headers=ADMIN, json={"reward_combine": "mean"})
    audit = httpx.get(f"{proxy.url}/atdp/v1/audit", headers=ADMIN,
                      params={"tenant": proxy.tenant, "action": "policy.update"}).json()["data"]
    assert [a["details"]["changes"] for a in audit] == [
        {"reward_combine": "mean"}, {"training_consent": False, "retention_days": 7}]
    assert all(a["actor"] == "admin" for a in audit)
    page = httpx.get(f"{proxy.url}/atdp/v1/audit", headers=ADMIN, params={"tenant": proxy.tenant, "limit": 1}).json()
    assert len(page["data"]) == 1 and page["next_before"] == page["data"][0]["id"]
    rest = httpx.get(f"{proxy.url}/atdp/v1/audit", headers=ADMIN,
                     params={"tenant": proxy.tenant, "before": page["next_before"]}).json()
    assert rest["data"][0]["id"] < page["data"][0]["id"] and rest["next_before"] is None
    assert httpx.get(f"{proxy.url}/atdp/v1/audit").status_code == 401


# --- eligibility -------------------------------------------------------------------------------------


def test_eligibility_secrets_errors_and_consent(start_proxy, fake_upstream, factory):
    proxy = start_proxy([fake_upstream.url], tokenizer="bytes")
    chat(proxy, "#say deploy with key sk-proj-" + "a1B2c3D4" * 6, session="sec")
    r = httpx.post(proxy.v1 + "/chat/completions", headers={"x-atdp-session-id": "err"},
                   json={"model": "fake", "messages": [{"role": "user", "content": "#fail500"}]})
    assert r.status_code >= 500
    chat(proxy, "#say plain answer", session="ok")
    proxy.flush()  # a policy applies to steps written after it changes
    httpx.put(f"{proxy.url}/atdp/v1/tenants/{proxy.tenant}/policy", headers=ADMIN, json={"training_consent": False})
    chat(proxy, "#say after consent was withdrawn", session="noconsent")
    got = {st_session: (st.eligibility, st.eligibility_reason) for st_session, st in _by_session(proxy, factory)}
    assert got["sec"][0] == "quarantined" and "API_KEY" in got["sec"][1]
    assert got["err"][0] == "debug_only"
    assert got["ok"] == ("eligible", "ok")
    assert got["noconsent"] == ("audit_only", "no training consent")


def _by_session(proxy, factory):
    proxy.flush()
    with factory() as s:
        return list(s.execute(
            select(t.Session.external_id, t.Step).join(t.Step, t.Step.session_id == t.Session.id)
            .where(t.Session.tenant_id == proxy.tenant).order_by(t.Step.started_at)
        ).all())


# --- clean token ids ---------------------------------------------------------------------------------


def test_token_ids_are_rederived_and_masked_with_a_tokenizer(start_proxy, fake_upstream, factory):
    proxy = start_proxy([fake_upstream.url], tokenizer="bytes")
    history = chat(proxy, f"#say Sure, I will write to {EMAIL} or call {PHONE}.", session="conv")
    chat(proxy, "#say done", session="conv", history=history)
    with factory() as s:
        steps = [st for _, st in _by_session(proxy, factory)]
        assert len(steps) == 2 and steps[1].parent_step_id == steps[0].id
        for st in steps:
            assert st.token_source == "rederived"
            prompt, output = decoded(s, st)
            assert EMAIL not in prompt + output and PHONE not in prompt + output
            assert "<EMAIL_ADDRESS>" in prompt and "<PHONE_NUMBER>" in prompt
        first, second = steps
        # The output: placeholders' tokens are masked out of training, with logprob 0; the rest is the engine's.
        _, out = decoded(s, first)
        assert out == "[w0] Sure, I will write to <EMAIL_ADDRESS> or call <PHONE_NUMBER>."
        masked = [i for i, m in enumerate(first.output_mask) if m == 0]
        assert bytes(first.output_token_ids[i] for i in masked) == b"<EMAIL_ADDRESS><PHONE_NUMBER>"
        assert all(first.output_logprobs[i] == 0.0 for i in masked)
        assert len(first.output_logprobs) == len(first.output_token_ids) == sum(n for _, n in first.output_versions)
        # The second step's prompt replays the first's context: cleaned from memory, stored as a suffix.
        assert second.prompt_prefix_len > 0 and second.output_mask is None
        assert second.eligibility == "eligible"


def test_tokens_are_dropped_when_the_redacted_history_is_unknown(start_proxy, fake_upstream, factory):
    proxy = start_proxy([fake_upstream.url], tokenizer="bytes")
    history = chat(proxy, f"#say mail {EMAIL}", session="forgetful")
    proxy.flush()
    proxy.state.recorder.preparer.token_policy = TokenGuard(ByteCodec())  # as after a restart: nothing remembered
    proxy.state.recorder.preparer._context_redacted.clear()
    chat(proxy, "#say next", session="forgetful", history=history)
    steps = [st for _, st in _by_session(proxy, factory)]
    assert [st.token_source for st in steps] == ["rederived", "dropped"]
    assert steps[1].prompt_token_ids == [] and steps[1].output_token_ids == []
    assert steps[1].eligibility == "audit_only"


def test_without_a_tokenizer_dirty_tokens_are_dropped(start_proxy, fake_upstream, factory):
    # "none": left unset, the proxy would look for one at the serving version's checkpoint, which the
    # test session's database names after an earlier test served the tiny model (test_fuzz.py): then
    # the steps were cleaned with that tokenizer or not, as the look-up and the first step raced.
    proxy = start_proxy([fake_upstream.url], tokenizer="none")
    chat(proxy, f"#say mail {EMAIL}", session="a")
    chat(proxy, "#say clean", session="b")
    got = {sid: st for sid, st in _by_session(proxy, factory)}
    assert got["a"].token_source == "dropped" and got["a"].eligibility == "audit_only"
    assert got["b"].token_source == "engine" and got["b"].output_token_ids


def test_real_tokenizer_codec_matches_the_model(tiny_model_dir):
    codec = load_codec(str(tiny_model_dir))
    guard = TokenGuard(codec)
    text = f"<|im_start|>user\nMail {EMAIL}, call {PHONE}; naïve ∑ {json.dumps({'k': 'a' + chr(10) + EMAIL})}<|im_end|>"
    ids = codec.encode(text)
    assert b"".join(codec.token_bytes(ids)).decode() == text
    cleaned, spans = guard.clean(ids, [(EMAIL, "<EMAIL_ADDRESS>"), (PHONE, "<PHONE_NUMBER>")])
    out = b"".join(codec.token_bytes(cleaned)).decode()
    assert EMAIL not in out and PHONE not in out and len(spans) == 3
    assert out == text.replace(EMAIL, "<EMAIL_ADDRESS>").replace(PHONE, "<PHONE_NUMBER>")
    assert not guard.still_visible(cleaned, [(EMAIL, "")]) and guard.still_visible(ids, [(EMAIL, "")])


def test_real_engine_prompt_ids_are_rederived_by_default(start_proxy, vllm_server, factory):
    """No ATDP_TOKENIZER: the proxy finds the served model's tokenizer from the engine's /v1/models root."""
    from tokenizers import Tokenizer

    proxy = start_proxy([vllm_server.base_url])
    assert proxy.versions.ready.wait(60)
    r = httpx.post(proxy.v1 + "/chat/completions", headers={"x-atdp-session-id": "real"}, timeout=120, json={
        "model": vllm_server.model, "max_tokens": 8,
        "messages": [{"role": "user", "content": f"Write to {EMAIL} or call {PHONE} today."}]})
    assert r.status_code == 200, r.text
    [(_, step)] = _by_session(proxy, factory)
    assert step.token_source == "rederived" and step.output_token_ids
    tok = Tokenizer.from_file(str(vllm_server.model_dir / "tokenizer.json"))
    prompt = tok.decode(step.prompt_token_ids, skip_special_tokens=False)
    assert EMAIL not in prompt and PHONE not in prompt and "<EMAIL_ADDRESS>" in prompt
    assert "<|im_start|>" in prompt  # the template's special tokens survive as themselves


def test_tokenizer_none_turns_the_automatic_tokenizer_off(start_proxy, vllm_server, factory):
    proxy = start_proxy([vllm_server.base_url], tokenizer="none")
    assert proxy.versions.ready.wait(60)
    r = httpx.post(proxy.v1 + "/chat/completions", headers={"x-atdp-session-id": "off"}, timeout=120, json={
        "model": vllm_server.model, "max_tokens": 4, "messages": [{"role": "user", "content": f"Write to {EMAIL}."}]})
    assert r.status_code == 200, r.text
    [(_, step)] = _by_session(proxy, factory)
    assert step.token_source == "dropped" and step.eligibility == "audit_only"


def test_find_tokenizer_looks_only_on_this_host(tiny_model_dir, tmp_path):
    assert find_tokenizer(str(tiny_model_dir)) == str(tiny_model_dir / "tokenizer.json")
    assert find_tokenizer(str(tiny_model_dir / "tokenizer.json")) == str(tiny_model_dir / "tokenizer.json")
    assert find_tokenizer("/models/not-on-this-host") is None
    assert find_tokenizer(str(tmp_path)) is None  # a folder without a tokenizer
    assert find_tokenizer("atdp-tests/no-such-model") is None  # a hub id not in the local cache: never downloaded
    assert find_tokenizer("tiny") is None  # a served name, not a path or a hub id


# --- forget -----------------------------------------------------------------------------------------


def _tenant_rows(factory, tenant):
    with factory() as s:
        return {
            "sessions": s.scalar(select(func.count()).select_from(t.Session).where(t.Session.tenant_id == tenant)),
            "steps": s.scalar(select(func.count()).select_from(t.Step).where(t.Step.tenant_id == tenant)),
            "contents": set(s.scalars(select(t.Content.hash).where(t.Content.tenant_id == tenant))),
            "feedback": s.scalar(select(func.count()).select_from(t.Feedback).where(t.Feedback.tenant_id == tenant)),
        }


def _add_feedback_and_lineage(factory, tenant, session_external):
    with factory() as s, s.begin():
        sess = s.scalar(select(t.Session).where(t.Session.tenant_id == tenant, t.Session.external_id == session_external))
        step = s.scalars(select(t.Step).where(t.Step.session_id == sess.id)).first()
        version = t.ModelVersion(id=str(uuid.uuid4()), name=f"v-{uuid.uuid4().hex[:8]}", checkpoint="ck", status="served")
        s.add(version)
        s.flush()
        s.add(t.Feedback(id=str(uuid.uuid4()), session_id=sess.id, step_id=step.id, tenant_id=tenant, reward=1.0,
                         source="test"))
        s.add(t.VersionLineage(version_id=version.id, step_id=step.id, session_id=sess.id, reward=1.0))
        return version.id


def test_forget_session_and_tenant(start_proxy, fake_upstream, factory):
    proxy = start_proxy([fake_upstream.url], tokenizer="bytes")
    a, b = proxy.tenant, f"t-{uuid.uuid4().hex[:8]}"
    system = {"role": "system", "content": "You are the shared agent."}
    chat(proxy, "#say first", session="s1", history=[system, {"role": "user", "content": f"I am {EMAIL}"}])
    chat(proxy, "#say second", session="s2", history=[system])
    chat(proxy, "#say first", session="s1", tenant=b, history=[system, {"role": "user", "content": f"I am {EMAIL}"}])
    proxy.flush()
    version_id = _add_feedback_and_lineage(factory, a, "s1")
    before_a, before_b = _tenant_rows(factory, a), _tenant_rows(factory, b)
    assert before_a["sessions"] == 2 and before_a["feedback"] == 1

    r = httpx.delete(f"{proxy.url}/atdp/v1/sessions/s1")  # open mode: tenant a deletes its own session
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["steps"], body["feedback"], body["lineage"]) == (1, 1, {version_id: 1})
    after_a = _tenant_rows(factory, a)
    assert after_a["sessions"] == 1 and after_a["steps"] == 1 and after_a["feedback"] == 0
    gone = before_a["contents"] - after_a["contents"]
    assert len(gone) == body["contents"] >= 2  # the user message and the output; the shared system prompt stays
    with factory() as s:
        assert s.scalar(select(func.count()).select_from(t.VersionLineage).where(t.VersionLineage.version_id == version_id)) == 0
        s2 = s.scalars(select(t.Step).where(t.Step.tenant_id == a)).one()
        assert s2.system_hash in after_a["contents"]
        assert not s.scalars(select(t.Content.body).where(t.Content.tenant_id == a, t.Content.hash.in_(gone))).all()
    assert _tenant_rows(factory, b) == before_b  # the other tenant's identical content is untouched
    assert httpx.delete(f"{proxy.url}/atdp/v1/sessions/s1").status_code == 404

    # The same content sent again after the forget is stored again (the writer's cache was told).
    chat(proxy, "#say first", session="s3", history=[system, {"role": "user", "content": f"I am {EMAIL}"}])
    proxy.flush()
    assert gone <= _tenant_rows(factory, a)["contents"]

    r = httpx.delete(f"{proxy.url}/atdp/v1/tenants/{b}", headers=ADMIN)
    assert r.status_code == 200 and r.json()["sessions"] == 1
    assert _tenant_rows(factory, b) == {"sessions": 0, "steps": 0, "contents": set(), "feedback": 0}
    assert httpx.delete(f"{proxy.url}/atdp/v1/tenants/{b}").status_code == 401

    audit = httpx.get(f"{proxy.url}/atdp/v1/audit", headers=ADMIN, params={"action": "forget."}).json()["data"]
    mine = [(x["action"], x["tenant"], x["target"]) for x in audit if x["tenant"] in (a, b)]
    assert mine == [("forget.tenant", b, b), ("forget.session", a, "s1")]
    row = next(x for x in audit if x["action"] == "forget.session" and x["tenant"] == a)
    assert row["details"]["lineage"] == {version_id: 1} and row["actor"] == f"open:{a}"
    assert EMAIL not in json.dumps(audit)


def test_retention_job(start_proxy, fake_upstream, factory):
    proxy = start_proxy([fake_upstream.url], tokenizer="bytes")
    for sid in ("old", "older-by-policy", "fresh"):
        chat(proxy, f"#say answer for {sid}", session=sid)
    proxy.flush()
    with factory() as s, s.begin():
        ids = dict(s.execute(select(t.Session.external_id, t.Session.id).where(t.Session.tenant_id == proxy.tenant)).all())
        steps = {sid: s.scalar(select(t.Step.retention_until).where(t.Step.session_id == ids[sid])) for sid in ids}
        assert all(v is not None for v in steps.values())  # the default policy keeps 90 days
        s.execute(update(t.Step).where(t.Step.session_id == ids["old"])
                  .values(retention_until=datetime.now(UTC) - timedelta(minutes=1)))
        s.execute(update(t.Step).where(t.Step.session_id == ids["older-by-policy"])
                  .values(started_at=datetime.now(UTC) - timedelta(days=3)))
    r = httpx.post(f"{proxy.url}/atdp/v1/retention/run", headers=ADMIN)
    assert r.status_code == 200
    [mine] = [x for x in r.json()["tenants"] if x["tenant"] == proxy.tenant]
    assert (mine["sessions"], mine["steps"]) == (1, 1)  # "old"; "older-by-policy" is within the 90 days
    # Shortening retention applies to steps already stored.
    httpx.put(f"{proxy.url}/atdp/v1/tenants/{proxy.tenant}/policy", headers=ADMIN, json={"retention_days": 2})
    r = httpx.post(f"{proxy.url}/atdp/v1/retention/run", headers=ADMIN)
    [mine] = [x for x in r.json()["tenants"] if x["tenant"] == proxy.tenant]
    assert (mine["sessions"], mine["steps"]) == (1, 1)
    with factory() as s:
        left = set(s.scalars(select(t.Session.external_id).where(t.Session.tenant_id == proxy.tenant)))
    assert left == {"fresh"}
    audit = httpx.get(f"{proxy.url}/atdp/v1/audit", headers=ADMIN,
                      params={"tenant": proxy.tenant, "action": "retention.forget"}).json()["data"]
    assert [a["details"]["sessions"] for a in audit] == [1, 1] and audit[0]["actor"] == "admin"


# --- the command line --------------------------------------------------------------------------------


def test_cli_policy_forget_and_retention(start_proxy, fake_upstream, factory, db_url, tmp_path, monkeypatch, capsys):
    proxy = start_proxy([fake_upstream.url])
    chat(proxy, "#say hi", session="cli-1")
    chat(proxy, "#say hi", session="cli-2")
    proxy.flush()
    monkeypatch.setenv("ATDP_DATABASE_URL", db_url)
    monkeypatch.setenv("ATDP_HOME", str(tmp_path / "cli-home"))
    monkeypatch.setenv("ATDP_SECRET", "test-secret")
    tenant = proxy.tenant

    assert cli_main(["policy", "set", "--tenant", tenant, "retention_days=30", "training_consent=false"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["policy"]["retention_days"] == 30 and shown["policy"]["training_consent"] is False
    assert cli_main(["policy", "set", "--tenant", tenant, "retention_days=-3"]) == 2
    assert cli_main(["policy", "show", "--tenant", tenant]) == 0
    assert json.loads(capsys.readouterr().out)["policy"]["retention_days"] == 30

    assert cli_main(["forget", "--session", "cli-1", "--tenant", tenant]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 1
    assert cli_main(["forget", "--session", "cli-1", "--tenant", tenant]) == 1
    assert cli_main(["retention", "run"]) == 0
    capsys.readouterr()
    assert cli_main(["forget", "--tenant", tenant]) == 0
    assert json.loads(capsys.readouterr().out)["sessions"] == 1
    assert _tenant_rows(factory, tenant)["sessions"] == 0
    with factory() as s:
        actions = list(s.scalars(select(t.AuditEvent.action).where(t.AuditEvent.tenant_id == tenant,
                                                                    t.AuditEvent.actor == "cli").order_by(t.AuditEvent.id)))
    assert actions == ["policy.update", "forget.session", "forget.tenant"]


@pytest.mark.parametrize("spec", ["bytes", None, ""])
def test_load_codec_specs(spec):
    codec = load_codec(spec)
    assert (codec is None) == (not spec)
