"""Soak: a long open-loop run across the three doors, with a PostgreSQL restart and a writer kill.

Starts the scripted upstream (tests/fake_vllm.py) and `atdp serve` (writer child, persistence and
redaction on) on an embedded PostgreSQL of its own (`proxy_overhead.start_stack`), then offers
--rate requests/s for --duration seconds, rotating over chat completions, Anthropic messages and
Responses, each streamed and not (distinct content every call). A fifth as many calls go straight
to the upstream, the baseline for "added latency". At 40% of the run PostgreSQL is stopped for
--pg-down seconds and started again; at 60% the writer child is killed with SIGKILL.

  python bench/soak.py [--duration 1800] [--rate 50] [--window 300] [--warmup 120] [--no-incidents]
                       [--no-prefill]

Before the clock starts, the proxy's bounded caches are filled (`--prefill`, on by default): calls at
`--prefill-concurrency` until /healthz shows its continuation keys and token memory at their bounds,
then the writer drains. A proxy that has run for a day is at those bounds; the soak then watches
that steady state, where RSS growth is a leak and not a cache on its way to its bound. Prefill
calls are answered steps like the others: they count for "0 steps lost" too.

Reports: steps lost (answered with 200, never stored: must be 0), errors, RSS of the proxy and of
the writer over time with their bounded caches' entries (/healthz: a cache still filling towards its
bound is not a leak, and shows there), and per window the p50/p99 latency through the proxy and direct, the added
p99, the load average (mean and max of 10 s samples: the machine may be shared), the incidents in
it, the calls turned away with 503 while the writer lagged (ATDP_WRITER_HOLD_MB) and the most the
proxy held for its writer (/healthz, every 10 s). Latency counts from when a request was due (open
loop: no coordinated omission). Then the goals, each PASS or FAIL with its figures, and overall (the
exit status is 0 only if all pass): 0 steps lost; RSS growth under 10% from the first window after
the warm-up to the last (the proxy; each writer process that lived a warm-up and two windows, since
the kill starts a new one); a stable added p99 (no window without an incident over 2x the first one
after the warm-up). A call turned away with 503 is not a lost step: its client was told to retry.
With `ATDP_TRACEMALLOC_DIR` set, both processes also write heap snapshots
(proxy.memtrace) for `bench/memdiff.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from proxy_overhead import ROOT, Conn, encode, own_postgres, start_stack

RSS_LIMIT = 0.10  # the goal: RSS grows less than this after the warm-up
P99_RATIO = 2.0  # "stable": no later window's added p99 over this multiple of the first one's

DOORS = [("chat", False), ("chat", True), ("messages", False), ("messages", True), ("responses", False),
         ("responses", True)]


def body_for(door: str, stream: bool, i: int) -> tuple[str, dict]:
    text = f"soak {i} {uuid.uuid4().hex}: list the files in src/ and explain module {i % 17}, briefly."
    if door == "chat":
        return "/v1/chat/completions", {"model": "fake", "stream": stream, "max_tokens": 64, "messages": [
            {"role": "system", "content": "You are a coding agent. Follow the repository rules."},
            {"role": "user", "content": text}]}
    if door == "messages":
        return "/v1/messages", {"model": "fake", "stream": stream, "max_tokens": 64,
                                "system": "You are a coding agent. Follow the repository rules.",
                                "messages": [{"role": "user", "content": text}]}
    return "/v1/responses", {"model": "fake", "stream": stream, "max_output_tokens": 64,
                             "instructions": "You are a coding agent. Follow the repository rules.", "input": text}


@dataclass
class Results:
    proxy: list[tuple[float, str, bool, float, int]] = field(default_factory=list)  # (t, door, stream, ms, status)
    direct: list[tuple[float, bool, float, int]] = field(default_factory=list)
    step_ids: set[str] = field(default_factory=set)  # answered with 200
    errors: dict[str, int] = field(default_factory=dict)  # connection-level failures by type


class Pool:
    """Keep-alive connections; a connection that broke is replaced."""

    def __init__(self, port: int, size: int) -> None:
        self.port, self.size = port, size
        self.free: asyncio.Queue[Conn] = asyncio.Queue()

    async def open(self) -> None:
        for _ in range(self.size):
            c = Conn(self.port)
            await c.open()
            self.free.put_nowait(c)

    async def call(self, raw: bytes, stream: bool) -> tuple[float, int, dict[bytes, bytes]]:
        c = await self.free.get()
        try:
            _, total, status = await c.request(raw, stream)
            headers = c.last_headers
        except BaseException:
            c.close()
            c = Conn(self.port)
            await c.open()
            raise
        finally:
            self.free.put_nowait(c)
        return total, status, headers


async def drive(up_port: int, proxy_port: int, duration: float, rate: float, res: Results) -> None:
    proxy, direct = Pool(proxy_port, 64), Pool(up_port, 16)
    await proxy.open()
    await direct.open()
    t0 = time.perf_counter()
    tasks: set[asyncio.Task] = set()

    async def one_proxy(i: int, due: float) -> None:
        door, stream = DOORS[i % len(DOORS)]
        path, body = body_for(door, stream, i)
        raw = encode(proxy_port, path, body)
        try:
            total, status, headers = await proxy.call(raw, stream)
        except Exception as e:
            res.errors[type(e).__name__] = res.errors.get(type(e).__name__, 0) + 1
            return
        queued = time.perf_counter() - total - due
        res.proxy.append((due - t0, door, stream, (queued + total) * 1000, status))
        if status == 200 and (step := headers.get(b"x-atdp-step-id")):
            res.step_ids.add(step.decode())

    async def one_direct(i: int, due: float) -> None:
        stream = i % 2 == 1
        _, body = body_for("chat", stream, i)
        raw = encode(up_port, "/v1/chat/completions", body)
        try:
            total, status, _ = await direct.call(raw, stream)
        except Exception as e:
            res.errors["direct " + type(e).__name__] = res.errors.get("direct " + type(e).__name__, 0) + 1
            return
        queued = time.perf_counter() - total - due
        res.direct.append((due - t0, stream, (queued + total) * 1000, status))

    n = int(duration * rate)
    for k in range(n):
        due = t0 + k / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(one_proxy(k, due))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        if k % 5 == 0:  # the baseline: a fifth as many calls straight to the upstream
            t2 = asyncio.create_task(one_direct(k, due))
            tasks.add(t2)
            t2.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def writer_pid(proxy_pid: int) -> int | None:
    """The writer: the proxy's multiprocessing child (not its resource tracker)."""
    for task in os.listdir(f"/proc/{proxy_pid}/task"):
        with open(f"/proc/{proxy_pid}/task/{task}/children") as f:
            for child in f.read().split():
                with open(f"/proc/{child}/cmdline", "rb") as c:
                    cmd = c.read()
                if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
                    return int(child)
    return None


