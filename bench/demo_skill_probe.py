"""The base model on the demo's lookup task (proxy.demo.skill), before any training.

Starts vLLM with SmolLM2-135M-Instruct and runs the demo's agent straight against it on the `dev`
split (greedy, as the demo's held-out evaluation does) and on training tasks (sampled at the demo's
temperature, several attempts each, as a round does): is there signal for GRPO, and how often is
the tool call valid? It never touches the `heldout` split.

  python bench/demo_skill_probe.py [--train-tasks 16] [--attempts 8] [--temperature 1.0] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proxy.demo.agent import attempt, evaluate  # noqa: E402
from proxy.demo.model_zoo import cached_smollm2  # noqa: E402
from proxy.demo.skill import make_tasks, split_tasks, wilson  # noqa: E402
from proxy.demo.vllm import VLLMServer, find_vllm_python  # noqa: E402


async def sampled(base_url: str, tasks, attempts: int, temperature: float, max_tokens: int):
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", timeout=300.0)
    gate = asyncio.Semaphore(12)

    async def one(task):
        async with gate:
            return task, await attempt(client, "smollm2", task, temperature=temperature, max_tokens=max_tokens)

    try:
        return await asyncio.gather(*(one(t) for t in tasks for _ in range(attempts)))
    finally:
        await client.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--train-tasks", type=int, default=16)
    p.add_argument("--attempts", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--base-url", help="a running vLLM's /v1 serving `smollm2` (default: start one)")
    args = p.parse_args()
    if args.base_url:
        probe(args.base_url, args)
        return
    with VLLMServer(python=find_vllm_python() or sys.exit("no vLLM environment"), model_dir=cached_smollm2(),
                    served_name="smollm2", max_model_len=1024) as server:
        probe(server.base_url + "/v1", args)


def probe(base: str, args) -> None:
    dev = asyncio.run(evaluate(base, "smollm2", split_tasks("dev"), max_tokens=args.max_tokens))
    lo, hi = wilson(dev.solved, dev.tasks)
    print(f"dev (greedy): solved {dev.solved}/{dev.tasks} [{lo:.2f}, {hi:.2f}], valid calls {dev.valid_calls}, "
          f"right item {dev.right_items}, errors {dev.errors}, {dev.seconds:.1f} s")
    for s in dev.samples:
        print("   ", repr(s))
    tasks = make_tasks(args.train_tasks, seed=0, round_no=0)
    rs = asyncio.run(sampled(base, tasks, args.attempts, args.temperature, args.max_tokens))
    per_task = Counter(t.id for t, r in rs if r[2].solved)
    n = len(rs)
    print(f"train (T={args.temperature}, {args.attempts} per task): solved {sum(r[2].solved for _, r in rs)}/{n}, "
          f"valid calls {sum(r[2].valid_call for _, r in rs)}, right item {sum(r[2].right_item for _, r in rs)}; "
          f"groups with signal {sum(0 < per_task[t.id] < args.attempts for t in tasks)}/{len(tasks)}")
    for _, r in rs[:8]:
        print("   ", repr((r[0], r[1])))


if __name__ == "__main__":
    main()
