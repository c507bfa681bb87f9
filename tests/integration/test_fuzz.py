"""Schemathesis against the live proxy, in front of the real tiny vLLM, from the proxy's own OpenAPI
document: no server error (5xx) and no answer that breaks the document, on every operation.

A fixed, small budget (examples per operation, deterministic generation: the same cases every run)
keeps it to a few minutes on two cores. Two operations are left out: `POST /atdp/v1/versions` and its rollback swap
the weights of the vLLM the whole test session shares (a fuzzed checkpoint path makes that swap
fail, which the route reports as 502 by design).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import orjson
import pytest

from proxy.app import route_table

pytestmark = pytest.mark.vllm

MAX_EXAMPLES = int(os.environ.get("ATDP_FUZZ_EXAMPLES", "20"))
EXCLUDED = r"^/atdp/v1/versions(/\{version_id\}/rollback)?$"


def test_openapi_document_covers_every_route(start_proxy, vllm_server):
    proxy = start_proxy([vllm_server.base_url])
    doc = httpx.get(proxy.url + "/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    documented = {(p, m) for p, item in doc["paths"].items() for m in item}
    routes = route_table(proxy.state, proxy.response_store, proxy.versions)
    served = {(r.path.replace("{model_id:path}", "{model_id}"), m.lower()) for r in routes for m in r.methods
              if m != "HEAD"}
    assert served == documented
    for door in ("/v1/chat/completions", "/v1/responses", "/v1/messages", "/s/{session_id}/v1/messages"):
        ref = doc["paths"][door]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        schema = doc["components"]["schemas"][ref.rsplit("/", 1)[-1]]
        assert "model" in schema["required"] and "properties" in schema


def test_schemathesis_finds_no_server_error_and_no_schema_violation(start_proxy, vllm_server, tmp_path):
    proxy = start_proxy([vllm_server.base_url])
    report = tmp_path / "report"
    # The proxy's own document, with the doors' `model` pinned to the served model: a random name
    # only ever reaches vLLM's 404, and the engine's answers (streams, tool calls) are what matter.
    doc = httpx.get(proxy.url + "/openapi.json").json()
    for name in ("ChatCompletionRequest", "ResponsesRequest", "MessagesRequest", "CountTokensRequest"):
        doc["components"]["schemas"][name]["properties"]["model"] = {"const": vllm_server.model}
    schema_file = tmp_path / "openapi.json"
    schema_file.write_bytes(orjson.dumps(doc))
    cmd = [
        str(Path(sys.executable).with_name("st")), "run", str(schema_file), "--url", proxy.url,
        "--checks", "not_a_server_error,response_schema_conformance,content_type_conformance",
        "--max-examples", str(MAX_EXAMPLES), "--generation-deterministic",
        "--workers", "1", "--request-timeout", "120",
        "--exclude-path-regex", EXCLUDED,
        "--header", "Authorization: Bearer admin-test-key",
        "--report", "ndjson", "--report-dir", str(report), "--no-color",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)  # its cache stays out of the repo
    tail = run.stdout[-6000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    # It really ran: every documented operation (but the excluded) was called, nothing answered 5xx,
    # and the model doors got answers from the engine, not only refusals.
    statuses = answered(report)
    doc = httpx.get(proxy.url + "/openapi.json").json()
    # (schemathesis does not call the document it was given)
    wanted = {f"{m.upper()} {p}" for p, item in doc["paths"].items() for m in item
              if not re.match(EXCLUDED, p) and p != "/openapi.json"}
    assert wanted <= set(statuses), sorted(wanted - set(statuses))
    assert not [op for op, codes in statuses.items() if any(c >= 500 for c in codes)]
    for door in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        assert 200 in statuses[f"POST {door}"], (door, sorted(set(statuses[f"POST {door}"])))
    total = sum(len(c) for c in statuses.values())
    print(f"schemathesis: {len(statuses)} operations, {total} requests, "
          f"{sum(c.count(200) for c in statuses.values())} answered 200, 0 server errors")


def answered(report: Path) -> dict[str, list[int]]:
    """Status codes per operation ("POST /v1/messages"), from schemathesis' ndjson report."""
    out: dict[str, list[int]] = {}
    for path in report.glob("*.ndjson"):
        for line in path.read_bytes().splitlines():
            event = orjson.loads(line) if line.strip() else {}
            recorder = (event.get("ScenarioFinished") or {}).get("recorder") or {}
            for interaction in (recorder.get("interactions") or {}).values():
                response = interaction.get("response") or {}
                if "status_code" in response:
                    out.setdefault(recorder["label"], []).append(response["status_code"])
    return out
