"""The demo's agent: works lookup tasks (proxy.demo.skill) with the official `openai` SDK, two
turns per attempt, and posts each attempt's reward to the feedback API; and the held-out evaluation,
the same agent run greedily straight against vLLM (so nothing it does is recorded or trained on).

One attempt is one session (`X-ATDP-Session-Id`): turn 1 asks the question, the agent parses the
model's lookup(...) call, runs the tool and sends its result as turn 2; the model's second reply is
the answer. Attempts at one task share `X-ATDP-Task-Id` (a GRPO group). The reward is the session's,
posted once with `source: "rule"`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from proxy.demo.skill import Outcome, Task, outcome, parse_call, tool_result


@dataclass
class Attempt:
    task: Task
    session_id: str
    call_reply: str  # turn 1
    answer: str | None  # turn 2 (None: turn 1 held no call, so there was no turn 2)
    outcome: Outcome | None  # None: a call failed
    seconds: float
    error: str | None = None

    @property
    def score(self) -> Outcome | None:
        return self.outcome


@dataclass
class AgentConfig:
    proxy_url: str  # the proxy's root, e.g. http://127.0.0.1:8700
    model: str
    attempts_per_task: int = 8
    concurrency: int = 12
    temperature: float = 1.0
    max_tokens: int = 16
    api_key: str = "demo"  # open mode: any key (or none) is the default tenant


async def attempt(client, model: str, task: Task, *, temperature: float, max_tokens: int,
                  headers: dict[str, str] | None = None, seed: int | None = None) -> tuple[str, str | None, Outcome]:
    """One attempt, both turns: (turn-1 reply, turn-2 reply or None, outcome)."""
    messages = task.messages()
    extra = {"extra_headers": headers} if headers else {}
    if seed is not None:
        extra["seed"] = seed
    r = await client.chat.completions.create(model=model, messages=messages, temperature=temperature,
                                             max_tokens=max_tokens, **extra)
    call_reply = r.choices[0].message.content or ""
    item = parse_call(call_reply)
    if item is None:
        return call_reply, None, outcome(task, call_reply, None)
    messages = [*messages, {"role": "assistant", "content": call_reply},
                {"role": "user", "content": tool_result(item)}]
    r = await client.chat.completions.create(model=model, messages=messages, temperature=temperature,
                                             max_tokens=max_tokens, **extra)
    answer = r.choices[0].message.content or ""
    return call_reply, answer, outcome(task, call_reply, answer, truncated=r.choices[0].finish_reason == "length")


async def _post_feedback(http, cfg: AgentConfig, a: Attempt) -> None:
    """The session's reward. The proxy stores steps asynchronously: a 404 right after the answer
    means "not written yet", so retry for a while."""
    assert a.outcome is not None
    body = {"reward": a.outcome.reward, "source": "rule", "idempotency_key": f"demo-{a.session_id}"}
    url = f"{cfg.proxy_url}/atdp/v1/sessions/{a.session_id}/feedback"
    headers = {"authorization": f"Bearer {cfg.api_key}"}
    delay = 0.05
    for _ in range(40):
        r = await http.post(url, json=body, headers=headers)
        if r.status_code == 200:
            return
        if r.status_code not in (404, 503):
            raise RuntimeError(f"feedback for {a.session_id}: {r.status_code} {r.text[:200]}")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)
    raise RuntimeError(f"feedback for {a.session_id}: session never appeared in the store")


async def run_round(
    cfg: AgentConfig, tasks: list[Task], on_attempt: Callable[[Attempt], None] | None = None
) -> list[Attempt]:
    """Every task `attempts_per_task` times through the proxy, at most `concurrency` sessions in
    flight; each attempt is scored and its reward posted before it counts as done."""
    import httpx
    import openai

    client = openai.AsyncOpenAI(base_url=cfg.proxy_url + "/v1", api_key=cfg.api_key, max_retries=2, timeout=300.0)
    gate = asyncio.Semaphore(cfg.concurrency)

    async def one(task: Task, http) -> Attempt:
        session_id = f"demo-{uuid.uuid4().hex[:16]}"
        async with gate:
            t0 = time.perf_counter()
            try:
                call, answer, out = await attempt(
                    client, cfg.model, task, temperature=cfg.temperature, max_tokens=cfg.max_tokens,
                    headers={"x-atdp-session-id": session_id, "x-atdp-task-id": task.id})
                a = Attempt(task, session_id, call, answer, out, time.perf_counter() - t0)
                await _post_feedback(http, cfg, a)
            except (openai.APIError, httpx.HTTPError, RuntimeError) as e:
                a = Attempt(task, session_id, "", None, None, time.perf_counter() - t0, error=f"{type(e).__name__}: {e}")
        if on_attempt is not None:
            on_attempt(a)
        return a

    try:
        async with httpx.AsyncClient(timeout=30.0, trust_env=False) as http:
            work = [one(task, http) for task in tasks for _ in range(cfg.attempts_per_task)]
            return list(await asyncio.gather(*work))
    finally:
        await client.close()


@dataclass(frozen=True)
class Evaluation:
    """One version on an evaluation split: one attempt per task, each with its fixed seed."""

    tasks: int
    solved: int
    valid_calls: int
    right_items: int
    errors: int
    seconds: float
    samples: list[tuple[str, str | None]]  # a few (turn 1, turn 2) replies, for the report


async def evaluate(base_url: str, model: str, tasks: list[Task], *, max_tokens: int, temperature: float = 0.0,
                   concurrency: int = 12) -> Evaluation:
    """Every task once, task i sampled with seed i (the same for every version), straight against
    the engine at `base_url` (vLLM's /v1): no session is recorded, so the trainer never sees these
    tasks."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="demo", max_retries=2, timeout=300.0)
    gate = asyncio.Semaphore(concurrency)
    t0 = time.perf_counter()

    async def one(i: int, task: Task) -> tuple[str, str | None, Outcome] | None:
        async with gate:
            try:
                return await attempt(client, model, task, temperature=temperature, max_tokens=max_tokens, seed=i)
            except openai.APIError:
                return None

    try:
        results = await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)))
    finally:
        await client.close()
    done = [r for r in results if r is not None]
    return Evaluation(tasks=len(tasks), solved=sum(r[2].solved for r in done),
                      valid_calls=sum(r[2].valid_call for r in done), right_items=sum(r[2].right_item for r in done),
                      errors=len(results) - len(done), seconds=time.perf_counter() - t0,
                      samples=[(r[0], r[1]) for r in done[:3]])
