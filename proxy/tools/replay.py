"""`atdp replay`: re-send a recorded session's inputs to a model and store the answers beside it.

Each step's full input is rebuilt from the store as it was recorded (redacted): its ancestors' new
messages plus their outputs, up to its `history_len`, then its own new messages; system prompt and
tool schemas by reference. Anthropic Messages and Responses steps are translated to chat
completions (the only vLLM route that returns token ids). The replay is its own session
(`sessions.replay_of` = the original), each step pointing at the step it replays, so outputs,
tool-call choices and token counts can be compared side by side (`docs/sql/replay_vs_original.sql`).

Replays are `debug_only`: their inputs come from another trajectory, so they never train.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from atdp_schema.models import Eligibility, TokenSource
from proxy.governance.policies import Policies
from proxy.governance.redaction import TextRedactor, elide_echoes
from proxy.record.replay_inputs import chat_request, output_units, rebuild_inputs
from proxy.store import tables as t

REPLAY_CLIENT = "atdp-replay"

# --- replaying -------------------------------------------------------------------------------------


@dataclass
class ReplayResult:
    session_id: str  # public id of the replay session
    original_session_id: str
    steps: list[dict[str, Any]] = field(default_factory=list)  # per step: seq, status, original vs replay text


def replay_session(factory: sessionmaker[Session], session_id: str, *, tenant: str | None, upstream: str,
                   redactor: TextRedactor, secret: bytes, policies: Policies, model_version: str | None = None,
                   model: str | None = None, timeout_s: float = 600.0, actor: str = "cli") -> ReplayResult:
    """Replay every step of a session (public id) against `upstream` (a vLLM-compatible URL)."""
    import httpx

    from proxy.record.capture import CapturedStep, ChatCapture, SessionRef
    from proxy.record.prepare import dropped_tokens, engine_tokens, retention_until, step_record
    from proxy.store.content import canonical, content_hash
    from proxy.store.ids import new_id
    from proxy.store.read import find_session, load_contents
    from proxy.store.records import ContentRow, SessionInfo, ToolCallRow
    from proxy.store.tokens import common_prefix
    from proxy.store.write import write_steps

    with factory() as s:
        original = find_session(s, session_id, tenant)
        if original is None:
            raise LookupError(f"session {session_id!r} not found")
        steps = list(s.scalars(select(t.Step).where(t.Step.session_id == original.id).order_by(t.Step.seq)))
        hashes: set[str] = set()
        for st in steps:
            hashes.update(st.message_hashes)
            hashes.update(h for h in (st.system_hash, st.tools_hash, st.output_hash) if h)
        contents = load_contents(s, original.tenant_id, hashes)
        # A parent outside this session (rare) is fetched lazily; a content it needs that is not
        # loaded here is reported as missing, never guessed.
        inputs = rebuild_inputs({st.id: st for st in steps}, contents, fetch=lambda i, sid: t.get_step(s, i, sid))
        policy = policies.policy_for(s, original.tenant_id)

    tenant_id = original.tenant_id
    info = SessionInfo(tenant_id=tenant_id, external_id=f"replay-{new_id()}", client=REPLAY_CLIENT,
                       task_id=original.task_id, replay_of=original.id,
                       labels={"replay_of": original.external_id, "upstream": upstream, "model_version": model_version})
    result = ReplayResult(session_id=info.external_id, original_session_id=original.external_id)
    replay_ids: dict[str, str] = {}  # original step id -> replay step id
    sequences: dict[str, list[int]] = {}  # replay step id -> prompt + output ids (prefix storage)
    with httpx.Client(base_url=upstream.rstrip("/"), timeout=timeout_s) as client:
        for st in steps:
            system = contents.get(st.system_hash) if st.system_hash else None
            tools = contents.get(st.tools_hash) if st.tools_hash else None
            body = chat_request(st, inputs[st.id], system, tools, model or st.model or "default")
            started, t0 = datetime.now(UTC), time.perf_counter()
            status, error, cap = "ok", None, ChatCapture()
            try:
                resp = client.post("/v1/chat/completions", json=body)
                if resp.status_code >= 400:
                    status = "error"
                    error = {"type": "upstream_error", "message": resp.text[:500], "status_code": resp.status_code}
                else:
                    cap.feed_response(resp.json())
            except httpx.HTTPError as e:
                status, error = "error", {"type": "upstream_unavailable", "message": f"{type(e).__name__}: {e}"}
            total_ms = (time.perf_counter() - t0) * 1000

            action = cap.action(cap.assistant_message() if status == "ok" else None)
            (out_body, counts), = _redact(redactor, tenant_id, [action])
            # vLLM's 400s echo the request: the stored error is redacted like any other text.
            stored_error = _redact(redactor, tenant_id, [elide_echoes(error)])[0][0] if error else None
            out_hash = content_hash(secret, action)
            parent = replay_ids.get(st.parent_step_id) if st.parent_step_id else None
            step_id = new_id()
            usage = cap.usage or {}
            captured = CapturedStep(
                step_id=step_id, session=SessionRef(tenant=tenant_id, external_id=info.external_id, source="replay",
                                                    client=REPLAY_CLIENT, task_id=original.task_id),
                api=st.api, started_at=started, parent_step_id=parent, history_len=st.history_len, system=None,
                tools=None, new_messages=[], tool_results=[], params=st.params or {}, action=action,
                prompt_token_ids=list(cap.prompt_token_ids), output_token_ids=list(cap.output_token_ids),
                output_logprobs=list(cap.output_logprobs), finish_reason=cap.finish_reason,
                status=status, error=error, upstream=upstream, model=cap.model or body.get("model"),
                model_version=model_version, ttft_ms=None, total_ms=total_ms,
                prompt_tokens=usage.get("prompt_tokens") or len(cap.prompt_token_ids),
                completion_tokens=usage.get("completion_tokens") or len(cap.output_token_ids), transcript_hash=None,
                replay_of=st.id,
            )
            tokens = engine_tokens(captured)
            if counts and tokens.source == TokenSource.engine:
                # The raw output held something the redactor removed: its token ids must not be kept.
                tokens = dropped_tokens()
            engine = tokens.source == TokenSource.engine
            prefix = common_prefix(sequences[parent], tokens.prompt_ids) if engine and parent in sequences else 0
            if engine:
                # lists: the capture's arrays can differ in type code (an id past 32 bits is 8 bytes)
                sequences[step_id] = [*tokens.prompt_ids, *tokens.output_ids]
            refs = {"system": st.system_hash, "tools": st.tools_hash, "messages": list(st.message_hashes),
                    "output": out_hash, "results": []}
            record = step_record(
                captured, session=info, refs=refs,
                contents=[ContentRow(hash=out_hash, kind="output", body=out_body, size=len(canonical(action)),
                                     redaction=dict(counts))],
                tool_calls=[ToolCallRow(call_id=tc["id"], name=tc["name"], arguments=tc.get("arguments"))
                            for tc in out_body.get("tool_calls", []) if tc.get("id")],
                tokens=tokens, prefix_len=prefix, redaction=dict(counts), eligibility=Eligibility.debug_only,
                reason=f"replay of step {st.id}", retention=retention_until(started, policy),
                params=st.params or {}, error=stored_error,
            )
            with factory() as s, s.begin():
                write_steps(s, [record], new_id)
            replay_ids[st.id] = step_id
            original_out = contents.get(st.output_hash) or {}
            result.steps.append({
                "seq": st.seq, "original_step_id": st.id, "replay_step_id": step_id, "status": status,
                "original_text": original_out.get("text"), "replay_text": out_body.get("text"),
                "original_tool_calls": [c.get("name") for c in original_out.get("tool_calls", [])],
                "replay_tool_calls": [c.get("name") for c in out_body.get("tool_calls", [])],
            })
    with factory() as s, s.begin():
        s.add(t.AuditEvent(actor=actor, tenant_id=tenant_id, action="replay", target=original.external_id,
                           details={"replay_session": info.external_id, "upstream": upstream,
                                    "model_version": model_version, "steps": len(steps)}))
    return result


def _redact(redactor: TextRedactor, tenant: str, values: list[Any]) -> list[tuple[Any, dict[str, int]]]:
    return redactor.redact_many([(tenant, v) for v in values])


# --- command line ----------------------------------------------------------------------------------


def register(sub) -> None:
    p = sub.add_parser("replay", help="re-run a recorded session's inputs against a model, stored beside it")
    p.add_argument("session", help="the session's public id")
    p.add_argument("--tenant", help="the session's tenant (needed when the id exists in several)")
    p.add_argument("--model-version", help="the model version the replay targets (recorded on every step)")
    p.add_argument("--upstream", help="a vLLM-compatible base URL (default: the first ATDP_UPSTREAM_URL)")
    p.add_argument("--model", help="model name to send (default: the recorded one)")
    p.set_defaults(func=cmd_replay)


def cmd_replay(args) -> int:
    from proxy.config import load_settings
    from proxy.governance.redaction import RedactionConfig, Redactor
    from proxy.store import db

    settings = load_settings()
    upstream = args.upstream or settings.upstream_urls[0]
    engine = db.make_engine(db.database_url(settings))
    try:
        result = replay_session(db.session_factory(engine), args.session, tenant=args.tenant, upstream=upstream,
                                redactor=Redactor(RedactionConfig(salt=settings.secret, ner_model=settings.ner_model)), secret=settings.secret,
                                policies=Policies.from_settings(settings), model_version=args.model_version,
                                model=args.model)
    except LookupError as e:
        print(f"atdp replay: {e}", file=sys.stderr)
        return 1
    finally:
        engine.dispose()
    for row in result.steps:
        same = "same" if (row["original_text"], row["original_tool_calls"]) == (row["replay_text"], row["replay_tool_calls"]) else "differs"
        print(f"step {row['seq']}: {row['status']}, {same}; tools {row['original_tool_calls']} -> {row['replay_tool_calls']}")
    print(result.session_id)
    return 0


__all__ = ["ReplayResult", "chat_request", "output_units", "rebuild_inputs", "register", "replay_session"]