def health_now(health: str) -> dict:
    """From /healthz: the steps (and MB) the proxy holds for its writer, and the bounded caches' entries
    of proxy and writer (what grows with traffic until its bound); empty when it did not answer."""
    try:
        h = httpx.get(health, timeout=5).json()
        writer = h["writer"]
        return {"held": writer.get("held"), "held_mb": writer.get("held_mb"),
                "proxy_caches": h.get("memory", {}).get("caches"), "writer_caches": writer.get("caches")}
    except (httpx.HTTPError, ValueError, KeyError):
        return {}


async def prefill(proxy_port: int, health: str, res: Results, concurrency: int, max_s: float,
                  max_held: int = 2000) -> dict:
    """Calls (the soak's own, every door) until the proxy's continuation keys and token memory are at
    their bounds (/healthz `memory.bounds`), pausing while the writer holds more than `max_held`
    steps (the soak starts from a writer that keeps up, and no call is turned away for it)."""
    pool = Pool(proxy_port, concurrency)
    await pool.open()
    t0, k, statuses = time.perf_counter(), 0, {}
    base = 10**9  # call numbers apart from the timed run's

    async def one(i: int) -> None:
        door, stream = DOORS[i % len(DOORS)]
        path, body = body_for(door, stream, base + i)
        try:
            _, status, headers = await pool.call(encode(proxy_port, path, body), stream)
        except Exception as e:
            res.errors["prefill " + type(e).__name__] = res.errors.get("prefill " + type(e).__name__, 0) + 1
            return
        statuses[status] = statuses.get(status, 0) + 1
        if status == 200 and (step := headers.get(b"x-atdp-step-id")):
            res.step_ids.add(step.decode())

    async with httpx.AsyncClient(timeout=10) as hc:
        while True:
            h = (await hc.get(health)).json()
            mem = h["memory"]
            full = all(mem["caches"][name] >= 0.98 * bound for name, bound in mem["bounds"].items())
            if full or time.perf_counter() - t0 > max_s:
                break
            if h["writer_pending"] > max_held:
                await asyncio.sleep(0.5)
                continue
            await asyncio.gather(*(one(k + j) for j in range(4 * concurrency)))
            k += 4 * concurrency
        while (await hc.get(health)).json()["writer_pending"] and time.perf_counter() - t0 < max_s + 600:
            await asyncio.sleep(1.0)
        h = (await hc.get(health)).json()
    return {"calls": k, "seconds": round(time.perf_counter() - t0, 1), "statuses": statuses, "full": full,
            "caches": h["memory"]["caches"], "bounds": h["memory"]["bounds"], "proxy_rss_mb": h["memory"]["rss_mb"],
            "writer_caches": h["writer"].get("caches")}


