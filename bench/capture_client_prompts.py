"""Capture the real system prompts and tool schemas of Claude Code, Codex CLI and Hermes Agent.

Runs a local stand-in server that answers `/v1/messages`, `/v1/responses`, `/v1/chat/completions` and
`/v1/models` with a short canned answer, points each client at it for one one-shot prompt, and
writes the operator content of the first model request each client sends (system prompt and tool
schemas, exactly as sent) to `bench/corpus/clients/`. Those files are the redaction benchmark's
"must find nothing" corpus (`bench/redaction_quality.py`) and fixtures of the fast test.

The clients are not project dependencies: install them in a scratch folder ($SCRATCH) and name their
binaries (captured with Claude Code 2.1.197, Codex CLI 0.171.0, Hermes Agent 0.19.0):

    npm install --prefix $SCRATCH/clients @anthropic-ai/claude-code @openai/codex
    python -m venv $SCRATCH/hermes && $SCRATCH/hermes/bin/pip install 'hermes-agent[anthropic]'
    python bench/capture_client_prompts.py --claude $SCRATCH/clients/node_modules/.bin/claude \
        --codex $SCRATCH/clients/node_modules/.bin/codex --hermes $SCRATCH/hermes/bin/hermes

Each client runs in a throwaway HOME so nothing of the machine's own configuration leaks in.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "corpus" / "clients"
MODEL = "stand-in"


def _sse(events: list[tuple[str | None, dict[str, Any]]]) -> bytes:
    out = []
    for name, data in events:
        if name:
            out.append(f"event: {name}\n")
        out.append(f"data: {json.dumps(data)}\n\n")
    return "".join(out).encode()


def _anthropic_stream() -> bytes:
    msg = {"id": "msg_1", "type": "message", "role": "assistant", "model": MODEL, "content": [],
           "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 0}}
    return _sse([
        ("message_start", {"type": "message_start", "message": msg}),
        ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Done."}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                           "usage": {"output_tokens": 2}}),
        ("message_stop", {"type": "message_stop"}),
    ])


def _responses_stream() -> bytes:
    item = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": "Done.", "annotations": []}]}
    resp = {"id": "resp_1", "object": "response", "created_at": int(time.time()), "model": MODEL,
            "status": "completed", "output": [item],
            "usage": {"input_tokens": 1, "output_tokens": 2, "total_tokens": 3}}
    return _sse([
        ("response.created", {"type": "response.created", "response": {**resp, "status": "in_progress", "output": []}}),
        ("response.output_item.added", {"type": "response.output_item.added", "output_index": 0,
                                        "item": {**item, "status": "in_progress", "content": []}}),
        ("response.output_text.delta", {"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0,
                                        "content_index": 0, "delta": "Done."}),
        ("response.output_item.done", {"type": "response.output_item.done", "output_index": 0, "item": item}),
        ("response.completed", {"type": "response.completed", "response": resp}),
    ])


def _chat_stream() -> bytes:
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": int(time.time()), "model": MODEL}
    return _sse([
        (None, {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Done."}, "finish_reason": None}]}),
        (None, {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
    ]) + b"data: [DONE]\n\n"


class StandIn(BaseHTTPRequestHandler):
    captured: list[tuple[str, dict[str, Any]]] = []

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _send(self, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(200)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_HEAD(self) -> None:  # noqa: N802 (http.server's naming)
        self.send_response(200)
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802
        model = {"id": MODEL, "object": "model", "owned_by": "atdp", "max_model_len": 200_000,
                 "context_length": 200_000}
        if self.path.rstrip("/").endswith("/models"):
            self._send(json.dumps({"object": "list", "data": [model]}).encode())
        else:
            self._send(json.dumps(model).encode())

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
        path = self.path.split("?")[0]
        StandIn.captured.append((path, body))
        if path.endswith("/messages"):
            self._send(_anthropic_stream(), "text/event-stream")
        elif path.endswith("/responses"):
            self._send(_responses_stream(), "text/event-stream")
        else:
            self._send(_chat_stream(), "text/event-stream")


def _run(cmd: list[str], env: dict[str, str], cwd: Path) -> None:
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        print(f"{cmd[0]} exited {proc.returncode}: {proc.stderr[-600:]}")


def capture(client: str, binary: str, base: str) -> dict[str, Any] | None:
    StandIn.captured.clear()
    with tempfile.TemporaryDirectory() as home_dir:
        home = Path(home_dir)
        work = home / "project"
        work.mkdir()
        env = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8", "TERM": "dumb"}
        prompt = "Say done."
        if client == "claude-code":
            env |= {"ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": "stand-in-key", "ANTHROPIC_MODEL": MODEL,
                    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1"}
            _run([binary, "-p", prompt, "--output-format", "json"], env, work)
        elif client == "codex":
            codex_home = home / ".codex"
            codex_home.mkdir()
            (codex_home / "config.toml").write_text(
                f'model = "{MODEL}"\nmodel_provider = "standin"\n[model_providers.standin]\nname = "standin"\n'
                f'base_url = "{base}/v1"\nwire_api = "responses"\nenv_key = "STANDIN_KEY"\n'
            )
            env |= {"CODEX_HOME": str(codex_home), "STANDIN_KEY": "stand-in-key"}
            _run([binary, "exec", "--skip-git-repo-check", prompt], env, work)
        else:
            hermes_home = home / ".hermes"
            hermes_home.mkdir()
            (hermes_home / "config.yaml").write_text(
                f"model:\n  provider: custom\n  base_url: {base}/v1\n  default: {MODEL}\n  api_key: stand-in-key\n"
                "  context_length: 200000\n"
            )
            _run([binary, "-z", prompt], env, work)
    firsts = [b for _, b in StandIn.captured if b.get("messages") or b.get("input")]
    return firsts[0] if firsts else None


def operator_content(client: str, body: dict[str, Any]) -> dict[str, Any]:
    """What the agent vendor wrote: the system prompt (however the API carries it) and the tools."""
    if client == "claude-code":
        system: Any = body.get("system")
        extra = [m for m in body.get("messages", []) if m.get("role") == "system"]
        if extra:
            system = {"system": system, "system_messages": extra}
    elif client == "codex":
        system = {"instructions": body.get("instructions"),
                  "developer": [m for m in body.get("input", []) if m.get("role") in ("developer", "system")]}
    else:
        system = [m for m in body.get("messages", []) if m.get("role") in ("system", "developer")]
    return {"client": client, "system": system, "tools": body.get("tools") or []}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--claude")
    ap.add_argument("--codex")
    ap.add_argument("--hermes")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    args.out.mkdir(parents=True, exist_ok=True)
    for client, binary in (("claude-code", args.claude), ("codex", args.codex), ("hermes", args.hermes)):
        if not binary:
            continue
        body = capture(client, binary, base)
        if body is None:
            print(f"{client}: no model request captured")
            continue
        path = args.out / f"{client}.json"
        path.write_text(json.dumps(operator_content(client, body), indent=1, ensure_ascii=False) + "\n")
        print(f"{client}: {path} ({path.stat().st_size} bytes)")
    server.shutdown()


if __name__ == "__main__":
    main()
