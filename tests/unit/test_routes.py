"""The routing table: settings (environment and TOML), compiling, matching, credentials, and the
provider answer's shaping and error mapping (no network, LiteLLM not imported)."""

from __future__ import annotations

import sys

import pytest
from pydantic import ValidationError

from atdp_schema.models import Eligibility
from proxy import providers
from proxy.config import UpstreamRoute, read_settings
from proxy.governance.policy import PROVIDER_REASON, TenantPolicy, decide_eligibility


def test_routes_from_the_environment_and_the_toml_file(tmp_path):
    env = {"ATDP_ROUTES": '[{"model": "claude-*", "provider": "anthropic/{model}", "api_key_env": "ANTHROPIC_API_KEY"}]'}
    (route,) = read_settings(env).routes
    assert (route.model, route.provider, route.api_key_env, route.is_provider) == (
        "claude-*", "anthropic/{model}", "ANTHROPIC_API_KEY", True)
    toml = tmp_path / "atdp.toml"
    toml.write_text('[[routes]]\nmodel = "gpt-*"\nprovider = "openai/{model}"\napi_base = "http://127.0.0.1:9/v1"\n'
                    'timeout_s = 30\n\n[[routes]]\nmodel = "*"\nprovider = "vllm"\n')
    rows = read_settings({"ATDP_CONFIG": str(toml)}).routes
    assert [(r.model, r.provider, r.timeout_s) for r in rows] == [("gpt-*", "openai/{model}", 30.0), ("*", "vllm", None)]
    assert read_settings({}).routes == []


@pytest.mark.parametrize("row", [
    {"model": "x", "provider": "gpt-4o"},  # not provider/model
    {"model": "x", "provider": "openai/gpt-4o", "api_key_env": "sk-not a name"},
    {"model": "", "provider": "openai/gpt-4o"},
    {"model": "x", "provider": "openai/gpt-4o", "api_key": "sk-inline"},  # keys never in the config
    {"model": "x", "provider": "openai/gpt-4o", "timeout_s": 0},
])
def test_bad_rows_are_refused(row):
    with pytest.raises(ValidationError):
        UpstreamRoute(**row)


def test_first_matching_row_wins_and_vllm_rows_and_misses_go_to_vllm():
    rows = [UpstreamRoute(model="gpt-4o-mini", provider="vllm"),
            UpstreamRoute(model="gpt-*", provider="openai/{model}", api_key_env="K"),
            UpstreamRoute(model="*-sonnet-*", provider="anthropic/claude-sonnet-4-5", timeout_s=5)]
    table = providers.build(rows, {"K": "sk-secret-value"}, 600.0)
    assert table.has_providers
    assert table.match("gpt-4o-mini") is None  # the explicit vLLM row comes first
    route = table.match("gpt-4.1")
    assert route.target("gpt-4.1") == "openai/gpt-4.1" and route.timeout_s == 600.0 and route.api_key == "sk-secret-value"
    assert table.match("claude-sonnet-4-5").target("claude-sonnet-4-5") == "anthropic/claude-sonnet-4-5"
    assert table.match("llama") is None and table.match(None) is None and table.match(42) is None
    assert table.match("gpt-4.1") is route  # cached
    assert "sk-secret-value" not in repr(table) and "sk-secret-value" not in repr(route)
    assert providers.RouteTable().match("gpt-4.1") is None and not providers.RouteTable().has_providers


def test_a_credential_variable_that_is_unset_fails_at_start_without_a_value():
    rows = [UpstreamRoute(model="gpt-*", provider="openai/{model}", api_key_env="ATDP_NOT_SET_ANYWHERE")]
    with pytest.raises(providers.ProviderConfigError, match="ATDP_NOT_SET_ANYWHERE is not set"):
        providers.build(rows, {}, 600.0)


def test_labels_never_carry_the_api_base_path_or_userinfo():
    route = providers.build([UpstreamRoute(model="m", provider="openai/m", api_base="https://u:pw@host:8443/v1?k=s")],
                            {}, 1.0).match("m")
    assert route.label == "litellm:openai@https://host:8443"


class _Err(Exception):
    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.message, self.status_code = message, status_code


class Timeout(Exception):  # named like LiteLLM's
    pass


@pytest.mark.parametrize(("exc", "status"), [
    (_Err("litellm.BadRequestError: OpenAIException - bad tool schema", 400), 400),
    (_Err("rate limited", 429), 429),
    (_Err("Incorrect API key provided: sk-live-123", 401), 502),
    (_Err("overloaded", 529), 502),
    (_Err("connection refused", None), 502),
    (Timeout("read timed out"), 504),
    (TimeoutError(), 504),
])
def test_provider_errors_map_to_the_callers_status(exc, status):
    got, message = providers.provider_error(exc, "sk-live-123")
    assert got == status
    assert "sk-live-123" not in message and "litellm.BadRequestError" not in message
    if status == 400:
        assert message == "OpenAIException - bad tool schema"


def test_answers_keep_only_openai_keys():
    raw = {"id": "c1", "object": "chat.completion", "created": 1, "model": "m", "provider_specific_fields": {"x": 1},
           "choices": [{"index": 0, "finish_reason": "stop", "message": {
               "role": "assistant", "content": "hi", "thinking_blocks": [], "provider_specific_fields": {},
               "tool_calls": [{"id": "a", "type": "function", "index": 0, "function": {"name": "f", "arguments": "{}"},
                               "caller": "x"}]}}],
           "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4, "cache_creation_input_tokens": 0}}
    assert providers.clean(raw) == {
        "id": "c1", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi", "tool_calls": [
            {"index": 0, "id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


def test_provider_steps_are_eligible_without_tokens_but_policy_still_applies():
    policy = TenantPolicy(training_consent=True)
    assert decide_eligibility(policy, status="ok", redaction_counts={}, tokens_available=False) == (
        Eligibility.audit_only, "token ids not captured")
    assert decide_eligibility(policy, status="ok", redaction_counts={}, tokens_available=False,
                              provider="openai/gpt-4o") == (Eligibility.eligible, PROVIDER_REASON)
    no_consent = TenantPolicy(training_consent=False)
    assert decide_eligibility(no_consent, status="ok", redaction_counts={}, tokens_available=False,
                              provider="openai/gpt-4o")[0] == Eligibility.audit_only


def test_importing_the_providers_module_does_not_import_litellm():
    import subprocess

    r = subprocess.run([sys.executable, "-c", "import sys, proxy.providers, proxy.app, proxy.cli; "
                        "print('litellm' in sys.modules)"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr[-2000:]
