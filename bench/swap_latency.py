"""Swap latency and swaps under load, in both swap modes, next to vLLM's bare reload.

Starts vLLM (CPU, tiny model, with its token-in-token-out routes on) and, per mode, a proxy (in this
process, with a scratch PostgreSQL database), then alternates the seed-0 and seed-1 tiny checkpoints.

Quiet swaps (`--swaps`, no traffic):
    proxy    the whole swap as the proxy runs it (`swap.seconds` in the answer) and the client's POST
    window   pause -> resume on the engine (keep: what a request in flight waits)
    bare     vLLM's own `POST /collective_rpc reload_weights` on the same checkpoints (no pause)
and checks that the first answer after each swap is stamped with the new version.

Swaps under load (`--load-swaps`): `--workers` clients call the proxy (chat completions, streamed
and not; one worker's calls run `--long-tokens` tokens, longer than the lowered drain and hold
timeouts, `--hold-timeout`), one client calls the engine's `/inference/v1/generate` directly, and
a poller reads the engine's `/weight_info` every few ms. Counted:
    failed       calls that did not answer 200
    ambiguous    steps whose generation overlapped an update (keep; chat completions carry no spans)
    wrong        tokens of steps stamped with one version the engine's label never was during the
                 call (the poller's timeline): goal 0; `label_moved_tokens`: stamped with one
                 version while the label changed during the client's view of the call (an upper
                 bound: it includes a wait at a closed gate)
    spans        generate requests the engine reported with two versions, and tokens whose span
                 names a version the engine did not serve during the request (requests the
                 poller's timeline does not bracket are counted apart, not as wrong)

  python bench/swap_latency.py [--modes keep,drain] [--swaps 10] [--load-swaps 4] [--out FILE]

Database: ATDP_DATABASE_URL, else a scratch database per mode on ATDP_TEST_DATABASE_URL's server.
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
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ADMIN = "bench-admin-key"
HEADERS = {"authorization": f"Bearer {ADMIN}"}


def scratch_database() -> tuple[str, callable]:
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    from proxy.store import db

    if url := os.environ.get("ATDP_DATABASE_URL"):
        return url, lambda: None
    server = os.environ.get("ATDP_TEST_DATABASE_URL")
    if not server:
        raise SystemExit("set ATDP_DATABASE_URL or ATDP_TEST_DATABASE_URL")
    admin_url = db.sqlalchemy_url(server)
    name = f"atdp_bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        with admin.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return make_url(admin_url).set(database=name).render_as_string(hide_password=False), drop


def pct(xs: list[float], q: float) -> float | None:
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))], 4) if s else None


def summary(xs: list[float]) -> dict:
    return {"p50": pct(xs, 0.5), "p90": pct(xs, 0.9), "mean": round(statistics.fmean(xs), 4) if xs else None, "n": len(xs)}


class Timeline:
    """The engine's weight label over time, polled from /weight_info."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.points: list[tuple[float, str]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=10, trust_env=False) as c:
            while not self.stop.is_set():
                try:
                    v = c.get(self.base_url + "/weight_info").json()["weight_version"]
                    self.points.append((time.monotonic(), v))
                except httpx.HTTPError:
                    pass
                time.sleep(0.003)

    def labels(self, t0: float, t1: float) -> set[str] | None:
        """Every label the engine may have had during [t0, t1]: the polls from the last one at or before
        t0 to the first one at or after t1 (a poll the loaded machine delayed cannot hide a change).
        None when the polls do not bracket the interval."""
        first = max((i for i, (t, _) in enumerate(self.points) if t <= t0), default=None)
        last = min((i for i, (t, _) in enumerate(self.points) if t >= t1), default=None)
        if first is None or last is None:
            return None
        return {v for _, v in self.points[first : last + 1]}


