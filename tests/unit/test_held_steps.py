"""What a step costs while the proxy holds it for the writer, and the bound on what it holds.

Steps are built as a streamed chat call builds them (`ChatCapture` fed vLLM-shaped chunks, then
`CapturedStep`), measured with tracemalloc; `WriterProcess` is exercised without a child (nothing
acknowledges, as with a writer that lags), no database."""

from __future__ import annotations

import array
import dataclasses
import pickle
import random
import struct
import sys
import tracemalloc
import uuid
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest

from proxy.config import Settings
from proxy.governance.policies import Policies
from proxy.record.capture import CapturedStep, ChatCapture, SessionRef, held_bytes
from proxy.record.writer_process import WriterProcess
from proxy.store.copy import binary_float4s


def _chunks(prompt: int, output: int, rng: random.Random) -> list[dict[str, Any]]:
    ids = [rng.randrange(150_000) for _ in range(output)]
    # Logprobs as the engine reports them: float32 values, sent as doubles.
    lps = [struct.unpack("f", struct.pack("f", -rng.random() * 3))[0] for _ in range(output)]
    out = []
    for i in range(0, output, 4):
        out.append({"id": "chatcmpl-x", "model": "m", "choices": [{
            "index": 0, "delta": {"content": "".join(f" w{t % 97}" for t in ids[i : i + 4])},
            "token_ids": ids[i : i + 4],
            "logprobs": {"content": [{"token": f" w{t % 97}", "logprob": lp, "top_logprobs": []}
                                     for t, lp in zip(ids[i : i + 4], lps[i : i + 4], strict=True)]},
            "finish_reason": "stop" if i + 4 >= output else None}]})
    out[0]["prompt_token_ids"] = [rng.randrange(150_000) for _ in range(prompt)]
    return out


def _step(chunks: list[dict[str, Any]]) -> CapturedStep:
    cap = ChatCapture()
    for c in chunks:
        cap.feed_chunk(c)
    return CapturedStep(
        step_id=str(uuid.uuid4()), session=SessionRef("acme", str(uuid.uuid4()), "new"), api="chat",
        started_at=datetime.now(UTC), parent_step_id=None, history_len=0, system="You are a coding agent.",
        tools=None, new_messages=[{"role": "user", "content": f"task {uuid.uuid4().hex}: list the files"}],
        tool_results=[], params={"max_tokens": 64}, action=cap.action(None),
        prompt_token_ids=cap.prompt_token_ids, output_token_ids=cap.output_token_ids,
        output_logprobs=cap.output_logprobs, finish_reason=cap.finish_reason, status="ok", error=None,
        upstream=None, model="m", model_version="v0", ttft_ms=1.0, total_ms=2.0,
        prompt_tokens=len(cap.prompt_token_ids), completion_tokens=len(cap.output_token_ids), transcript_hash=None)


