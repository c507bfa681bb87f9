"""The OpenAPI document of every route the proxy serves (`GET /openapi.json`).

Request bodies are the pydantic models the doors validate with (`proxy.shapes`), so the published
schema and the check at the door cannot drift apart. Answers are described as far as the proxy
promises them: every error in the called API's shape (OpenAI's error object for chat completions,
responses and the ATDP routes, Anthropic's for messages), success bodies by their top-level shape.
A test fuzzes the live proxy against this document (schemathesis).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from proxy import shapes

REF = "#/components/schemas/{model}"
SESSION_PREFIXES = ("", "/s/{session_id}")

_OPENAI_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       # vLLM's own 4xx answers, passed through, carry an integer code.
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "integer", "null"]}},
    }},
}
_ANTHROPIC_ERROR = {
    "type": "object", "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {
        "type": "object", "required": ["type", "message"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
    }},
}
_OBJECT: dict[str, Any] = {"type": "object"}
# Each event's data is the API's own chunk (a JSON object) or `[DONE]`: not constrained here.
_SSE = {"text/event-stream": {"schema": {}}}
_HTML = {"text/html": {"schema": {"type": "string"}}}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _errors(flavor: str) -> dict[str, Any]:
    ref = {"$ref": REF.format(model="AnthropicError" if flavor == "anthropic" else "OpenAIError")}
    return {"4XX": {"description": "the request was refused", "content": _json(ref)},
            "5XX": {"description": "the proxy or the upstream failed", "content": _json(ref)}}


def _op(summary: str, *, body: type[BaseModel] | None = None, ok: dict[str, Any] | None = None,
        stream: bool = False, flavor: str = "openai", params: list[dict[str, Any]] | None = None,
        ok_content: dict[str, Any] | None = None) -> dict[str, Any]:
    content = ok_content or _json(ok or _OBJECT)
    if stream:
        content = {**content, **_SSE}
    op: dict[str, Any] = {"summary": summary,
                          "responses": {"200": {"description": "OK", "content": content}, **_errors(flavor)}}
    if body is not None:
        op["requestBody"] = {"required": True, "content": _json({"$ref": REF.format(model=body.__name__)})}
    if params:
        op["parameters"] = params
    return op


def _path_param(name: str, *, ascii_only: bool = False) -> dict[str, Any]:
    longest = shapes.MAX_TENANT if name == "tenant" else shapes.MAX_ID
    schema: dict[str, Any] = {"type": "string", "minLength": 1, "maxLength": longest}
    if ascii_only:  # a door's session id is echoed in a response header
        schema["pattern"] = "^[\\x20-\\x7e]*$"
    return {"name": name, "in": "path", "required": True, "schema": schema}


def _query(name: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema or {"type": "string"}}


def _model_paths() -> dict[str, dict[str, Any]]:
    doors = {
        "/v1/chat/completions": {"post": _op("OpenAI chat completions (recorded)", body=shapes.ChatCompletionRequest,
                                             stream=True)},
        "/v1/responses": {"post": _op("OpenAI responses (recorded)", body=shapes.ResponsesRequest, stream=True)},
        "/v1/messages": {"post": _op("Anthropic messages (recorded)", body=shapes.MessagesRequest, stream=True,
                                     flavor="anthropic")},
        "/v1/messages/count_tokens": {"post": _op(
            "Anthropic token count", body=shapes.CountTokensRequest, flavor="anthropic",
            ok={"type": "object", "required": ["input_tokens"], "properties": {"input_tokens": {"type": "integer"}}})},
        "/v1/models": {"get": _op("the served models", ok={"type": "object", "required": ["data"],
                                                          "properties": {"data": {"type": "array"}}})},
        "/v1/models/{model_id}": {"get": _op("one served model", params=[_path_param("model_id")])},
    }
    out: dict[str, dict[str, Any]] = {}
    for prefix in SESSION_PREFIXES:
        for path, item in doors.items():
            if not prefix:
                out[path] = item
                continue
            # The same doors under /s/{session_id}: the path names the session.
            out[prefix + path] = {
                method: {**op, "parameters": [_path_param("session_id", ascii_only=True), *op.get("parameters", [])]}
                for method, op in item.items()
            }
    return out


def _control_paths() -> dict[str, dict[str, Any]]:
    sid, tenant, version = _path_param("session_id"), _path_param("tenant"), _path_param("version_id")
    listing = [_query(n) for n in ("since", "until", "task_id", "client", "version", "status", "eligibility", "cursor",
                                   "tenant")]
    listing += [_query("min_reward", {"type": "number"}), _query("max_reward", {"type": "number"}),
                _query("limit", {"type": "integer", "minimum": 1, "maximum": 500})]
    audit = [_query(n) for n in ("tenant", "actor", "action", "since", "until")]
    audit += [_query("limit", {"type": "integer"}), _query("before", {"type": "integer"})]
    page = {"type": "object", "required": ["data"], "properties": {"data": {"type": "array"}}}
    return {
        "/atdp/v1/sessions": {"get": _op("list the caller's sessions", params=listing, ok=page)},
        "/atdp/v1/sessions/{session_id}": {
            "get": _op("a session as ATDP JSON", params=[sid]),
            "delete": _op("forget a session (its steps, feedback, dead letters)",
                          params=[sid, _query("tenant"), _query("reason")]),
        },
        "/atdp/v1/sessions/{session_id}/feedback": {"post": _op("a reward, comment or correction",
                                                                body=shapes.FeedbackRequest, params=[sid])},
        "/atdp/v1/sessions/{session_id}/close": {"post": _op("close a session", params=[sid])},
        "/atdp/v1/versions": {
            "get": _op("every model version (admin)"),
            "post": _op("register a candidate checkpoint (under ATDP_CHECKPOINT_ROOTS) and run its gates; promote "
                        "now skips them (admin; a versions:write key may register, not promote now); with a "
                        "`layer`, a harness or memory candidate (LayerVersionRequest, admin)",
                        body=shapes.VersionRequest),
        },
        "/atdp/v1/versions/{version_id}": {"get": _op("a version: status, gates, override (admin)", params=[version])},
        "/atdp/v1/versions/{version_id}/card": {"get": _op("a version's card: what changed, why, gates, affected, "
                                                           "rollback (admin)", params=[version])},
        "/atdp/v1/versions/{version_id}/rollback": {"post": _op("roll the serving version back (admin)",
                                                                params=[version])},
        "/atdp/v1/tenants/{tenant}/policy": {
            "get": _op("a tenant's effective policy", params=[tenant]),
            "put": _op("change policy keys (admin)", params=[tenant],
                       body=shapes.PolicyChange),
        },
        "/atdp/v1/tenants/{tenant}": {"delete": _op("forget a tenant's data (admin)", params=[tenant, _query("reason")])},
        "/atdp/v1/retention/run": {"post": _op("run retention now (admin)")},
        "/atdp/v1/audit": {"get": _op("audit rows, newest first (admin)", params=audit, ok=page)},
        "/atdp/v1/evolve/proposals": {"post": _op("the diagnosis's harness and memory findings as gated "
                                                  "candidates (admin)", body=shapes.ProposalRequest)},
        "/atdp/v1/memory/facts": {"get": _op("a tenant's memory facts (admin)", params=[_query("tenant")])},
        "/atdp/v1/diagnosis": {"get": _op("ranked findings: where to fix (tenant key: its tenant; admin: all); "
                                          "rules may be overridden as query parameters; served from a snapshot "
                                          "(`generated_at`, `newer_data`) unless fresh=1",
                                          params=[_query("tenant"), _query("fresh")])},
        "/atdp/v1/whoami": {"get": _op("the caller's key: admin, or its tenant", ok={
            "type": "object", "required": ["admin", "tenant"],
            "properties": {"admin": {"type": "boolean"}, "tenant": {"type": ["string", "null"]},
                           "key_id": {"type": ["string", "null"]}}})},
        "/atdp/v1/learning": {"get": _op("reward and held-out score per model version (tenant key: its tenant; "
                                         "admin: all or ?tenant=)", params=[_query("tenant")], ok=page)},
    }


def _service_paths() -> dict[str, dict[str, Any]]:
    return {
        "/": {"get": _op("service banner")},
        "/healthz": {"get": _op("health: database, writer, spool, replicas, the NER model of redaction")},
        "/metrics": {"get": _op("Prometheus metrics", ok_content={"text/plain": {"schema": {"type": "string"}}})},
        "/openapi.json": {"get": _op("this document")},
        "/ui": {"get": _op("the operator console (docs/console.md)", ok_content=_HTML)},
        "/ui/{name}": {"get": _op("one of the console's static files", ok_content={"text/javascript": {"schema": {}},
                                                                                   "text/css": {"schema": {}},
                                                                                   **_HTML},
                                  params=[_path_param("name")])},
    }


def document() -> dict[str, Any]:
    """The whole OpenAPI 3.1 document (built once per app)."""
    models = [shapes.ChatCompletionRequest, shapes.ResponsesRequest, shapes.MessagesRequest,
              shapes.CountTokensRequest, shapes.FeedbackRequest, shapes.VersionRequest, shapes.LayerVersionRequest,
              shapes.ProposalRequest, shapes.PolicyChange]
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    schemas = {**defs.get("$defs", {}), "OpenAIError": _OPENAI_ERROR, "AnthropicError": _ANTHROPIC_ERROR}
    return {
        "openapi": "3.1.0",
        "info": {"title": "atdp proxy", "version": "1",
                 "description": "Model traffic (OpenAI chat completions and responses, Anthropic messages), "
                                "recorded as ATDP steps; the ATDP control routes."},
        "paths": {**_model_paths(), **_control_paths(), **_service_paths()},
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}},
        },
        "security": [{"bearer": []}, {"apiKey": []}, {}],
    }
