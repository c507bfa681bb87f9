"""Redaction throughput on agent-sized steps, the way the proxy does it.

Each step is a chat request of about 80 KB (system prompt, tool schemas, a sliding window of
history) of which 2-5 KB is new since the previous turn: an assistant tool call and its tool result
(code, shell output, JSON, stack traces, prose), some of it holding PII or secrets from the seeded
corpus. As in the store, content is addressed by hash: every message of every request is hashed,
and only messages never seen before are redacted. New contents of `--batch-steps` steps go to
`RedactionPool.redact_many` together, as the writer's batches do.

    python bench/redaction_throughput.py --out /tmp/redaction.json
    python bench/redaction_throughput.py --ner-model ''    # without the NER model (names and places)

Bar: >= 100 steps/s on the 2-core machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import string
import sys
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxy.governance.redaction import RedactionConfig, Redactor  # noqa: E402
from proxy.governance.redaction_pool import RedactionPool
from tests.pii_corpus import SEEDED  # noqa: E402

WORDS = [
    "the",
    "a",
    "to",
    "of",
    "and",
    "in",
    "is",
    "that",
    "for",
    "it",
    "with",
    "as",
    "on",
    "be",
    "this",
    "are",
    "by",
    "file",
    "function",
    "value",
    "return",
    "test",
    "error",
    "config",
    "server",
    "request",
    "response",
    "user",
    "data",
    "model",
    "step",
    "token",
    "path",
    "line",
    "module",
    "import",
    "class",
    "method",
    "update",
    "check",
    "run",
    "build",
    "fix",
    "add",
    "remove",
    "output",
    "input",
    "list",
    "dict",
    "string",
    "number",
    "result",
    "call",
    "tool",
]
IDENT = [
    a + b
    for a in ("load", "parse", "get", "build", "run", "make", "check", "read")
    for b in ("_config", "_user", "_items", "_step", "_batch", "_tokens", "_path", "_result")
]


def prose(rng: random.Random, n: int) -> str:
    out, size = [], 0
    while size < n:
        sent = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 16))).capitalize() + ". "
        out.append(sent)
        size += len(sent)
    return "".join(out)[:n]


def code(rng: random.Random, n: int) -> str:
    out, size = [], 0
    while size < n:
        f = rng.choice(IDENT)
        block = (
            f"def {f}(path: str, limit: int = {rng.randint(1, 4096)}) -> dict:\n"
            f'    """{prose(rng, 60)}"""\n'
            f"    with open(path) as fh:\n        data = json.load(fh)\n"
            f'    if len(data) > limit:\n        raise ValueError(f"too many: {{len(data)}} > {{limit}}")\n'
            f"    return {{k: v for k, v in data.items() if k.startswith('{rng.choice(WORDS)}')}}\n\n"
        )
        out.append(block)
        size += len(block)
    return "".join(out)[:n]


def shell(rng: random.Random, n: int) -> str:
    lines, size = [], 0
    while size < n:
        kind = rng.randrange(4)
        if kind == 0:
            line = f"tests/test_{rng.choice(WORDS)}.py::test_{rng.choice(IDENT)} PASSED [{rng.randint(1, 99):3d}%]"
        elif kind == 1:
            line = f"-rw-r--r-- 1 dev dev {rng.randint(100, 99999):6d} Jun {rng.randint(1, 30):2d} 10:{rng.randint(0, 59):02d} src/{rng.choice(IDENT)}.py"
        elif kind == 2:
            sha = "".join(rng.choice("0123456789abcdef") for _ in range(40))
            line = f"commit {sha} {prose(rng, 40)}"
        else:
            line = f"2024-06-11T10:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}Z INFO step={rng.randint(1, 9999)} loss={rng.random():.4f} took {rng.randint(1, 900)}ms"
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)[:n]


def json_blob(rng: random.Random, n: int) -> str:
    items, size = [], 0
    while size < n:
        item = {
            "id": "".join(rng.choice(string.hexdigits.lower()) for _ in range(32)),
            "name": rng.choice(IDENT),
            "count": rng.randint(0, 10**6),
            "tags": rng.sample(WORDS, 3),
            "note": prose(rng, 80),
        }
        items.append(item)
        size += len(json.dumps(item))
    return json.dumps({"items": items}, indent=1)


def sensitive(rng: random.Random) -> str:
    kind = rng.choice(sorted(SEEDED))
    value = rng.choice(SEEDED[kind])
    templates = {
        "URL_CREDENTIALS": f"DATABASE_URL=postgresql://app:{value}@db.internal:5432/main",
        "AUTH_HEADER": f"Authorization: Bearer {value}",
        "HIGH_ENTROPY_SECRET": f'"client_secret": "{value}"',
    }
    return templates.get(kind, f"{kind.lower()}: {value}")


def tool_result(rng: random.Random, n: int) -> str:
    body = rng.choice((code, shell, json_blob, prose))(rng, n)
    if rng.random() < 0.3:  # some results carry PII or a secret
        cut = rng.randrange(len(body))
        body = body[:cut] + "\n" + sensitive(rng) + "\n" + body[cut:]
    return body


def new_turn(rng: random.Random, turn: int) -> list[dict]:
    size = rng.randint(2000, 5000)
    call = {
        "role": "assistant",
        "content": prose(rng, rng.randint(0, 300)) or None,
        "tool_calls": [
            {
                "id": f"call_{turn}_{rng.randrange(10**9)}",
                "type": "function",
                "function": {
                    "name": "bash",
                    "arguments": json.dumps({"command": f"cat src/{rng.choice(IDENT)}.py", "timeout": 30}),
                },
            }
        ],
    }
    result = {
        "role": "tool",
        "tool_call_id": call["tool_calls"][0]["id"],
        "content": tool_result(rng, size - 300),
    }
    return [call, result]


def content_hash(message: dict) -> bytes:
    return hashlib.sha256(orjson.dumps(message, option=orjson.OPT_SORT_KEYS)).digest()


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    system = {"role": "system", "content": prose(rng, 6000)}
    tools = {"role": "system", "content": json_blob(rng, 8000)}  # stands in for the tool schemas
    request_chars = args.request_kb * 1000

    def prefill() -> list[dict]:
        history: list[dict] = [{"role": "user", "content": prose(rng, 400)}]
        while sum(len(orjson.dumps(m)) for m in history) < request_chars - 14000:
            history += new_turn(rng, len(history))
        return history

    sessions = [prefill() for _ in range(args.sessions)]
    tenants = [f"tenant-{i % 3}" for i in range(args.sessions)]
    # Pre-generate the timed turns so generation is not measured.
    turns = [new_turn(rng, 10_000 + i) for i in range(args.steps)]

    seen: set[bytes] = set()
    pool = RedactionPool(RedactionConfig(salt=b"bench", ner_model=args.ner_model or None), max_workers=args.workers)
    pool.warm_up()
    # Earlier turns of every session were stored before the measurement starts.
    for s, history in enumerate(sessions):
        for m in [system, tools, *history]:
            h = content_hash(m)
            if h not in seen:
                seen.add(h)
        pool.redact_many([(tenants[s], m) for m in history])

    # The requests as the clients send them (built before timing: that is the client's work).
    requests: list[tuple[str, list[dict]]] = []
    request_bytes = 0
    for i, turn in enumerate(turns):
        s = i % args.sessions
        history = sessions[s] = sessions[s] + turn
        while sum(len(orjson.dumps(m)) for m in history) > request_chars - 14000:
            history.pop(0)  # the client's own context window keeps the request near 80 KB
        requests.append((tenants[s], [system, tools, *history]))
        request_bytes += len(orjson.dumps(requests[-1][1]))

    steps = scanned_chars = scanned_items = 0
    found: dict[str, int] = {}
    pending: list[tuple[str, dict]] = []
    in_flight: list = []
    t0 = time.perf_counter()
    for tenant, request in requests:
        for m in request:  # the proxy hashes every message of every request
            h = content_hash(m)
            if h in seen:
                continue
            seen.add(h)
            pending.append((tenant, m))
            scanned_chars += len(orjson.dumps(m))
        steps += 1
        if pending and (steps % args.batch_steps == 0 or steps == len(requests)):
            # The writer keeps one batch in flight while it hashes and queues the next.
            in_flight.append(pool.submit_many(pending))
            scanned_items += len(pending)
            pending = []
            while len(in_flight) > args.in_flight or (in_flight and steps == len(requests)):
                for _, counts in in_flight.pop(0).result():
                    for k, v in counts.items():
                        found[k] = found.get(k, 0) + v
    elapsed = time.perf_counter() - t0
    pool.close()

    # Single-core cost per KB of the same kind of content, for reference.
    local = Redactor(RedactionConfig(salt=b"bench", ner_model=args.ner_model or None))
    sample = [m for t in turns[: min(200, len(turns))] for m in t]
    kb = sum(len(orjson.dumps(m)) for m in sample) / 1000
    t1 = time.perf_counter()
    for m in sample:
        local.redact_value(m, "tenant-0")
    ms_per_kb = (time.perf_counter() - t1) * 1000 / kb

    return {
        "steps": steps,
        "elapsed_s": round(elapsed, 3),
        "steps_per_s": round(steps / elapsed, 1),
        "workers": args.workers,
        "cpu_count": os.cpu_count(),
        "batch_steps": args.batch_steps,
        "in_flight": args.in_flight,
        "mean_request_kb": round(request_bytes / steps / 1000, 1),
        "mean_new_kb_per_step": round(scanned_chars / steps / 1000, 2),
        "new_items_scanned": scanned_items,
        "single_core_ms_per_kb": round(ms_per_kb, 3),
        "pool_ms_per_new_kb_wall": round(elapsed * 1000 / (scanned_chars / 1000), 3),
        "entities_found": dict(sorted(found.items())),
        "bar_steps_per_s": 100,
        "meets_bar": steps / elapsed >= 100,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--batch-steps", type=int, default=16, help="steps whose new contents go in one batch")
    ap.add_argument("--in-flight", type=int, default=1, help="batches submitted but not yet collected")
    ap.add_argument("--request-kb", type=int, default=80)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    # Imported here, not at the top: bench/write_path.py --baseline copies this file into older trees,
    # which import its text generators only.
    from proxy.governance.ner import DEFAULT_NER_MODEL

    ap.add_argument("--ner-model", default=DEFAULT_NER_MODEL, help="the NER model ('' : none, to see what NER costs)")
    args = ap.parse_args()
    result = run(args)
    print(
        f"{result['steps_per_s']} steps/s ({result['steps']} steps in {result['elapsed_s']} s, "
        f"{result['workers']} workers, ~{result['mean_request_kb']} KB requests, "
        f"{result['mean_new_kb_per_step']} KB new per step); single core {result['single_core_ms_per_kb']} ms/KB; "
        f"bar 100 steps/s: {'met' if result['meets_bar'] else 'NOT met'}"
    )
    print(json.dumps(result["entities_found"]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