@pytest.mark.parametrize(("prompt", "output", "limit"), [(200, 64, 7_000), (1_000, 200, 14_000)])
def test_a_held_step_costs_about_4_bytes_a_token(prompt, output, limit):
    """Python lists of ints and floats (plus the unused token strings) cost 18,927 and 66,575 bytes
    for these two steps (bench/held_step.py on the checkout before); machine arrays, 4,827 and 9,645."""
    rng = random.Random(3)
    plans = [_chunks(prompt, output, rng) for _ in range(300)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    held = [_step(c) for c in plans]
    per_step = (tracemalloc.get_traced_memory()[0] - before) / len(held)
    tracemalloc.stop()
    assert per_step < limit, per_step
    estimate = sum(held_bytes(s) for s in held) / len(held)
    assert 0.9 * per_step <= estimate <= 1.5 * per_step, (estimate, per_step)


def test_compact_fields_keep_what_the_writer_reads():
    plan = _chunks(50, 12, random.Random(5))
    step = _step(plan)
    sent = pickle.loads(pickle.dumps(step))  # as the writer child receives it
    assert list(sent.prompt_token_ids) == plan[0]["prompt_token_ids"]
    assert list(sent.output_token_ids) == [t for c in plan for t in c["choices"][0]["token_ids"]]
    engine = [x["logprob"] for c in plan for x in c["choices"][0]["logprobs"]["content"]]
    assert list(sent.output_logprobs) == engine  # float32 values: exact
    assert binary_float4s(sent.output_logprobs) == binary_float4s(engine)  # the `real[]` the writer COPYs
    # Ids beyond 32 bits (no engine has them) stay exact; anything not all ints is left to the writer.
    big = _step(plan)
    big.prompt_token_ids, big.output_token_ids = [2**40, 1], [None]
    big.__post_init__()
    assert list(big.prompt_token_ids) == [2**40, 1] and big.output_token_ids == [None]
    # The token strings beside the logprobs are not held: the writer never read them.
    assert "output_tokens_text" not in {f.name for f in dataclasses.fields(CapturedStep)}


def _settings(tmp_path, **kw) -> Settings:
    return Settings(home=tmp_path, secret=b"s", writer_mode="process", **kw)


def test_the_proxy_refuses_new_calls_once_it_holds_the_byte_bound(tmp_path):
    """A writer that acknowledges nothing: past ATDP_WRITER_HOLD_MB held, `refusing()` says why (the
    doors answer 503 with retry-after); far below the count bound, which alone allowed 10,000 steps."""
    wp = WriterProcess(_settings(tmp_path, writer_hold_mb=0.1), Policies())
    plan = _chunks(200, 64, random.Random(9))
    n = 0
    while wp.refusing() is None and n < 1_000:
        wp.submit(_step(plan))
        n += 1
    reason = wp.refusing()
    assert reason is not None and "writer is behind" in reason and "ATDP_WRITER_HOLD_MB" in reason
    assert 10 < n < 40 and wp.pending == n  # ~5 KB a step against 100 KB; every one held, none dropped
    health = wp.health()
    assert health.held == n and 0.1 * 2**20 <= health.held_bytes < 0.1 * 2**20 + 10_000
    assert health.as_json()["held_mb"] >= 0.1
    # Calls admitted before the refusal still finish and are held (up to twice the bound).
    wp.submit(_step(plan))
    assert wp.pending == n + 1 and not wp.stats["overflow"]


def test_the_count_bound_refuses_too(tmp_path):
    wp = WriterProcess(_settings(tmp_path, queue_size=5), Policies())
    plan = _chunks(10, 4, random.Random(1))
    for _ in range(4):
        wp.submit(_step(plan))
    assert wp.refusing() is None
    wp.submit(_step(plan))
    assert "5 answered steps" in (wp.refusing() or "")


def test_a_sealed_response_is_sized_too():
    from proxy.store.write import SealedResponse

    sealed = SealedResponse(id="resp_1", tenant_id="acme", step_id=None, sealed=b"x" * 10_000, expires_at=None)
    assert 10_000 < held_bytes(sealed) < 11_000


def test_a_capture_keeps_ids_no_engine_would_send_as_they_came():
    cap = ChatCapture()
    for ids in ([1, 2], [3, 2**40], [None], [4]):
        cap.feed_chunk({"id": "c", "model": "m", "choices": [{"index": 0, "delta": {}, "token_ids": ids}]})
    assert list(cap.output_token_ids) == [1, 2, 3, 2**40, None, 4]


def _plain_size(x: Any, depth: int = 0) -> int:
    """The plain recursive definition `_deep_size` computes faster."""
    if isinstance(x, (str, bytes, int, float, array.array, type(None))) or depth > 32:
        return sys.getsizeof(x)
    if isinstance(x, dict):
        return sys.getsizeof(x) + sum(_plain_size(k, depth + 1) + _plain_size(v, depth + 1) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return sys.getsizeof(x) + sum(_plain_size(v, depth + 1) for v in x)
    if hasattr(x, "__dict__"):
        return sys.getsizeof(x) + _plain_size(vars(x), depth + 1)
    return sys.getsizeof(x)


def test_the_size_walk_counts_what_the_plain_recursion_counts():
    from proxy.record.capture import _deep_size
    from tests.redaction_corpus import client_operator_content

    class Tag(str):
        pass

    @dataclasses.dataclass
    class Box:
        inner: Any

    nested: Any = "leaf"
    for _ in range(40):  # deeper than the walk goes
        nested = [nested]
    odd = [{("tuple", "key"): [1, 2.5, True, None, b"x"]}, (Tag("sub"), Box({"a": [Tag("b")]})), nested,
           array.array("i", range(10)), {"n": {"m": ["x" * 300, {"deep": [[{}]]}]}}]
    for client, content in client_operator_content().items():
        for part in (content.get("tools"), content.get("system")):
            assert _deep_size(part) == _plain_size(part), client
    for x in odd:
        assert _deep_size(x) == _plain_size(x), x


def test_a_resent_system_prompt_or_tool_list_is_sized_as_the_walk_sizes_it():
    from proxy.record.capture import _deep_size, _repeated_size
    from tests.redaction_corpus import client_operator_content

    for content in client_operator_content().values():
        for part in (content["tools"], content["system"]):
            first, again = orjson.loads(orjson.dumps(part)), orjson.loads(orjson.dumps(part))  # as two calls parse it
            assert _repeated_size(first) == _repeated_size(again) == _deep_size(again)
    odd = [{"set": {1, 2}}, {"n": 1}]  # not JSON: walked
    assert _repeated_size(odd) == _deep_size(odd)
    assert _repeated_size(None) == _repeated_size([]) == 0


def test_a_shared_system_prompt_and_tool_list_count_once_while_held(tmp_path):
    """Steps that hold one shared object (`capture.shared`: an agent's resent prompt and tools) cost
    its size once, as memory holds it once; it leaves the total with the last step holding it."""
    from proxy.record.capture import _repeated_size, shared
    from tests.redaction_corpus import client_operator_content

    tools = client_operator_content()["hermes"]["tools"]
    size = _repeated_size(orjson.loads(orjson.dumps(tools)))
    wp = WriterProcess(_settings(tmp_path, writer_hold_mb=64), Policies())
    plan = _chunks(20, 8, random.Random(2))
    own = [dataclasses.replace(_step(plan), tools=orjson.loads(orjson.dumps(tools))) for _ in range(5)]
    for st in own:  # each its own object: each counted
        wp.submit(st)
    alone = wp.health().held_bytes
    assert alone >= 5 * size
    held = [dataclasses.replace(_step(plan), tools=shared(orjson.loads(orjson.dumps(tools)))) for _ in range(5)]
    for st in held:
        wp.submit(st)
    together = wp.health().held_bytes - alone
    assert size <= together < size + 5 * (alone / 5 - size) + 1  # the tools once, plus each step's own
    with wp._cond:  # as the sender takes a batch, and the child acknowledges it
        batch = [wp._pending.popleft() for _ in range(len(wp._pending))]
        wp._release(batch[5:9])  # four of the five acknowledged: the fifth still holds the tools
    assert wp.health().held_bytes >= alone + size
    with wp._cond:
        wp._release(batch[9:])
        wp._requeue(batch[9:])  # refused (a nack): held again, the tools counted again
    assert wp.health().held_bytes >= alone + size
    with wp._cond:
        wp._release(batch[:5] + [wp._pending.popleft()])
    assert wp.health().held_bytes == 0 and not wp._parts and not wp._pending
