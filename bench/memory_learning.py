"""Memory, measured: does a memory version built from users' corrections raise the score on held-out
questions that need those facts, beside a control that gets no memory? SmolLM2-135M-Instruct on vLLM
(CPU), the real proxy (`atdp serve`) on an embedded PostgreSQL, gates on.

  python bench/memory_learning.py [--services 40] [--out bench/results/memory_learning.json]

1. Made-up services, each with a random port (the model cannot know them); half are *taught*, half not.
2. Teaching, as users would: a session asks about a taught service (phrasing T), the model answers, the
   user's feedback corrects it ("The <name> service listens on port <p>.").
3. `POST /atdp/v1/evolve/proposals` turns the corrections into a memory candidate. Its replay gate runs
   an operator suite on the taught services (phrasing G) and promotes or rejects it.
4. Held-out questions (phrasing H, used nowhere else) about every service, asked as the tenant (its
   memory serves) and as a control tenant (no memory): same model, greedy, same questions. Score: the
   answer contains the port. Reported: each arm's rate with a Wilson 95% interval; on the taught
   services the paired difference with a bootstrap 95% interval; on the untaught ones, how often the
   memory arm answers with a port of a *taught* service (memory misleading it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proxy.demo.home import Processes, child_env, start_database, stop_database, wait_until  # noqa: E402
from proxy.demo.layers import (  # noqa: E402
    compare,
    held_out,
    propose_memory,
    rows_as_dicts,
    services,
    teach,
    write_memory_suite,
)
from proxy.demo.model_zoo import cached_smollm2  # noqa: E402
from proxy.demo.vllm import VLLMServer, find_vllm_python, free_port  # noqa: E402

TENANT, CONTROL = "mem", "control"
MODEL = "smollm2"


def run(args: argparse.Namespace) -> dict:
    import openai

    from proxy.auth import create_key
    from proxy.store import db

    vllm_python = find_vllm_python() or sys.exit("no vLLM environment: run scripts/vllm_env.sh")
    home = Path(tempfile.mkdtemp(prefix="atdp-memory-bench-"))
    procs = Processes(home / "processes.json")
    catalog = services(args.services, args.seed)
    taught, untaught = catalog[: len(catalog) // 2], catalog[len(catalog) // 2:]
    t0 = time.monotonic()
    try:
        model_dir = cached_smollm2()
        url = start_database(home, fresh=True)
        engine = db.make_engine(url)
        with db.transaction(db.session_factory(engine)) as s:
            keys = {t: create_key(s, t, name="bench")[1] for t in (TENANT, CONTROL)}
        engine.dispose()
        suites = home / "suites"
        write_memory_suite(suites, TENANT, taught)
        vllm = VLLMServer(python=vllm_python, model_dir=model_dir, served_name=MODEL, max_model_len=1024,
                          log_path=home / "vllm.log")
        vllm.start()
        procs.add_vllm(vllm)
        port = free_port()
        proxy = f"http://127.0.0.1:{port}"
        admin = "bench-admin-key"
        env = child_env(home, ATDP_ADMIN_KEY=admin, ATDP_HOST="127.0.0.1", ATDP_PORT=str(port),
                        ATDP_UPSTREAM_URL=vllm.base_url, ATDP_TOKENIZER=str(model_dir), ATDP_EVAL_SUITES=str(suites),
                        ATDP_EVAL_MIN_CASES=str(min(10, len(taught))), ATDP_EVAL_MAX_TOKENS=str(args.max_tokens))
        procs.spawn("proxy", [sys.executable, "-m", "proxy.cli", "serve", "--log-level", "warning"], env,
                    home / "proxy.log")
        wait_until("vLLM", lambda: _ok(vllm.base_url + "/health"), timeout=900, procs=procs, alive=("vllm", "proxy"))
        wait_until("the proxy", lambda: _ok(proxy + "/healthz"), timeout=300, procs=procs, alive=("vllm", "proxy"))
        started = time.monotonic() - t0
        clients = {t: openai.OpenAI(base_url=proxy + "/v1", api_key=k, max_retries=0, timeout=300) for t, k in keys.items()}

        # Teaching: the model is asked, and the user corrects it.
        teach(clients[TENANT], proxy, keys[TENANT], MODEL, taught, args.max_tokens)
        time.sleep(2.0)  # the writer's batch reaches the database
        t = time.monotonic()
        version = propose_memory(proxy, admin, TENANT)
        gate = {g["gate"]: g for g in version["gates"]}.get("replay_eval", {})
        gate_s = time.monotonic() - t
        rows = held_out({t: clients[t] for t in (TENANT, CONTROL)}, MODEL, taught, untaught, args.max_tokens)
        return report(args, rows, version, gate, started, gate_s)
    finally:
        procs.stop_all()
        stop_database(home)
        if not args.keep:
            shutil.rmtree(home, ignore_errors=True)


def _ok(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def report(args, rows, version: dict, gate: dict, started: float, gate_s: float) -> dict:
    return {
        "model": "SmolLM2-135M-Instruct (vLLM CPU, greedy)", "services": args.services, "seed": args.seed,
        "memory_version": {"name": version["name"], "status": version["status"],
                           "replay_gate": (gate.get("numbers") or {}).get("overall"), "gate_state": gate.get("state"),
                           "gate_seconds": round(gate_s, 1)},
        **compare(rows, TENANT, CONTROL),
        "seconds_to_start": round(started, 1),
        "samples": rows_as_dicts(rows)[:: max(1, len(rows) // 8)],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--services", type=int, default=40)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "memory_learning.json")
    p.add_argument("--keep", action="store_true", help="keep the scratch home (logs, database)")
    args = p.parse_args()
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2))


if __name__ == "__main__":
    main()
