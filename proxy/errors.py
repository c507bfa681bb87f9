"""Errors in the shape of the API that was called (OpenAI error object or Anthropic error object)."""

from __future__ import annotations

from typing import Literal

import orjson
from starlette.responses import Response

Flavor = Literal["openai", "anthropic"]

_OPENAI_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    409: "conflict_error", 413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
    500: "server_error", 502: "upstream_error", 503: "service_unavailable", 504: "timeout_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    409: "invalid_request_error", 413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error",
    500: "api_error", 502: "api_error", 503: "overloaded_error", 504: "api_error",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.headers = headers or {}
        self.param = param  # the offending field's path (OpenAI's `param`), never its value


def error_body(flavor: Flavor, status: int, message: str, type: str | None = None, code: str | None = None,
               param: str | None = None) -> dict:
    if flavor == "anthropic":
        return {"type": "error", "error": {"type": type or _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    return {"error": {"message": message, "type": type or _OPENAI_TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def error_response(flavor: Flavor, status: int, message: str, *, type: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None, param: str | None = None) -> Response:
    return Response(orjson.dumps(error_body(flavor, status, message, type, code, param)), status_code=status,
                    media_type="application/json", headers=headers)


def flavor_for_path(path: str) -> Flavor:
    return "anthropic" if path.rstrip("/").endswith(("/v1/messages", "/v1/messages/count_tokens")) else "openai"
