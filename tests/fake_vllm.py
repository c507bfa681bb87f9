"""A scripted vLLM stand-in, for the cases a real tiny model cannot produce (tool calls, failures).

It speaks vLLM's chat-completions wire format, including `return_token_ids` (top-level
`prompt_token_ids`, per-choice `token_ids`) and logprobs, with a byte-level "tokenizer" (one token
per UTF-8 byte) so token ids are predictable. The last user message scripts the answer:

- `#tool NAME {json}`: answer with one tool call (two with `#tool2`)
- `#fail500`: HTTP 500;  `#fail400`: HTTP 400 with an OpenAI error
- `#drop`: send two chunks then close the connection mid-stream
- `#malformed`: HTTP 200 with a completion whose `choices` is not a list (no engine sends that)
- `#slow SECONDS`: wait before answering
- `#burst TEXT`: answer TEXT streamed, every event in one write (an engine faster than its reader);
  `#bursterror TEXT`: the same, then an error chunk and no `[DONE]` (vLLM failing mid-stream)
- `#brokenerror STATUS`: an error answer (HTTP STATUS) whose body breaks off mid-read
- otherwise: answer "echo: <the message>" (or `#say TEXT` -> TEXT)

`script` scripts calls by their order instead, for identical requests that must be answered
differently (a retry after a failure): each chat call takes the next entry, if any, over its plan
(`{"status": 500}`, `{"delay": 3.0}`, `{"text": "..."}`).

It also has vLLM's dev-mode weight routes (/pause, /sleep at level 0, /reset_prefix_cache, /resume,
/collective_rpc, /update_weight_version, /weight_info) so swap orchestration can be tested; the
current "weights" prefix every answer.
It is a raw ASGI app (no framework) so it is fast enough to benchmark the proxy against.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import orjson


def render(messages: list[dict[str, Any]]) -> bytes:
    out = b""
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        out += f"<|{m.get('role')}|>{content or ''}".encode()
        for tc in m.get("tool_calls") or ():
            out += f"<tool>{tc['function']['name']}{tc['function']['arguments']}</tool>".encode()
        out += b"<|end|>"
    return out + b"<|assistant|>"


class FakeVLLM:
    def __init__(self, model: str = "fake", chunk_size: int = 4) -> None:
        self.model = model
        self.weights = "w0"
        self.version = "base"
        self.paused = False
        self.prefix_resets = 0
        self.chunk_size = chunk_size
        self.chunk_delay = 0.0  # seconds between streamed chunks (a model generating)
        # Seconds between a stream's `[DONE]` and the end of its response. 0: both in one write; vLLM
        # (a starlette StreamingResponse) writes its end separately.
        self.end_delay = 0.0
        self.clients: list[tuple[str, int]] = []  # each chat call's client address: its connection
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[bytes, bytes]] = []  # request headers of chat calls
        self.record = True
        self.reloads: list[str] = []
        self.fail_reload = False
        self.script: list[dict[str, Any]] = []  # overrides for the next chat calls, one each (docstring)

    # --- scripting -------------------------------------------------------------------------

    def plan(self, body: dict[str, Any]) -> dict[str, Any]:
        last = ""
        for m in reversed(body.get("messages", [])):
            if m.get("role") == "user":
                c = m.get("content")
                last = c if isinstance(c, str) else "".join(p.get("text", "") for p in c or [] if isinstance(p, dict))
                break
        plan: dict[str, Any] = {"text": f"echo: {last}"[:200], "tool_calls": [], "status": 200, "delay": 0.0}
        if last.startswith("#tool"):
            _, name, *rest = last.split(" ", 2)
            args = rest[0] if rest else "{}"
            n = 2 if last.startswith("#tool2") else 1
            plan["text"] = ""
            plan["tool_calls"] = [
                {"id": f"call_{i}_{abs(hash((last, i))) % 10**8}", "type": "function",
                 "function": {"name": name, "arguments": args}}
                for i in range(n)
            ]
        elif last.startswith("#fail500"):
            plan["status"] = 500
        elif last.startswith("#fail400"):
            plan["status"] = 400
        elif last.startswith("#malformed"):
            plan["status"] = "malformed"
        elif last.startswith("#drop"):
            plan["drop"] = True
            plan["text"] = "partial answer that never ends " * 4
        elif last.startswith("#brokenerror"):
            plan["status"] = int(last.split()[1])
            plan["broken"] = True
        elif last.startswith("#slow"):
            plan["delay"] = float(last.split()[1])
            plan["text"] = "slow answer"
        elif last.startswith("#say "):
            plan["text"] = last[5:]
        elif last.startswith(("#burst ", "#bursterror ")):
            plan["burst"] = "error" if last.startswith("#bursterror") else "ok"
            plan["text"] = last.partition(" ")[2]
        plan["text"] = (f"[{self.weights}] " + plan["text"]) if plan["text"] else ""
        return plan

    # --- ASGI --------------------------------------------------------------------------------

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        path, method = scope["path"], scope["method"]
        if path == "/v1/chat/completions" and method == "POST":
            if self.record:
                self.headers.append(dict(scope["headers"]))
                self.clients.append(tuple(scope["client"]))
            await self.chat(orjson.loads(body), send)
        elif path == "/v1/models":
            await self.json(send, 200, {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "vllm", "root": "/models/fake", "max_model_len": 2048}]})
        elif path == "/health":
            await self.json(send, 200, {})
        elif path == "/pause":
            self.paused = True
            await self.json(send, 200, {"status": "paused"})
        elif path == "/sleep":
            self.paused = True
            await self.json(send, 200, {"status": "sleeping", "level": 0})
        elif path == "/reset_prefix_cache":
            self.prefix_resets += 1
            await self.json(send, 200, {"success": True})
        elif path == "/resume":
            self.paused = False
            await self.json(send, 200, {"status": "resumed"})
        elif path == "/is_paused":
            await self.json(send, 200, {"is_paused": self.paused})
        elif path == "/collective_rpc":
            req = orjson.loads(body)
            if self.fail_reload:
                await self.json(send, 500, {"error": "reload failed"})
                return
            self.weights = req["kwargs"]["weights_path"].rstrip("/").rsplit("/", 1)[-1]
            self.reloads.append(self.weights)
            await self.json(send, 200, {"results": [None]})
        elif path == "/update_weight_version":
            self.version = orjson.loads(body)["new_version"]
            await self.json(send, 200, {"status": "ok"})
        elif path == "/weight_info":
            await self.json(send, 200, {"weight_version": self.version})
        else:
            await self.json(send, 404, {"error": {"message": "not found"}})

    async def json(self, send, status: int, payload: Any) -> None:
        data = orjson.dumps(payload)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    async def chat(self, body: dict[str, Any], send) -> None:
        if self.record:
            self.requests.append(body)
        plan = self.plan(body)
        if self.script:
            plan.update(self.script.pop(0))
        if plan["delay"]:
            await asyncio.sleep(plan["delay"])
        if plan.get("broken"):
            # Promise a body, send part of it, then fail: the server drops the connection mid-body.
            await send({"type": "http.response.start", "status": plan["status"],
                        "headers": [(b"content-type", b"application/json"), (b"content-length", b"4096")]})
            await send({"type": "http.response.body", "body": b'{"error": {"message": "scri', "more_body": True})
            raise ConnectionAbortedError("scripted: the error body breaks off mid-read")
        if plan["status"] == 500:
            await self.json(send, 500, {"error": {"message": "scripted failure", "type": "InternalServerError", "code": 500}})
            return
        if plan["status"] == 400:
            await self.json(send, 400, {"error": {"message": "scripted bad request", "type": "BadRequestError", "param": None, "code": 400}})
            return
        if plan["status"] == "malformed":
            await self.json(send, 200, {"id": "chatcmpl-bad", "object": "chat.completion", "choices": "not a list"})
            return
        prompt_ids = list(render(body.get("messages", [])))
        text = plan["text"]
        out_ids = list(text.encode())
        tool_calls = plan["tool_calls"]
        for tc in tool_calls:
            out_ids += list(f"<tool>{tc['function']['name']}{tc['function']['arguments']}</tool>".encode())
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        finish = "tool_calls" if tool_calls else "stop"
        if max_tokens and len(out_ids) > max_tokens and not tool_calls:
            out_ids, text, finish = out_ids[:max_tokens], bytes(out_ids[:max_tokens]).decode(errors="ignore"), "length"
        want_ids = body.get("return_token_ids")
        want_lp = body.get("logprobs")
        created = int(time.time())
        rid = f"chatcmpl-{abs(hash((created, len(self.requests)))) % 10**12}"
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(out_ids),
                 "total_tokens": len(prompt_ids) + len(out_ids)}

        def lp(ids):
            return {"content": [{"token": chr(i) if i < 128 else f"bytes:\\x{i:02x}", "logprob": -0.01 * (k % 7),
                                 "bytes": [i], "top_logprobs": []} for k, i in enumerate(ids, start=len(prompt_ids))]}

        if not body.get("stream"):
            msg: dict[str, Any] = {"role": "assistant", "content": text or None, "refusal": None, "annotations": None,
                                   "audio": None, "function_call": None, "tool_calls": tool_calls, "reasoning_content": None}
            choice: dict[str, Any] = {"index": 0, "message": msg, "logprobs": lp(out_ids) if want_lp else None,
                                      "finish_reason": finish, "stop_reason": None}
            if want_ids:
                choice["token_ids"] = out_ids
            resp: dict[str, Any] = {"id": rid, "object": "chat.completion", "created": created, "model": body.get("model"),
                                    "choices": [choice], "usage": usage, "prompt_logprobs": None, "kv_transfer_params": None}
            if want_ids:
                resp["prompt_token_ids"] = prompt_ids
            await self.json(send, 200, resp)
            return

        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})

        burst: list[bytes] | None = [] if plan.get("burst") else None

        async def event(obj: dict[str, Any]) -> None:
            data = b"data: " + orjson.dumps(obj) + b"\n\n"
            if burst is not None:
                burst.append(data)
                return
            await send({"type": "http.response.body", "body": data, "more_body": True})

        def chunk(delta: dict[str, Any], ids: list[int], finish_reason=None, first=False) -> dict[str, Any]:
            c: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": lp(ids) if want_lp and ids else None,
                                 "finish_reason": finish_reason}
            if finish_reason:
                c["stop_reason"] = None
            if want_ids:
                c["token_ids"] = ids
            obj: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                                   "model": body.get("model"), "choices": [c]}
            if first and want_ids:
                obj["prompt_token_ids"] = prompt_ids
            return obj

        await event(chunk({"role": "assistant", "content": ""}, [], first=True))
        text_ids = list(text.encode())
        pos = 0
        sent = 0
        # vLLM's `stream_interval`: that many of the text's chunks in one, at the same pace (tool-call
        # fragments below still come one by one)
        per = body.get("stream_interval")
        per = per if type(per) is int and per > 1 else 1
        while pos < len(text_ids):
            piece = text_ids[pos : pos + self.chunk_size * per]
            pos += len(piece)
            await event(chunk({"content": bytes(piece).decode(errors="ignore")}, piece))
            if self.chunk_delay:
                await asyncio.sleep(self.chunk_delay * per)
            sent += 1
            if plan.get("drop") and sent >= 2:
                raise ConnectionResetError("scripted drop")  # the server aborts the response mid-stream
        rest = out_ids[len(text_ids):]
        text_end = len(burst) if burst is not None else 0
        for i, tc in enumerate(tool_calls):
            args = tc["function"]["arguments"]
            ids_tc = list(f"<tool>{tc['function']['name']}{args}</tool>".encode())
            half = len(args) // 2
            await event(chunk({"tool_calls": [{"index": i, "id": tc["id"], "type": "function",
                                               "function": {"name": tc["function"]["name"], "arguments": args[:half]}}]},
                              ids_tc[: len(ids_tc) // 2]))
            await event(chunk({"tool_calls": [{"index": i, "function": {"arguments": args[half:]}}]}, ids_tc[len(ids_tc) // 2 :]))
            rest = rest[len(ids_tc):]
        await event(chunk({}, [], finish_reason=finish))
        if (body.get("stream_options") or {}).get("include_usage"):
            await event({"id": rid, "object": "chat.completion.chunk", "created": created, "model": body.get("model"),
                         "choices": [], "usage": usage})
        if burst is not None:
            if plan["burst"] == "error":  # vLLM's mid-stream failure, after the text, in place of the end
                burst[text_end:] = [b"data: " + orjson.dumps({"error": {"message": "scripted engine failure",
                                                                         "code": 500}}) + b"\n\n"]
            else:
                burst.append(b"data: [DONE]\n\n")
            await send({"type": "http.response.body", "body": b"".join(burst), "more_body": False})
            return
        if not self.end_delay:
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
            return
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
        await asyncio.sleep(self.end_delay)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """Run an ASGI app with uvicorn in a background thread (tests)."""

    def __init__(self, app, port: int | None = None) -> None:
        import uvicorn

        self.port = port or free_port()
        self.config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main() -> None:
    """Serve the scripted upstream on its own (the proxy benchmark runs it as a separate process)."""
    import argparse

    import uvicorn

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--chunk-size", type=int, default=4)
    p.add_argument("--chunk-delay-ms", type=float, default=0.0, help="between streamed chunks (a model generating)")
    args = p.parse_args()
    fake = FakeVLLM(chunk_size=args.chunk_size)
    fake.chunk_delay = args.chunk_delay_ms / 1000
    fake.record = False
    uvicorn.run(fake, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