def run_mode(mode: str, engine, dirs: list[Path], names: list[str], args) -> dict:
    import uvicorn
    from sqlalchemy import select

    from proxy.app import create_app
    from proxy.config import Settings
    from proxy.demo.vllm import free_port
    from proxy.governance.redaction import RedactionConfig, Redactor
    from proxy.store import tables as t
    from proxy.store.tokens import unrle

    url, drop = scratch_database()
    server = thread = None
    try:
        with tempfile.TemporaryDirectory() as home:
            settings = Settings(home=Path(home), database_url=url, upstream_urls=[engine.base_url], open_mode=True,
                                secret=b"bench", admin_key=ADMIN, port=free_port(), swap_mode=mode,
                                swap_hold_timeout_s=args.hold_timeout, swap_drain_timeout_s=args.hold_timeout * 2,
                                checkpoint_roots=[Path("/")])
            app = create_app(settings, redactor=Redactor(RedactionConfig(salt=b"bench")))
            server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=settings.port, log_level="warning"))
            thread = threading.Thread(target=server.run, daemon=True)
            thread.start()
            proxy = f"http://127.0.0.1:{settings.port}"
            if not app.state.versions.ready.wait(120):
                raise SystemExit("the proxy did not load its versions")
            state = app.state.atdp
            # a new connection per swap: a kept-alive one the proxy closed after its idle timeout (a
            # swap comes seconds after the last) fails a POST with "disconnected without a response"
            client = httpx.Client(timeout=300, trust_env=False, limits=httpx.Limits(max_keepalive_connections=0))
            k = 0

            def swap() -> dict:
                """One swap to the other checkpoint; a failed one (502, the old version serves) is counted."""
                nonlocal k
                t0 = time.perf_counter()
                for _ in range(5):  # a 503 (the database did not answer in time: nothing was touched) is retried
                    r = client.post(proxy + "/atdp/v1/versions", headers=HEADERS,
                                    json={"checkpoint": str(dirs[1 - k]), "name": names[1 - k], "promote": "now"})
                    if r.status_code != 503:
                        break
                    print(f"swap answered 503 ({r.text[:120]}); again", file=sys.stderr, flush=True)
                    time.sleep(float(r.headers.get("retry-after", "5")))
                if r.status_code not in (200, 502) or "swap" not in r.json():
                    raise SystemExit(f"swap refused: {r.status_code} {r.text[:300]}")
                out = {"client_s": time.perf_counter() - t0, "t1": time.monotonic(), **r.json()["swap"]}
                if out["ok"]:
                    k = 1 - k
                return out

            quiet = []
            for _ in range(args.swaps):
                quiet.append(swap())
                chat = client.post(proxy + "/v1/chat/completions", json={
                    "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
                assert chat.status_code == 200 and chat.headers["x-atdp-model-version"] == names[k], chat.headers
            loaded = under_load(proxy, engine.base_url, swap, args)
            if k:  # leave the engine on seed 0 for the next mode
                swap()
            state.recorder.flush(60)
            with state.factory() as s:
                steps = {st.id: st for st in s.scalars(select(t.Step))}
    finally:
        # The proxy stops before its database goes (DROP ... WITH (FORCE) under a running proxy
        # made its writer and swap bus fail noisily after an earlier error).
        if server is not None:
            server.should_exit = True
        if thread is not None:
            thread.join(60)
        drop()

    timeline: Timeline = loaded.pop("timeline")
    wrong_tokens = moved_tokens = ambiguous = exact = unbracketed = 0
    for step_id, t0, t1 in loaded.pop("calls"):
        st = steps.get(step_id)
        if st is None:
            continue
        versions = set(unrle(st.output_versions))
        if any("|" in v for v in versions):
            ambiguous += 1
            continue
        exact += 1
        engine_labels = timeline.labels(t0, t1)
        if engine_labels is None:
            unbracketed += 1
        elif not versions <= engine_labels:  # stamped with a version the engine never had during the call
            wrong_tokens += len(st.output_token_ids)
        elif engine_labels != versions:  # the label moved during a call stamped with one version
            moved_tokens += len(st.output_token_ids)
    windows = [r["window_s"] for sw in quiet for r in sw["replicas"]]
    return {
        "mode": mode,
        "quiet": {"swaps": len(quiet), "proxy_swap_s": summary([sw["seconds"] for sw in quiet]),
                  "client_post_s": summary([sw["client_s"] for sw in quiet]), "window_s": summary(windows),
                  "routes_s": {r: summary([x["routes_s"][r] for sw in quiet for x in sw["replicas"]])
                               for r in quiet[0]["replicas"][0]["routes_s"]}},
        "load": {**loaded, "steps_exact": exact, "steps_ambiguous": ambiguous, "wrong_version_tokens": wrong_tokens,
                 "steps_not_bracketed_by_polls": unbracketed,
                 # an upper bound: the client's interval includes a wait at a closed gate and its own lag
                 "label_moved_tokens": moved_tokens},
    }


def under_load(proxy: str, engine_url: str, swap, args) -> dict:
    """Swaps while clients call; returns the counts and each call's (step id, start, end)."""
    stop = threading.Event()
    calls: list[tuple[str, float, float]] = []
    failures: list[str] = []
    long_s: list[float] = []
    spans: list[dict] = []
    timeline = Timeline(engine_url)
    threading.Thread(target=timeline.run, daemon=True).start()

    def worker(i: int) -> None:
        long = i == 0
        with httpx.Client(timeout=600, trust_env=False) as c:
            n = 0
            while not stop.is_set():
                n += 1
                body = {"model": "tiny", "messages": [{"role": "user", "content": f"w{i} q{n}"}], "temperature": 0,
                        "max_tokens": args.long_tokens if long else 48, "ignore_eos": True, "stream": bool(n % 2)}
                t0 = time.monotonic()
                try:
                    with c.stream("POST", proxy + "/v1/chat/completions", json=body) as r:
                        r.read()
                        if r.status_code != 200:
                            failures.append(f"{r.status_code}: {r.text[:200]}")
                            continue
                        calls.append((r.headers["x-atdp-step-id"], t0, time.monotonic()))
                    if long:
                        long_s.append(time.monotonic() - t0)
                except httpx.HTTPError as e:
                    failures.append(f"{type(e).__name__}: {e}")

    def generate() -> None:
        with httpx.Client(timeout=600, trust_env=False) as c:
            n = 0
            while not stop.is_set():
                n += 1
                body = {"model": "tiny", "token_ids": [5 + n % 50, 17, 23, 42],
                        "sampling_params": {"max_tokens": 400, "temperature": 0, "ignore_eos": True}}
                t0 = time.monotonic()
                try:
                    r = c.post(engine_url + "/inference/v1/generate", json=body)
                except httpx.HTTPError as e:
                    failures.append(f"generate {type(e).__name__}: {e}")
                    continue
                if r.status_code != 200:
                    failures.append(f"generate {r.status_code}: {r.text[:200]}")
                    continue
                choice = r.json()["choices"][0]
                spans.append({"spans": choice.get("weight_versions") or [], "n": len(choice.get("token_ids") or []),
                              "t": (t0, time.monotonic())})

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(args.workers)]
    threads.append(threading.Thread(target=generate, daemon=True))
    for th in threads:
        th.start()
    time.sleep(args.settle)
    results = []
    for _ in range(args.load_swaps):
        results.append(swap())
        time.sleep(args.between)
    stop.set()
    for th in threads:
        th.join(600)
    # a poll after the last call ends (a loaded machine can delay the poller past a fixed wait)
    last = max([c[2] for c in calls] + [sp["t"][1] for sp in spans], default=time.monotonic())
    deadline = time.monotonic() + 10
    while (not timeline.points or timeline.points[-1][0] < last) and time.monotonic() < deadline:
        time.sleep(0.05)
    timeline.stop.set()
    for sp in spans:
        sp["labels"] = timeline.labels(*sp["t"])
    two = sum(1 for s in spans if len({x["version"] for x in s["spans"]}) > 1)
    # A request the polls do not bracket (the loaded poller fell behind) is counted apart, not as wrong.
    bad_span_tokens = sum(x["end"] - x["start"] for s in spans if s["labels"] is not None for x in s["spans"]
                          if x["version"] not in s["labels"])
    gen_unbracketed = sum(1 for s in spans if s["labels"] is None)
    uncovered = sum(1 for s in spans if sum(x["end"] - x["start"] for x in s["spans"]) != s["n"])
    return {"swaps": len(results), "swap_ok": sum(1 for r in results if r["ok"]),
            "swap_errors": [r["error"] for r in results if not r["ok"]],
            "window_s": summary([x["window_s"] for r in results for x in r["replicas"] if "window_s" in x]),
            "drain_s": summary([x["drain_s"] for r in results for x in r["replicas"] if "drain_s" in x]),
            "calls_ok": len(calls), "calls_failed": len(failures), "failures": failures[:5],
            "long_call_s": summary(long_s), "hold_timeout_s": args.hold_timeout,
            "generate_requests": len(spans), "generate_two_versions": two, "generate_span_tokens_wrong": bad_span_tokens,
            "generate_spans_not_covering": uncovered, "generate_not_bracketed_by_polls": gen_unbracketed, "calls": calls, "timeline": timeline}


def main() -> None:
    from proxy.demo.model_zoo import cached_tiny_model
    from proxy.demo.vllm import VLLMServer, find_vllm_python

    p = argparse.ArgumentParser()
    p.add_argument("--modes", default="keep,drain")
    p.add_argument("--swaps", type=int, default=10)
    p.add_argument("--load-swaps", type=int, default=4)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--long-tokens", type=int, default=2000)
    p.add_argument("--hold-timeout", type=float, default=1.0, help="stands in for the default 60 s")
    p.add_argument("--settle", type=float, default=2.0)
    p.add_argument("--between", type=float, default=1.5)
    p.add_argument("--out")
    args = p.parse_args()
    python = find_vllm_python()
    if python is None:
        raise SystemExit("no vLLM environment: run scripts/vllm_env.sh")
    dirs = [cached_tiny_model(seed=0), cached_tiny_model(seed=1)]
    names = ["s0", "s1"]
    result: dict = {"modes": []}
    with VLLMServer(python=python, model_dir=dirs[0], served_name="tiny", extra_args=["--enable-scale-out"]) as engine:
        client = httpx.Client(timeout=300, trust_env=False)
        bare = []
        for i in range(args.swaps):
            t0 = time.perf_counter()
            client.post(engine.base_url + "/collective_rpc", json={
                "method": "reload_weights", "kwargs": {"weights_path": str(dirs[(i + 1) % 2])}}).raise_for_status()
            bare.append(time.perf_counter() - t0)
        if args.swaps % 2:
            client.post(engine.base_url + "/collective_rpc", json={
                "method": "reload_weights", "kwargs": {"weights_path": str(dirs[0])}}).raise_for_status()
        result["bare_reload_rpc_s"] = summary(bare)
        for mode in args.modes.split(","):
            result["modes"].append(run_mode(mode, engine, dirs, names, args))
            if args.out:  # a later mode that breaks leaves this one's figures
                Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    for m in result["modes"]:
        w = m["quiet"]["window_s"]["p50"]
        m["window_over_bare_p50"] = round(w / result["bare_reload_rpc_s"]["p50"], 2) if w else None
    print(json.dumps(result, indent=2, default=str))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
