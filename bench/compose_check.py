"""The compose stack checked from outside: conversations through the load balancer, each one session.

  docker compose up -d --scale proxy=3
  docker compose exec proxy atdp keys create --tenant acme      # prints the tenant's key
  python bench/compose_check.py --url http://127.0.0.1:8700 --key KEY [--conversations 6] [--turns 3]

Each conversation is Hermes-shaped: no session id, so each turn must be linked to the previous one by
whichever replica the balancer picks (continuation links in PostgreSQL). Turns alternate between
streamed and not, with the official `openai` SDK. Each answer's `x-atdp-session-id` must be its
conversation's, and every session, read back through the same URL, must hold all its turns in order.
Prints one JSON line; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid

import httpx
import openai

HERMES = {"User-Agent": "HermesAgent/0.4 (python)"}


def turn(client: openai.OpenAI, model: str, messages: list[dict], stream: bool) -> tuple[str, str]:
    """One call: (the answer's text, the session id the proxy stored it under)."""
    if stream:
        with client.chat.completions.with_streaming_response.create(
                model=model, messages=messages, max_tokens=16, temperature=0, stream=True) as r:
            text = "".join(c.choices[0].delta.content or "" for c in r.parse() if c.choices)
            return text, r.headers["x-atdp-session-id"]
    r = client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=16, temperature=0)
    return r.parse().choices[0].message.content or "", r.headers["x-atdp-session-id"]


def stored_turns(url: str, key: str, session: str, want: int, timeout_s: float = 30.0) -> int:
    """How many steps the session holds in order (seq 1..n), once the writers have stored `want` (or
    the time is up); -1 when they are out of order."""
    deadline, n = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline:
        r = httpx.get(f"{url}/atdp/v1/sessions/{session}", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        if r.status_code == 200:
            steps = r.json()["steps"]
            n = len(steps)
            if n >= want:
                return n if [s["seq"] for s in steps] == list(range(1, n + 1)) else -1
        time.sleep(0.5)
    return n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8700")
    ap.add_argument("--key", required=True, help="a tenant's API key (`atdp keys create --tenant T`)")
    ap.add_argument("--model", default="atdp")
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=3)
    args = ap.parse_args()
    client = openai.OpenAI(base_url=f"{args.url}/v1", api_key=args.key, max_retries=0, default_headers=HERMES,
                           timeout=120)
    sessions: dict[int, set[str]] = {}
    calls = 0
    t0 = time.monotonic()
    for c in range(args.conversations):
        messages = [{"role": "system", "content": "You are a terse assistant."},
                    {"role": "user", "content": f"Conversation {uuid.uuid4().hex[:8]}: name a colour."}]
        for k in range(args.turns):
            text, session = turn(client, args.model, messages, stream=(c + k) % 2 == 1)
            calls += 1
            sessions.setdefault(c, set()).add(session)
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And another ({k})."}]
    split = {c: sorted(s) for c, s in sessions.items() if len(s) != 1}
    stored = {c: stored_turns(args.url, args.key, next(iter(s)), args.turns) for c, s in sessions.items() if len(s) == 1}
    short = {c: n for c, n in stored.items() if n != args.turns}
    out = {"calls": calls, "seconds": round(time.monotonic() - t0, 1), "conversations": args.conversations,
           "one_session_each": not split, "split": split, "stored_turns_short": short}
    print(json.dumps(out))
    return 0 if not split and not short else 1


if __name__ == "__main__":
    sys.exit(main())
