"""Observability: Prometheus metrics on /metrics and OpenTelemetry spans (GenAI conventions)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from proxy.record.durability import Writer

REGISTRY = CollectorRegistry()

REQUESTS = Counter("atdp_requests_total", "Model calls by API and outcome", ["api", "status"], registry=REGISTRY)
LATENCY = Histogram(
    "atdp_request_seconds", "Model call wall time (client view)", ["api"], registry=REGISTRY,
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
TTFT = Histogram(
    "atdp_time_to_first_token_seconds", "Time to the first upstream token", ["api"], registry=REGISTRY,
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
TOKENS = Counter("atdp_tokens_total", "Tokens by direction", ["direction"], registry=REGISTRY)
UPSTREAM_FAILURES = Counter("atdp_upstream_failures_total", "Failed upstream attempts", ["replica"], registry=REGISTRY)
STEPS = Counter("atdp_steps_total", "Steps by where they went", ["to"], registry=REGISTRY)
QUEUE_DEPTH = Gauge("atdp_writer_queue_depth", "Captured steps not yet written or spooled", registry=REGISTRY)
SPOOL_PENDING = Gauge("atdp_spool_pending", "1 while the spool holds steps not yet in the database", registry=REGISTRY)
SWAPS = Counter("atdp_weight_swaps_total", "Weight swaps by outcome", ["status"], registry=REGISTRY)
SWAP_SECONDS = Histogram("atdp_weight_swap_seconds", "Pause to new version serving", registry=REGISTRY,
                         buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))


PROMPT_TOKENS, COMPLETION_TOKENS = TOKENS.labels("prompt"), TOKENS.labels("completion")
# Each call's children, looked up once per label value: `labels()` takes a lock and checks its
# arguments every time. The label values are few (the doors' names, outcomes).
_REQUESTS: dict[tuple[str, str], Counter] = {}
_BY_API: dict[str, tuple[Histogram, Histogram]] = {}


def record_call(api: str, status: str, total_s: float, ttft_s: float | None, prompt_tokens: int,
                completion_tokens: int) -> None:
    """One finished model call's metrics."""
    if (requests := _REQUESTS.get((api, status))) is None:
        requests = _REQUESTS.setdefault((api, status), REQUESTS.labels(api, status))
    if (timings := _BY_API.get(api)) is None:
        timings = _BY_API.setdefault(api, (LATENCY.labels(api), TTFT.labels(api)))
    requests.inc()
    timings[0].observe(total_s)
    if ttft_s is not None:
        timings[1].observe(ttft_s)
    PROMPT_TOKENS.inc(prompt_tokens)
    COMPLETION_TOKENS.inc(completion_tokens)


WRITER_UP = Gauge("atdp_writer_up", "1 while the writer (child process or thread) runs", registry=REGISTRY)
WRITER_RESTARTS = Counter("atdp_writer_restarts_total", "Writer child processes restarted after dying",
                          registry=REGISTRY)
WRITER_OLDEST = Gauge("atdp_writer_oldest_held_seconds", "Age of the oldest step answered but not yet durable",
                      registry=REGISTRY)
WRITER_HELD_BYTES = Gauge("atdp_writer_held_bytes", "What the steps answered but not yet durable cost the proxy "
                          "(estimate; ATDP_WRITER_HOLD_MB bounds it)", registry=REGISTRY)
SPOOL_FAILING = Gauge("atdp_spool_failing", "1 while the spool cannot be written (new calls get 503)",
                      registry=REGISTRY)
HEALTHY = Gauge("atdp_healthy", "1 when /healthz answers ok", registry=REGISTRY)


def render_metrics(recorder: Writer | None = None, lag_limit_s: float = 30.0) -> bytes:
    if recorder is not None:
        health = recorder.health().judge(lag_limit_s)
        QUEUE_DEPTH.set(health.held)
        SPOOL_PENDING.set(1 if recorder.spool.pending() else 0)
        WRITER_UP.set(1 if health.alive else 0)
        WRITER_OLDEST.set(health.oldest_held_s)
        WRITER_HELD_BYTES.set(health.held_bytes)
        SPOOL_FAILING.set(1 if health.spool_error else 0)
        HEALTHY.set(0 if health.problems else 1)
        # The writer counts its restarts; the Prometheus counter catches up with it here.
        seen = WRITER_RESTARTS._value.get()
        if health.restarts > seen:
            WRITER_RESTARTS.inc(health.restarts - seen)
    return generate_latest(REGISTRY)


class Tracer:
    """Thin wrapper: a real OpenTelemetry tracer when an exporter is configured, else nothing at all.

    With no exporter no span objects are created, so tracing costs nothing on the hot path.
    """

    def __init__(self, exporter: str, *, span_exporter=None) -> None:
        """`exporter`: none | console | otlp; or pass any OpenTelemetry `span_exporter`."""
        self.enabled = exporter in ("console", "otlp") or span_exporter is not None
        self._tracer = None
        if not self.enabled:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

        provider = TracerProvider(resource=Resource.create({"service.name": "atdp-proxy"}))
        if span_exporter is not None:
            provider.add_span_processor(BatchSpanProcessor(span_exporter))
        elif exporter == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        else:
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        self.provider = provider
        self._tracer = provider.get_tracer("atdp.proxy")

    def record_call(self, *, api: str, model: str | None, session_id: str, step_id: str, status: str,
                    prompt_tokens: int, completion_tokens: int, start_ns: int, end_ns: int,
                    finish_reason: str | None, upstream: str | None, error: str | None = None) -> None:
        """One span per model call, written after the fact (start and end times are the real ones)."""
        if self._tracer is None:
            return
        from opentelemetry.trace import SpanKind, Status, StatusCode

        span = self._tracer.start_span(f"chat {model or ''}".strip(), kind=SpanKind.SERVER, start_time=start_ns)
        span.set_attribute("gen_ai.operation.name", "chat")
        span.set_attribute("gen_ai.system", "vllm")
        if model:
            span.set_attribute("gen_ai.request.model", model)
        span.set_attribute("gen_ai.usage.input_tokens", prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", completion_tokens)
        if finish_reason:
            span.set_attribute("gen_ai.response.finish_reasons", [finish_reason])
        span.set_attribute("session.id", session_id)
        span.set_attribute("atdp.step.id", step_id)
        span.set_attribute("atdp.api", api)
        if upstream:
            span.set_attribute("server.address", upstream)
        if status != "ok":
            span.set_status(Status(StatusCode.ERROR, error or status))
        span.end(end_time=end_ns)

    def shutdown(self) -> None:
        if self._tracer is not None:
            self.provider.shutdown()
