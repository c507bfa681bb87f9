"""Observability: one OpenTelemetry span per model call with GenAI attributes; Prometheus metrics."""

from __future__ import annotations

import httpx
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy.telemetry import Tracer


def test_spans_carry_genai_attributes(start_proxy, fake_upstream):
    proxy = start_proxy([fake_upstream.url])
    spans = InMemorySpanExporter()
    proxy.state.tracer = Tracer("none", span_exporter=spans)
    r = httpx.post(proxy.v1 + "/chat/completions", headers={"x-atdp-session-id": "traced"},
                   json={"model": "fake", "messages": [{"role": "user", "content": "trace me"}]})
    assert r.status_code == 200
    proxy.state.tracer.provider.force_flush()
    (span,) = spans.get_finished_spans()
    a = span.attributes
    assert a["gen_ai.request.model"] == "fake" and a["gen_ai.system"] == "vllm"
    assert a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.usage.output_tokens"] > 0
    assert a["session.id"] == "traced" and a["atdp.step.id"] == r.headers["x-atdp-step-id"]
    assert span.end_time > span.start_time


def test_prometheus_counts_calls_and_latency(start_proxy, fake_upstream):
    proxy = start_proxy([fake_upstream.url])

    def value(text: str, name: str) -> float:
        for line in text.splitlines():
            if line.startswith(name):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = httpx.get(proxy.url + "/metrics").text
    for i in range(3):
        httpx.post(proxy.v1 + "/chat/completions", json={"model": "fake", "messages": [{"role": "user", "content": f"m{i}"}]})
    after = httpx.get(proxy.url + "/metrics").text
    key = 'atdp_requests_total{api="chat.completions",status="ok"}'
    assert value(after, key) - value(before, key) == 3
    assert value(after, 'atdp_request_seconds_count{api="chat.completions"}') >= 3
    assert "atdp_writer_queue_depth" in after