def sampler(proxy_pid: int, health: str, stop: threading.Event, out: list[dict], t0: float, every: float) -> None:
    while not stop.wait(every):
        w = writer_pid(proxy_pid)
        sample = {"t": time.perf_counter() - t0, "proxy_mb": rss_mb(proxy_pid), "writer_pid": w,
                  "writer_mb": rss_mb(w) if w else None, "load1": os.getloadavg()[0]}
        sample.update({"held": None, "held_mb": None, **health_now(health)})
        out.append(sample)


def q(values: list[float], p: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))]


def growth(samples: list[tuple[float, float]], start: float, window: float) -> dict | None:
    """Median RSS in the first window from `start` and in the last window; their ratio - 1."""
    after = [(t, v) for t, v in samples if t >= start and v is not None]
    if len(after) < 4:
        return None
    end = after[-1][0]
    first = [v for t, v in after if t < start + window] or [after[0][1]]
    last = [v for t, v in after if t > end - window] or [after[-1][1]]
    a, b = statistics.median(first), statistics.median(last)
    return {"from_mb": round(a, 1), "to_mb": round(b, 1), "growth": round(b / a - 1, 4)}


def caches_over(samples: list[dict], key: str, start: float, end: float) -> dict[str, list[int]]:
    """Each cache's entries at the first sample from `start` and the last one to `end` (the RSS windows'
    ends): how much of an RSS growth is caches still filling towards their bounds."""
    seen = [s[key] for s in samples if start <= s["t"] <= end and s.get(key)]
    if not seen:
        return {}
    return {name: [seen[0].get(name, 0), seen[-1].get(name, 0)] for name in seen[-1]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of load")
    ap.add_argument("--rate", type=float, default=50.0, help="requests/s offered to the proxy")
    ap.add_argument("--window", type=float, default=300.0, help="seconds per latency window")
    ap.add_argument("--warmup", type=float, default=120.0, help="seconds before RSS growth is measured")
    ap.add_argument("--pg-down", type=float, default=15.0, help="seconds PostgreSQL stays stopped")
    ap.add_argument("--no-incidents", action="store_true", help="no PostgreSQL restart, no writer kill (diagnosis)")
    ap.add_argument("--no-prefill", dest="prefill", action="store_false",
                    help="start the clock with the proxy's caches empty (they fill during the run)")
    ap.add_argument("--prefill-concurrency", type=int, default=8)
    ap.add_argument("--prefill-max-s", type=float, default=1800.0, help="give up filling after this long")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "soak.json"))
    args = ap.parse_args()

    pg = own_postgres()
    stack = start_stack(db=(pg.url, pg.close))
    health = f"http://127.0.0.1:{stack.proxy_port}/healthz"
    proxy_pid = stack.procs[1].pid
    res, samples, events = Results(), [], []
    filled = None
    if args.prefill:
        filled = asyncio.run(prefill(stack.proxy_port, health, res, args.prefill_concurrency, args.prefill_max_s))
        print(f"prefill: {filled['calls']} calls in {filled['seconds']} s, statuses {filled['statuses']}; caches "
              f"{filled['caches']} of {filled['bounds']}; proxy RSS {filled['proxy_rss_mb']} MB", flush=True)
    stop = threading.Event()
    t0 = time.perf_counter()
    threading.Thread(target=sampler, args=(proxy_pid, health, stop, samples, t0, 10.0), daemon=True).start()

    def incidents() -> None:
        try:
            chaos_script()
        except Exception as e:  # reported, and the run's figures say the incidents did not all happen
            events.append({"t": time.perf_counter() - t0, "event": f"incident failed: {type(e).__name__}: {e}"})

    def chaos_script() -> None:
        time.sleep(0.4 * args.duration)
        events.append({"t": time.perf_counter() - t0, "event": "postgresql stopped"})
        pg.stop_server()
        time.sleep(args.pg_down)
        pg.start_server()
        events.append({"t": time.perf_counter() - t0, "event": "postgresql started"})
        time.sleep(max(0.0, 0.6 * args.duration - (time.perf_counter() - t0)))
        pid = writer_pid(proxy_pid)
        if pid:
            os.kill(pid, signal.SIGKILL)
            events.append({"t": time.perf_counter() - t0, "event": f"writer {pid} killed (SIGKILL)"})

    chaos = threading.Thread(target=(lambda: None) if args.no_incidents else incidents, daemon=True)
    chaos.start()
    try:
        asyncio.run(drive(stack.up_port, stack.proxy_port, args.duration, args.rate, res))
        chaos.join()
        end_load = time.perf_counter()
        while True:  # every answered step durable and written: the writer's queue and the spool empty
            h = httpx.get(health, timeout=10).json()
            if (h["writer_pending"] == 0 and not h["spool_pending"]) or time.perf_counter() - end_load > 600:
                break
            time.sleep(1.0)
        drain_s = time.perf_counter() - end_load
        drained = h["writer_pending"] == 0 and not h["spool_pending"]
        time.sleep(12.0)  # one more RSS sample after the drain
        stop.set()
        from sqlalchemy import create_engine, text

        engine = create_engine(pg.url)
        with engine.connect() as c:
            stored = set(c.execute(text("SELECT id FROM steps WHERE id = ANY(:ids)"),
                                   {"ids": sorted(res.step_ids)}).scalars())
            total_steps = c.execute(text("SELECT count(*) FROM steps")).scalar()
        engine.dispose()
    finally:
        stop.set()
        stack.stop()

    windows = []
    k = 0
    while k * args.window < args.duration:
        lo, hi = k * args.window, (k + 1) * args.window
        p = [ms for t, _, _, ms, st in res.proxy if lo <= t < hi and st == 200]
        d = [ms for t, _, ms, st in res.direct if lo <= t < hi and st == 200]
        loads = [s["load1"] for s in samples if lo <= s["t"] < hi]
        held = [(s["held"], s.get("held_mb") or 0.0) for s in samples if lo <= s["t"] < hi and s["held"] is not None]
        w = {"from_s": lo, "to_s": min(hi, args.duration), "calls": len(p), "proxy_p50_ms": q(p, 0.5),
             "proxy_p99_ms": q(p, 0.99), "direct_p50_ms": q(d, 0.5), "direct_p99_ms": q(d, 0.99),
             "load_mean": round(statistics.mean(loads), 1) if loads else None,
             "load_max": round(max(loads), 1) if loads else None,
             "incidents": [e["event"] for e in events if lo <= e["t"] < hi],
             # Backpressure: calls turned away (503) while the writer lagged past ATDP_WRITER_HOLD_MB.
             "refused_503": sum(1 for t, *_, st in res.proxy if lo <= t < hi and st == 503),
             "held_max": max((h for h, _ in held), default=None),
             "held_mb_max": round(max((m for _, m in held), default=0.0), 1) if held else None}
        w["added_p99_ms"] = (w["proxy_p99_ms"] - w["direct_p99_ms"]) if p and d else None
        windows.append(w)
        k += 1
    statuses: dict[int, int] = {}
    for *_, st in res.proxy:
        statuses[st] = statuses.get(st, 0) + 1
    # RSS judged over the load only (the drain after it is another regime).
    loaded = [s for s in samples if s["t"] <= args.duration]
    proxy_rss = growth([(s["t"], s["proxy_mb"]) for s in loaded], args.warmup, args.window)
    writers = []
    for pid in dict.fromkeys(s["writer_pid"] for s in loaded if s["writer_pid"]):
        own = [(s["t"], s["writer_mb"]) for s in loaded if s["writer_pid"] == pid] or [(0.0, None)]
        # Judged only when it lived a warm-up plus two windows (the one after the kill may not).
        judged = own[-1][0] - own[0][0] >= args.warmup + 2 * args.window
        writers.append({"pid": pid, "from_t": own[0][0], "to_t": own[-1][0], "judged": judged,
                        "rss": growth(own, own[0][0] + args.warmup, args.window),
                        "caches": caches_over([s for s in loaded if s["writer_pid"] == pid], "writer_caches",
                                              own[0][0] + args.warmup, own[-1][0])})
    proxy_caches = caches_over(loaded, "proxy_caches", args.warmup, args.duration)
    lost = sorted(res.step_ids - stored)
    criteria = [{"criterion": "0 steps lost (every step answered 200 is in the database after the drain)",
                 "measured": f"{len(lost)} of {len(res.step_ids)} not stored" + ("" if drained else
                             f" (NOT DRAINED after {drain_s:.0f} s: not verified)"),
                 "pass": drained and not lost}, *judge(windows, proxy_rss, writers, args)]
    summary = {
        "duration_s": args.duration, "rate": args.rate, "warmup_s": args.warmup, "window_s": args.window,
        "prefill": filled,
        "proxied_calls": len(res.proxy), "statuses": statuses,
        "connection_errors": res.errors, "answered_steps": len(res.step_ids), "steps_lost": len(lost), "drained": drained,
        "lost_ids": lost[:20], "steps_in_database": total_steps, "writer_drain_s": round(drain_s, 1),
        "events": events, "criteria": criteria, "windows": windows, "proxy_rss": proxy_rss, "proxy_caches": proxy_caches,
        "writers": writers,
        "rss_samples": samples, "machine": {"cores": os.cpu_count()}, "env": {k: v for k, v in os.environ.items()
                                                                          if k.startswith(("ATDP_", "MALLOC_"))},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(f"{len(res.proxy)} proxied calls in {args.duration:.0f} s at {args.rate:.0f}/s; statuses {statuses}; "
          f"connection errors {res.errors or 0}")
    if drained:
        print(f"steps answered {len(res.step_ids)}, lost {len(lost)} (writer drained in {drain_s:.1f} s after the load)")
    else:  # not lost: still held or spooled when the wait ended, and unverified
        print(f"steps answered {len(res.step_ids)}; NOT DRAINED after {drain_s:.0f} s: {len(lost)} not yet in the "
              f"database (held by the proxy or spooled; not verified)")
    for e in events:
        print(f"  t={e['t']:.0f} s: {e['event']}")
    def entries(c: dict[str, list[int]]) -> str:
        return ", ".join(f"{k} {a:,} -> {b:,}" for k, (a, b) in c.items() if a or b) or "-"

    print(f"proxy RSS {proxy_rss}; caches from the warm-up to the end (entries): {entries(proxy_caches)}")
    for w in writers:
        print(f"writer {w['pid']} (t {w['from_t']:.0f}-{w['to_t']:.0f} s) RSS {w['rss']}"
              + ("" if w["judged"] else " (not judged: too short after its warm-up)")
              + f"; caches (entries): {entries(w['caches'])}")
    print("| window | calls | proxy p50 / p99 (ms) | direct p50 / p99 (ms) | added p99 (ms) | load avg (mean / max) "
          "| 503 (writer behind) | held for the writer, max steps / MB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")

    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    for w in windows:
        tag = f" ({'; '.join(w['incidents'])})" if w["incidents"] else ""
        print(f"| {w['from_s']:.0f}-{w['to_s']:.0f} s{tag} | {w['calls']} | {f(w['proxy_p50_ms'])} / "
              f"{f(w['proxy_p99_ms'])} | {f(w['direct_p50_ms'])} / {f(w['direct_p99_ms'])} | {f(w['added_p99_ms'])} | "
              f"{f(w['load_mean'])} / {f(w['load_max'])} | {w['refused_503']} | "
              f"{'-' if w['held_max'] is None else w['held_max']} / {f(w['held_mb_max'])} |")
    for c in criteria:
        print(f"{'PASS' if c['pass'] else 'FAIL'}: {c['criterion']}: {c['measured']}")
    verdict = all(c["pass"] for c in criteria)
    print(f"{'PASS' if verdict else 'FAIL'} overall; wrote {args.out}")
    return 0 if verdict else 1


def judge(windows: list[dict], proxy_rss: dict | None, writers: list[dict], args: argparse.Namespace) -> list[dict]:
    """The run's goals, each with what was measured: 0 steps lost is checked by the caller."""
    out = []

    def rss(name: str, g: dict | None) -> None:
        if g is None:
            out.append({"criterion": f"{name} RSS growth < {RSS_LIMIT:.0%}", "measured": "too few samples",
                        "pass": False})
            return
        out.append({"criterion": f"{name} RSS growth < {RSS_LIMIT:.0%} (median of the first {args.window:.0f} s "
                                 f"after a {args.warmup:.0f} s warm-up -> median of the last {args.window:.0f} s)",
                    "measured": f"{g['from_mb']} -> {g['to_mb']} MB ({g['growth']:+.1%})",
                    "pass": g["growth"] < RSS_LIMIT})

    rss("proxy", proxy_rss)
    for w in writers:
        if w["judged"]:
            rss(f"writer {w['pid']}", w["rss"])
    # p99 stability: each later window's added p99 against the first window after the warm-up,
    # windows with an incident (PostgreSQL restart, writer kill) shown but not judged.
    after = [w for w in windows if w["from_s"] >= args.warmup and w["added_p99_ms"] is not None]
    base = next((w for w in after if not w["incidents"]), None)
    if base is None:
        out.append({"criterion": "added p99 stable", "measured": "no window after the warm-up", "pass": False})
        return out
    ratios = [(w, w["added_p99_ms"] / max(base["added_p99_ms"], 1.0)) for w in after if not w["incidents"]]
    worst = max(ratios, key=lambda x: x[1])
    out.append({"criterion": f"added p99 stable: every window without an incident within {P99_RATIO:g}x the first "
                             f"after the warm-up ({base['from_s']:.0f}-{base['to_s']:.0f} s, "
                             f"{base['added_p99_ms']:.1f} ms)",
                "measured": f"worst {worst[0]['added_p99_ms']:.1f} ms ({worst[1]:.2f}x) at "
                            f"{worst[0]['from_s']:.0f}-{worst[0]['to_s']:.0f} s, load {worst[0]['load_mean']}; "
                            f"incident windows: " + ", ".join(f"{w['from_s']:.0f}-{w['to_s']:.0f} s "
                                                              f"{w['added_p99_ms']:.1f} ms"
                                                              for w in after if w["incidents"]),
                "pass": worst[1] <= P99_RATIO})
    return out


if __name__ == "__main__":
    raise SystemExit(main())
