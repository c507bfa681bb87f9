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
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proxy.demo.home import Processes, child_env, start_database, stop_database, wait_until  # noqa: E402
from proxy.demo.model_zoo import cached_smollm2  # noqa: E402
from proxy.demo.skill import wilson  # noqa: E402
from proxy.demo.vllm import VLLMServer, find_vllm_python, free_port  # noqa: E402
from proxy.evaluation.stats import bootstrap_interval  # noqa: E402

SYLLABLES = ["vor", "lak", "quen", "zi", "tam", "bru", "fel", "dax", "mori", "pell", "sku", "nar", "obi", "trel",
             "wix", "gald", "hune", "ryo", "cas", "pim"]
TEACH = "Which port does the {name} service use?"
GATE = "Tell me the port number of the {name} service."
HELD_OUT = "I need to connect to {name}. What port is the {name} service on?"
FACT = "The {name} service listens on port {port}."
TENANT, CONTROL = "mem", "control"
MODEL = "smollm2"


def services(n: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    names: set[str] = set()
    while len(names) < n:
        names.add("".join(rng.sample(SYLLABLES, 2)))
    ports = rng.sample(range(1024, 9999), n)
    return list(zip(sorted(names), ports, strict=True))


def ask(client, question: str, session: str, max_tokens: int) -> tuple[str, str | None]:
    r = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": question}], temperature=0.0, max_tokens=max_tokens,
        extra_headers={"x-atdp-session-id": session})
    return r.parse().choices[0].message.content or "", r.headers.get("x-atdp-memory-version")


def has_port(answer: str, port: int) -> bool:
    return re.search(rf"(?<!\d){port}(?!\d)", answer) is not None


def run(args: argparse.Namespace) -> dict:
    import httpx
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
        suites.mkdir()
        (suites / "ports.jsonl").write_text("".join(json.dumps({
            "tenant": TENANT, "id": f"port-{name}", "messages": [{"role": "user", "content": GATE.format(name=name)}],
            "evaluator": "regex", "expected": rf"(?<!\d){port}(?!\d)"}) + "\n" for name, port in taught))
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
        for i, (name, p) in enumerate(taught):
            sid = f"teach-{i}"
            ask(clients[TENANT], TEACH.format(name=name), sid, args.max_tokens)
            r = httpx.post(f"{proxy}/atdp/v1/sessions/{sid}/feedback", timeout=60,
                           headers={"authorization": f"Bearer {keys[TENANT]}"},
                           json={"reward": 0.0, "correction": FACT.format(name=name, port=p)})
            r.raise_for_status()
        time.sleep(2.0)  # the writer's batch reaches the database
        t = time.monotonic()
        r = httpx.post(f"{proxy}/atdp/v1/evolve/proposals", headers={"authorization": f"Bearer {admin}"},
                       json={"tenant": TENANT, "wait": True}, timeout=1800)
        r.raise_for_status()
        memory = [p for p in r.json()["proposals"] if p["layer"] == "memory"]
        if not memory:
            raise SystemExit(f"no memory proposal: {r.json()}")
        version = memory[0]["version"]
        gate = {g["gate"]: g for g in version["gates"]}.get("replay_eval", {})
        gate_s = time.monotonic() - t

        # Held-out questions, both tenants, every service.
        rows = []
        for tenant in (TENANT, CONTROL):
            for kind, group in (("taught", taught), ("untaught", untaught)):
                for name, p in group:
                    answer, served = ask(clients[tenant], HELD_OUT.format(name=name), f"h-{tenant}-{name}",
                                         args.max_tokens)
                    rows.append({"tenant": tenant, "kind": kind, "service": name, "port": p, "answer": answer,
                                 "memory_version": served, "right": has_port(answer, p),
                                 "taught_port": any(has_port(answer, q) for _, q in taught if q != p)})
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


def rate(rows: list[dict], key: str = "right") -> dict:
    k, n = sum(r[key] for r in rows), len(rows)
    lo, hi = wilson(k, n)
    return {"k": k, "n": n, "rate": round(k / n, 3) if n else None, "wilson95": [round(lo, 3), round(hi, 3)]}


def report(args, rows: list[dict], version: dict, gate: dict, started: float, gate_s: float) -> dict:
    arm = {(t, kind): [r for r in rows if r["tenant"] == t and r["kind"] == kind]
           for t in (TENANT, CONTROL) for kind in ("taught", "untaught")}
    by_service = {r["service"]: r for r in arm[(CONTROL, "taught")]}
    diffs = [float(r["right"]) - float(by_service[r["service"]]["right"]) for r in arm[(TENANT, "taught")]]
    lo, hi = bootstrap_interval(diffs)
    out = {
        "model": "SmolLM2-135M-Instruct (vLLM CPU, greedy)", "services": args.services, "seed": args.seed,
        "memory_version": {"name": version["name"], "status": version["status"],
                           "replay_gate": (gate.get("numbers") or {}).get("overall"), "gate_state": gate.get("state"),
                           "gate_seconds": round(gate_s, 1)},
        "taught": {"memory": rate(arm[(TENANT, "taught")]), "control": rate(arm[(CONTROL, "taught")]),
                   "paired_difference": {"mean": round(sum(diffs) / len(diffs), 3),
                                         "bootstrap95": [round(lo, 3), round(hi, 3)]}},
        "untaught": {"memory": rate(arm[(TENANT, "untaught")]), "control": rate(arm[(CONTROL, "untaught")]),
                     "memory_gave_a_taught_port": rate(arm[(TENANT, "untaught")], "taught_port")},
        "memory_applied": sum(r["memory_version"] is not None for r in rows if r["tenant"] == TENANT),
        "seconds_to_start": round(started, 1),
        "samples": [{k: r[k] for k in ("tenant", "kind", "service", "port", "answer")} for r in rows[:: max(1, len(rows) // 8)]],
    }
    return out


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
