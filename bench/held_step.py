"""Bytes a held step costs the proxy (a CapturedStep waiting for the writer), by tracemalloc.

Builds steps the way a streamed chat call does (`ChatCapture` fed vLLM-shaped chunks of 4 tokens
with logprobs, then `CapturedStep` as `proxy.call.finish` builds it), keeps --steps of them and
reports the traced bytes per step, and `capture.held_bytes`' estimate where the checkout has it.
Run it against another checkout with `PYTHONPATH=/path/to/checkout python bench/held_step.py`.

  python bench/held_step.py [--prompt 200] [--output 64] [--steps 2000]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import tracemalloc
import uuid
from datetime import UTC, datetime
from typing import Any

from proxy.record import capture
from proxy.record.capture import CapturedStep, ChatCapture, SessionRef


def chunks(prompt: int, output: int, rng: random.Random) -> list[dict[str, Any]]:
    """A streamed answer as vLLM sends it with `return_token_ids` and logprobs on."""
    ids = [rng.randrange(150_000) for _ in range(output)]
    out: list[dict[str, Any]] = []
    for i in range(0, output, 4):
        part = ids[i : i + 4]
        out.append({"id": "chatcmpl-x", "model": "m", "choices": [{
            "index": 0, "delta": {"content": "".join(f" w{t % 97}" for t in part)}, "token_ids": part,
            "logprobs": {"content": [{"token": f" w{t % 97}", "logprob": -rng.random() * 3,
                                      "bytes": [32, 119], "top_logprobs": []} for t in part]},
            "finish_reason": "stop" if i + 4 >= output else None}]})
    out[0]["prompt_token_ids"] = [rng.randrange(150_000) for _ in range(prompt)]
    return out


def one_step(prompt: int, output: int, rng: random.Random) -> CapturedStep:
    cap = ChatCapture()
    for c in chunks(prompt, output, rng):
        cap.feed_chunk(c)
    kw: dict[str, Any] = {}
    if "output_tokens_text" in {f.name for f in dataclasses.fields(CapturedStep)}:  # a checkout before it went
        kw["output_tokens_text"] = cap.output_tokens_text
    text = f"soak {uuid.uuid4().hex}: list the files in src/ and explain module 3, briefly."
    return CapturedStep(
        step_id=str(uuid.uuid4()), session=SessionRef("acme", str(uuid.uuid4()), "new"), api="chat",
        started_at=datetime.now(UTC), parent_step_id=None, history_len=0,
        system="You are a coding agent. Follow the repository rules.", tools=None,
        new_messages=[{"role": "user", "content": text}], tool_results=[], params={"max_tokens": 64},
        action=cap.action(None), prompt_token_ids=cap.prompt_token_ids, output_token_ids=cap.output_token_ids,
        output_logprobs=cap.output_logprobs, finish_reason=cap.finish_reason, status="ok", error=None,
        upstream="http://127.0.0.1:8000", model="m", model_version="v0", ttft_ms=1.0, total_ms=2.0,
        prompt_tokens=prompt, completion_tokens=output, transcript_hash="h" * 64, **kw)


def measure(prompt: int, output: int, n: int) -> tuple[float, float | None]:
    """(traced bytes per held step, held_bytes' mean estimate or None)."""
    rng = random.Random(7)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    held = [one_step(prompt, output, rng) for _ in range(n)]
    gc.collect()
    per_step = (tracemalloc.get_traced_memory()[0] - before) / n
    tracemalloc.stop()
    estimate = getattr(capture, "held_bytes", None)
    return per_step, (sum(estimate(s) for s in held) / n if estimate else None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=200, help="prompt token ids per step")
    ap.add_argument("--output", type=int, default=64, help="output tokens per step (each with a logprob)")
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args()
    per_step, estimate = measure(args.prompt, args.output, args.steps)
    est = f", held_bytes estimate {estimate:,.0f}" if estimate is not None else " (no held_bytes in this checkout)"
    print(f"prompt {args.prompt} + output {args.output} tokens: {per_step:,.0f} bytes per held step{est}")


if __name__ == "__main__":
    main()
