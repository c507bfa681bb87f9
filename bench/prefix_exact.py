"""Prefix-exact share: how many continuation steps' prompt ids begin with their parent's prompt+output
ids exactly, with the token-in-token-out path off (every call rendered) and on (ATDP_TITO).

Starts vLLM (CPU; the tiny model, or SmolLM2-135M with --model smollm2) with `--enable-scale-out`
and the hermes tool parser, then the proxy in this process twice (path off, path on) on scratch
PostgreSQL databases, and drives Hermes- (chat door), Claude-Code- (messages door) and Codex-shaped
(responses door) conversations with forced tool calls through the official SDKs, streamed and not
(tests/agent_traffic.py). Reads the steps back as ATDP documents.

  python bench/prefix_exact.py [--model tiny|smollm2] [--conversations 2] [--turns 4] [--out FILE]
                              [--engine URL]  # a running engine instead of starting one

Database: ATDP_TEST_DATABASE_URL's server (scratch databases, dropped afterwards).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from swap_latency import scratch_database  # noqa: E402


def run_proxy(engine_url: str, model: str, *, tito: bool, conversations: int, turns: int) -> dict:
    import uvicorn
    from sqlalchemy import select

    from proxy.app import create_app
    from proxy.config import Settings
    from proxy.demo.vllm import free_port
    from proxy.governance.redaction import RedactionConfig, Redactor
    from proxy.store import tables as t
    from proxy.store.read import session_document
    from tests import agent_traffic as traffic

    url, drop = scratch_database()
    try:
        with tempfile.TemporaryDirectory() as home:
            settings = Settings(home=Path(home), database_url=url, upstream_urls=[engine_url], open_mode=True,
                                secret=b"bench", port=free_port(), tito=tito, tito_stream=tito, writer_mode="thread")
            app = create_app(settings, redactor=Redactor(RedactionConfig(salt=b"bench")))
            server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=settings.port, log_level="warning"))
            threading.Thread(target=server.run, daemon=True).start()
            base = f"http://127.0.0.1:{settings.port}"
            state = app.state.atdp
            deadline = time.monotonic() + 60
            while state.factory is None or not state.recorder.db_ok:
                if time.monotonic() > deadline:
                    raise SystemExit("the proxy never reached its database")
                time.sleep(0.05)
            drivers = {"chat": lambda s: traffic.hermes(base + "/v1", model, turns=turns, stream=s),
                       "messages": lambda s: traffic.claude_code(base, model, turns=turns, stream=s),
                       "responses": lambda s: traffic.codex(base + "/v1", model, turns=turns, stream=s)}
            out: dict = {}
            seen: set[str] = set()
            for door, drive in drivers.items():
                for stream in (False, True):
                    t0 = time.perf_counter()
                    for _ in range(conversations):
                        drive(stream)
                    elapsed = time.perf_counter() - t0
                    assert state.recorder.flush(60)
                    with state.factory() as s:  # this door's sessions only
                        sessions = [x for x in s.scalars(select(t.Session)).all() if x.id not in seen]
                        seen.update(x.id for x in sessions)
                        steps = [st for sess in sessions for st in session_document(s, sess).steps]
                    exact, total = traffic.prefix_exact(steps)
                    out[f"{door}/{'streamed' if stream else 'whole'}"] = {
                        "continuations": total, "prefix_exact": exact,
                        "share": round(exact / total, 3) if total else None,
                        "paths": dict(Counter(st.tokens.prompt_path for st in steps if st.parent_step_id)),
                        "errors": sum(st.status != "ok" for st in steps),
                        "seconds": round(elapsed, 2),
                    }
            server.should_exit = True
            return out
    finally:
        drop()


def main() -> None:
    from proxy.demo.model_zoo import cached_smollm2, cached_tiny_model
    from proxy.demo.vllm import VLLMServer, find_vllm_python

    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--conversations", type=int, default=2)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--out")
    p.add_argument("--engine", help="a running vLLM (--enable-scale-out, hermes tool parser) serving --model")
    args = p.parse_args()
    if args.engine:
        result = {"model": args.model, "conversations_per_door": args.conversations, "turns": args.turns}
        for label, on in (("off", False), ("on", True)):
            result[label] = run_proxy(args.engine, args.model, tito=on, conversations=args.conversations,
                                      turns=args.turns)
        print(json.dumps(result, indent=2))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        return
    python = find_vllm_python()
    if python is None:
        raise SystemExit("no vLLM environment: run scripts/vllm_env.sh")
    model_dir = cached_tiny_model(seed=0) if args.model == "tiny" else cached_smollm2()
    with VLLMServer(python=python, model_dir=model_dir, served_name=args.model,
                    extra_args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                    ready_timeout=1800.0) as engine:  # a busy 2-core machine compiles slowly
        result = {"model": args.model, "conversations_per_door": args.conversations, "turns": args.turns}
        for label, on in (("off", False), ("on", True)):
            result[label] = run_proxy(engine.base_url, args.model, tito=on, conversations=args.conversations,
                                      turns=args.turns)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
