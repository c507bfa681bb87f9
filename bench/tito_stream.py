"""Time to first token of a streamed continuation: token-in-token-out path vs rendered path.

Starts vLLM (CPU, the tiny model; or uses `--engine URL`, a server started with `--enable-scale-out`
and the hermes tool parser), then the proxy in this process twice (ATDP_TITO_STREAM on, then off) on
scratch PostgreSQL databases. Each conversation: a forced tool call (not streamed), its tool result and
a user turn, then the continuation streamed through the chat door (OpenAI SDK, temperature 0,
`--tokens` tokens). Measured at the client: time to the first chunk with text or a tool call, and to
the stream's end; the steps' `prompt_path` says which path served each continuation.

  python bench/tito_stream.py [--engine URL] [--conversations 8] [--tokens 48] [--out FILE]

Database: ATDP_TEST_DATABASE_URL's server (scratch databases, dropped afterwards).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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


def conversation(client, model: str, tokens: int, n: int) -> tuple[float, float]:
    """One parent call, then the streamed continuation: (seconds to first output, seconds to end)."""
    from tests import agent_traffic as traffic

    tools = [{"type": "function", "function": {"name": "terminal", "parameters": traffic.TERMINAL}}]
    messages = [{"role": "user", "content": f"Count the files in folder {n}."}]
    first = client.chat.completions.create(model=model, messages=messages, tools=tools, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "terminal"}},
                                           max_tokens=traffic.TOOL_TOKENS).choices[0].message
    tc = first.tool_calls[0]
    messages += [{"role": "assistant", "content": first.content,
                  "tool_calls": [{"id": tc.id, "type": "function", "function": tc.function.model_dump()}]},
                 {"role": "tool", "tool_call_id": tc.id, "content": "12\n"},
                 {"role": "user", "content": "And the tests?"}]
    t0 = time.perf_counter()
    ttft = None
    for chunk in client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice="none",
                                                temperature=0, max_tokens=tokens, stream=True):
        if ttft is None and any(c.delta.content or c.delta.tool_calls for c in chunk.choices):
            ttft = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return (ttft if ttft is not None else total), total


def run_proxy(engine_url: str, model: str, *, tito_stream: bool, conversations: int, tokens: int) -> dict:
    import openai
    import uvicorn
    from sqlalchemy import select

    from proxy.app import create_app
    from proxy.config import Settings
    from proxy.demo.vllm import free_port
    from proxy.governance.redaction import RedactionConfig, Redactor
    from proxy.store import tables as t

    url, drop = scratch_database()
    try:
        with tempfile.TemporaryDirectory() as home:
            settings = Settings(home=Path(home), database_url=url, upstream_urls=[engine_url], open_mode=True,
                                secret=b"bench", port=free_port(), tito=True, tito_stream=tito_stream,
                                writer_mode="thread")
            app = create_app(settings, redactor=Redactor(RedactionConfig(salt=b"bench")))
            server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=settings.port, log_level="warning"))
            threading.Thread(target=server.run, daemon=True).start()
            state = app.state.atdp
            deadline = time.monotonic() + 60
            while state.factory is None or not state.recorder.db_ok:
                if time.monotonic() > deadline:
                    raise SystemExit("the proxy never reached its database")
                time.sleep(0.05)
            client = openai.OpenAI(api_key="k", base_url=f"http://127.0.0.1:{settings.port}/v1")
            conversation(client, model, tokens, -1)  # warm-up (connections, the engine's caches)
            runs = [conversation(client, model, tokens, n) for n in range(conversations)]
            assert state.recorder.flush(60)
            with state.factory() as s:
                paths = Counter(st.prompt_path for st in s.scalars(select(t.Step)).all() if st.parent_step_id)
            server.should_exit = True
    finally:
        drop()
    ttft, total = [r[0] for r in runs], [r[1] for r in runs]
    return {"ttft_ms_median": round(statistics.median(ttft) * 1000, 1),
            "ttft_ms_max": round(max(ttft) * 1000, 1),
            "total_ms_median": round(statistics.median(total) * 1000, 1),
            "continuation_paths": dict(paths), "conversations": conversations}


def main() -> None:
    from proxy.demo.model_zoo import cached_tiny_model
    from proxy.demo.vllm import VLLMServer, find_vllm_python

    p = argparse.ArgumentParser()
    p.add_argument("--engine", help="a running vLLM (--enable-scale-out, hermes tool parser) serving --model")
    p.add_argument("--model", default="tiny", help="the served model name")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--out")
    args = p.parse_args()

    def measure(engine_url: str) -> dict:
        result: dict = {"model": args.model, "tokens": args.tokens, "load_before": os.getloadavg()}
        for label, on in (("tito", True), ("rendered", False)):
            result[label] = run_proxy(engine_url, args.model, tito_stream=on, conversations=args.conversations,
                                      tokens=args.tokens)
        result["load_after"] = os.getloadavg()
        return result

    if args.engine:
        result = measure(args.engine)
    else:
        python = find_vllm_python()
        if python is None:
            raise SystemExit("no vLLM environment: run scripts/vllm_env.sh")
        with VLLMServer(python=python, model_dir=cached_tiny_model(seed=0), served_name=args.model,
                        extra_args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                        ready_timeout=1800.0) as engine:
            result = measure(engine.base_url)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
