"""Swap latency: POST /atdp/v1/versions until the new version serves, next to vLLM's bare reload.

Starts vLLM (CPU, tiny model) and the proxy (in this process, with a scratch PostgreSQL database),
then alternates the seed-0 and seed-1 tiny checkpoints:
    proxy    the whole swap as the proxy runs it: gate closed, drained, pause, reload, tag, resume,
             gate reopened (`swap.seconds` in the answer), and the client's view of the POST
    bare     vLLM's own `POST /collective_rpc reload_weights` on the same checkpoints (no pause)
and checks that the first answer after each swap is stamped with the new version.

  python bench/swap_latency.py [--swaps 10] [--out bench/results/swap_latency.json]

Database: ATDP_DATABASE_URL, else a scratch database on ATDP_TEST_DATABASE_URL's server.
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


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))], 4)


def main() -> None:
    import uvicorn

    from proxy.app import create_app
    from proxy.config import Settings
    from proxy.demo.model_zoo import cached_tiny_model
    from proxy.demo.vllm import VLLMServer, find_vllm_python, free_port
    from proxy.governance.redaction import RedactionConfig, Redactor

    p = argparse.ArgumentParser()
    p.add_argument("--swaps", type=int, default=10)
    p.add_argument("--out")
    args = p.parse_args()
    python = find_vllm_python()
    if python is None:
        raise SystemExit("no vLLM environment: run scripts/vllm_env.sh")
    dirs = [cached_tiny_model(seed=0), cached_tiny_model(seed=1)]
    url, drop = scratch_database()
    try:
        with VLLMServer(python=python, model_dir=dirs[0], served_name="tiny") as engine, \
                tempfile.TemporaryDirectory() as home:
            settings = Settings(home=Path(home), database_url=url, upstream_urls=[engine.base_url], open_mode=True,
                                secret=b"bench", admin_key=ADMIN, port=free_port())
            app = create_app(settings, redactor=Redactor(RedactionConfig(salt=b"bench")))
            server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=settings.port, log_level="warning"))
            threading.Thread(target=server.run, daemon=True).start()
            proxy = f"http://127.0.0.1:{settings.port}"
            if not app.state.versions.ready.wait(120):
                raise SystemExit("the proxy did not load its versions")
            headers = {"authorization": f"Bearer {ADMIN}"}
            client = httpx.Client(timeout=300, trust_env=False)
            proxy_s, client_s, bare_s, loads = [], [], [], []
            names = ["s0", "s1"]
            for i in range(args.swaps):
                k = (i + 1) % 2  # start by swapping to seed 1
                t0 = time.perf_counter()
                r = client.post(proxy + "/atdp/v1/versions", headers=headers,
                                json={"checkpoint": str(dirs[k]), "name": names[k]})
                client_s.append(time.perf_counter() - t0)
                r.raise_for_status()
                body = r.json()
                proxy_s.append(body["swap"]["seconds"])
                loads.extend(x["load_s"] for x in body["swap"]["replicas"])
                chat = client.post(proxy + "/v1/chat/completions", json={
                    "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
                assert chat.status_code == 200
                app.state.atdp.recorder.flush(30)
                from sqlalchemy import select

                from proxy.store import tables as t

                with app.state.atdp.factory() as s:
                    step = s.scalars(select(t.Step).order_by(t.Step.started_at.desc()).limit(1)).one()
                assert step.model_version == names[k], (step.model_version, names[k])
            for i in range(args.swaps):
                t0 = time.perf_counter()
                client.post(engine.base_url + "/collective_rpc", json={
                    "method": "reload_weights", "kwargs": {"weights_path": str(dirs[(i + 1) % 2])}}).raise_for_status()
                bare_s.append(time.perf_counter() - t0)
            # leave the engine as it started (seed 0)
            client.post(engine.base_url + "/collective_rpc", json={
                "method": "reload_weights", "kwargs": {"weights_path": str(dirs[0])}}).raise_for_status()
            server.should_exit = True
    finally:
        drop()
    result = {
        "swaps": args.swaps,
        "proxy_swap_s": {"p50": pct(proxy_s, 0.5), "p90": pct(proxy_s, 0.9), "mean": round(statistics.fmean(proxy_s), 4)},
        "client_post_s": {"p50": pct(client_s, 0.5), "p90": pct(client_s, 0.9)},
        "pause_reload_tag_resume_s": {"p50": pct(loads, 0.5), "p90": pct(loads, 0.9)},
        "bare_reload_rpc_s": {"p50": pct(bare_s, 0.5), "p90": pct(bare_s, 0.9)},
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
