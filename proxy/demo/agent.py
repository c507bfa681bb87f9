"""The demo's agent: a task family, its automatic reward rule, and an agent that works the tasks
through the proxy with the official `openai` SDK and posts each reward to the feedback API.

The task: "What is A + B? Reply with only the number." A 135M chat model at temperature 1 mostly
rambles ("17 + 16 = 24\n\nHere is the correct answer: ..."), so the format has room to improve
within a few updates, and the rule below scores it without a judge:

    reply hit max_tokens (still talking)         0.0
    reply is only a number (".": allowed)        1.0 if it is A + B, else 0.7
    anything else                                0.5 * max(0, 1 - words / 16)

The brevity term is there so that a group of rambling attempts still has a best and a worst member:
GRPO learns from differences within a group, and bare numbers are rare at first.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

PROMPT = "What is {a} + {b}? Reply with only the number."
BARE_NUMBER = re.compile(r"-?\d+\.?")
BREVITY_WORDS = 16
WRONG_NUMBER = 0.7  # a bare number that is not the sum: the format is right, the arithmetic not


@dataclass(frozen=True)
class Task:
    id: str  # sent as X-ATDP-Task-Id: attempts at one task form one GRPO group
    prompt: str
    answer: int


@dataclass(frozen=True)
class Score:
    reward: float
    bare_number: bool  # the reply is only a number
    correct: bool  # ...and it is the sum
    words: int


def make_tasks(n: int, *, seed: int, round_no: int = 0) -> list[Task]:
    """n distinct additions of two numbers in 1..20; the same (seed, round) gives the same tasks."""
    rng = random.Random(f"{seed}:{round_no}")
    pairs: list[tuple[int, int]] = []
    while len(pairs) < n:
        pair = (rng.randint(1, 20), rng.randint(1, 20))
        if pair not in pairs or len(pairs) >= 400:  # 400 distinct pairs exist
            pairs.append(pair)
    return [Task(id=f"demo-r{round_no:02d}-{a}+{b}", prompt=PROMPT.format(a=a, b=b), answer=a + b) for a, b in pairs]


def score(task: Task, reply: str, *, truncated: bool) -> Score:
    """The reward rule (see the module docstring)."""
    text = reply.strip()
    words = len(text.split())
    if truncated:
        return Score(0.0, False, False, words)
    if BARE_NUMBER.fullmatch(text):
        correct = int(text.rstrip(".")) == task.answer
        return Score(1.0 if correct else WRONG_NUMBER, True, correct, words)
    return Score(0.5 * max(0.0, 1.0 - words / BREVITY_WORDS), False, False, words)


@dataclass
class Attempt:
    task: Task
    session_id: str
    reply: str
    finish_reason: str | None
    score: Score | None  # None: the call failed
    seconds: float
    error: str | None = None


@dataclass
class AgentConfig:
    proxy_url: str  # the proxy's root, e.g. http://127.0.0.1:8700
    model: str
    attempts_per_task: int = 4
    concurrency: int = 12
    temperature: float = 1.0
    max_tokens: int = 24
    api_key: str = "demo"  # open mode: any key (or none) is the default tenant


async def _post_feedback(http, cfg: AgentConfig, attempt: Attempt) -> None:
    """The session's reward. The proxy stores steps asynchronously: a 404 right after the answer
    means "not written yet", so retry for a while."""
    assert attempt.score is not None
    body = {"reward": attempt.score.reward, "source": "rule", "idempotency_key": f"demo-{attempt.session_id}"}
    url = f"{cfg.proxy_url}/atdp/v1/sessions/{attempt.session_id}/feedback"
    headers = {"authorization": f"Bearer {cfg.api_key}"}
    delay = 0.05
    for _ in range(40):
        r = await http.post(url, json=body, headers=headers)
        if r.status_code == 200:
            return
        if r.status_code not in (404, 503):
            raise RuntimeError(f"feedback for {attempt.session_id}: {r.status_code} {r.text[:200]}")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)
    raise RuntimeError(f"feedback for {attempt.session_id}: session never appeared in the store")


async def run_round(
    cfg: AgentConfig, tasks: list[Task], on_attempt: Callable[[Attempt], None] | None = None
) -> list[Attempt]:
    """Every task `attempts_per_task` times, at most `concurrency` sessions in flight; each answer is
    scored and its reward posted before the attempt counts as done."""
    import httpx
    import openai

    client = openai.AsyncOpenAI(base_url=cfg.proxy_url + "/v1", api_key=cfg.api_key, max_retries=2, timeout=300.0)
    gate = asyncio.Semaphore(cfg.concurrency)

    async def one(task: Task, http) -> Attempt:
        session_id = f"demo-{uuid.uuid4().hex[:16]}"
        async with gate:
            t0 = time.perf_counter()
            try:
                r = await client.chat.completions.create(
                    model=cfg.model,
                    messages=[{"role": "user", "content": task.prompt}],
                    temperature=cfg.temperature,
                    max_tokens=cfg.max_tokens,
                    extra_headers={"x-atdp-session-id": session_id, "x-atdp-task-id": task.id},
                )
                choice = r.choices[0]
                reply = choice.message.content or ""
                attempt = Attempt(task, session_id, reply, choice.finish_reason,
                                  score(task, reply, truncated=choice.finish_reason == "length"),
                                  time.perf_counter() - t0)
                await _post_feedback(http, cfg, attempt)
            except (openai.APIError, httpx.HTTPError, RuntimeError) as e:
                attempt = Attempt(task, session_id, "", None, None, time.perf_counter() - t0,
                                  error=f"{type(e).__name__}: {e}")
        if on_attempt is not None:
            on_attempt(attempt)
        return attempt

    try:
        async with httpx.AsyncClient(timeout=30.0, trust_env=False) as http:
            work = [one(task, http) for task in tasks for _ in range(cfg.attempts_per_task)]
            return list(await asyncio.gather(*work))
    finally:
        await client.close()
