"""Build recorded sessions the way agents make them: the official `openai` SDK through the real proxy."""

from __future__ import annotations

import uuid

import openai

from proxy.store import tables as t
from proxy.store.read import session_document

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "read a file",
                                            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "run_tests", "description": "run the tests",
                                            "parameters": {"type": "object", "properties": {}}}}]


def sdk(proxy, *, session_id: str | None = None, task_id: str | None = None, key: str = "unused") -> openai.OpenAI:
    headers = {}
    if session_id:
        headers["X-ATDP-Session-Id"] = session_id
    if task_id:
        headers["X-ATDP-Task-Id"] = task_id
    return openai.OpenAI(base_url=proxy.v1, api_key=key, max_retries=0, default_headers=headers)


def agent_session(proxy, *, session_id: str | None = None, task_id: str | None = None, model: str = "fake",
                  tool_results: tuple[str, ...] = ("the notes say hi",), final: str = "#say done") -> str:
    """A multi-turn tool-using session: one model call per tool call, a tool result for each, then an answer.

    Returns the session's public id. With the fake upstream, `#tool NAME {json}` scripts a tool call.
    """
    sid = session_id or f"s-{uuid.uuid4().hex[:10]}"
    c = sdk(proxy, session_id=sid, task_id=task_id)
    messages = [{"role": "system", "content": "You are a coding agent."}]
    tools = ["read_file", "run_tests"]
    for i, result in enumerate(tool_results):
        name = tools[i % len(tools)]
        messages.append({"role": "user", "content": f'#tool {name} {{"path": "f{i}.txt"}}'})
        r = c.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        msg = r.choices[0].message.model_dump(exclude_none=True)
        messages.append(msg)
        for tc in msg.get("tool_calls", []):
            messages.append({"role": "tool", "tool_call_id": tc["id"], "content": result})
    messages.append({"role": "user", "content": final})
    c.chat.completions.create(model=model, messages=messages, tools=TOOLS)
    return sid


ANTHROPIC_TOOLS = [{"name": "run_tests", "description": "run the tests", "input_schema": {"type": "object", "properties": {}}}]


def anthropic_session(proxy, *, session_id: str | None = None, result: str = "1 failed", is_error: bool = True,
                      model: str = "fake") -> str:
    """A tool-using session on `/v1/messages` with the official `anthropic` SDK: one tool call, its
    result (an error by default), then an answer. Returns the session's public id."""
    import anthropic

    sid = session_id or f"m-{uuid.uuid4().hex[:10]}"
    c = anthropic.Anthropic(base_url=proxy.url, api_key="unused", max_retries=0,
                            default_headers={"X-ATDP-Session-Id": sid})
    messages = [{"role": "user", "content": "#tool run_tests {}"}]
    r = c.messages.create(model=model, max_tokens=256, system="You are a careful agent.", tools=ANTHROPIC_TOOLS,
                          messages=messages)
    (use,) = [b for b in r.content if b.type == "tool_use"]
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result,
                                               "is_error": is_error},
                                              {"type": "text", "text": "#say fixed it"}]}]
    c.messages.create(model=model, max_tokens=256, system="You are a careful agent.", tools=ANTHROPIC_TOOLS,
                      messages=messages)
    return sid


def document(factory, step: t.Step):
    with factory() as s:
        return session_document(s, s.get(t.Session, step.session_id))


def prompt_ids(factory, step: t.Step) -> list[int]:
    """A step's full prompt ids (a later step stores only the suffix after its parent's tokens)."""
    return next(st.tokens.prompt_token_ids for st in document(factory, step).steps if st.id == step.id)
