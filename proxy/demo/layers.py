"""The demo's memory and harness rounds: a version of each layer, proposed, gated and measured.

Memory: made-up services, each with a port the model cannot know; half of them are *taught*. A user
asks about a taught service (phrasing TEACH), the model answers, and the user's feedback corrects it
("The <name> service listens on port <p>."). `POST /atdp/v1/evolve/proposals` turns the corrections
into a memory candidate; its replay gate runs an operator suite on the taught services (phrasing GATE).
Then held-out questions (phrasing HELD_OUT, used nowhere else) about every service go to the tenant and
to a control tenant that has no memory: same model, greedy. An answer is right when it holds the port.

Harness: an operator's overlay for the lookup task's tenant (a system-prompt addition that spells out
the two turns), posted as a harness candidate and gated on the tenant's held-out sessions and suite.

Every candidate meets the same gates as a weight version; where a canary is configured, a layer
candidate that passes them serves a share of the scope's new sessions (no replica of its own), so the
held-out rows record which arm answered (`x-atdp-memory-version`). bench/memory_learning.py runs the
memory round alone, larger, with no canary.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from proxy.demo.skill import wilson
from proxy.evaluation.stats import bootstrap_interval

if TYPE_CHECKING:
    import openai

    from proxy.demo.board import Board

SYLLABLES = ["vor", "lak", "quen", "zi", "tam", "bru", "fel", "dax", "mori", "pell", "sku", "nar", "obi", "trel",
             "wix", "gald", "hune", "ryo", "cas", "pim"]
TEACH = "Which port does the {name} service use?"
GATE = "Tell me the port number of the {name} service."
HELD_OUT = "I need to connect to {name}. What port is the {name} service on?"
FACT = "The {name} service listens on port {port}."
MEMORY_SUITE = "memory.jsonl"  # beside the demo's own suite file; its cases name their tenant
HINT = ('Work in two turns. First reply with only lookup("ITEM"), where ITEM is the exact name in the '
        'question. When the result comes back, reply with only the number it returned.')


@dataclass(frozen=True)
class Service:
    name: str
    port: int


@dataclass(frozen=True)
class Row:
    """One held-out question and its answer."""

    tenant: str
    kind: str  # taught | untaught
    service: str
    port: int
    answer: str
    memory_version: str | None  # the memory version that served the call (its response header)
    right: bool  # the answer holds the service's port
    taught_port: bool  # the answer holds another, taught service's port: memory misleading the model


def services(n: int, seed: int) -> list[Service]:
    """n made-up services with distinct random ports; the same seed gives the same services."""
    rng = random.Random(seed)
    names: set[str] = set()
    while len(names) < n:
        names.add("".join(rng.sample(SYLLABLES, 2)))
    ports = rng.sample(range(1024, 9999), n)
    return [Service(name, port) for name, port in zip(sorted(names), ports, strict=True)]


def has_port(answer: str, port: int) -> bool:
    return re.search(rf"(?<!\d){port}(?!\d)", answer) is not None


def write_memory_suite(folder: Path, tenant: str, taught: list[Service], max_tokens: int = 32) -> Path:
    """The memory candidate's operator suite: one GATE question per taught service, scored by its port."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / MEMORY_SUITE
    path.write_text("".join(json.dumps({
        "tenant": tenant, "id": f"port-{s.name}", "messages": [{"role": "user", "content": GATE.format(name=s.name)}],
        "evaluator": "regex", "expected": rf"(?<!\d){s.port}(?!\d)", "max_tokens": max_tokens}) + "\n"
        for s in taught))
    return path


def ask(client: openai.OpenAI, model: str, question: str, session: str, max_tokens: int) -> tuple[str, str | None]:
    """A one-turn session, greedy: (the answer, the memory version that served it or None)."""
    r = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": question}], temperature=0.0, max_tokens=max_tokens,
        extra_headers={"x-atdp-session-id": session})
    return r.parse().choices[0].message.content or "", r.headers.get("x-atdp-memory-version")


def teach(client: openai.OpenAI, proxy_url: str, key: str, model: str, taught: list[Service], max_tokens: int,
          prefix: str = "teach") -> None:
    """Users ask about each taught service and correct the model's answer in their feedback."""
    import httpx

    for i, s in enumerate(taught):
        sid = f"{prefix}-{i}"
        ask(client, model, TEACH.format(name=s.name), sid, max_tokens)
        r = httpx.post(f"{proxy_url}/atdp/v1/sessions/{sid}/feedback", timeout=60, trust_env=False,
                       headers={"authorization": f"Bearer {key}"},
                       json={"reward": 0.0, "correction": FACT.format(name=s.name, port=s.port)})
        r.raise_for_status()


def propose_memory(proxy_url: str, admin_key: str, tenant: str) -> dict[str, Any]:
    """The diagnosis's proposals for `tenant`, gated (waits for the gates); the memory candidate's detail."""
    import httpx

    r = httpx.post(f"{proxy_url}/atdp/v1/evolve/proposals", headers={"authorization": f"Bearer {admin_key}"},
                   json={"tenant": tenant, "wait": True}, timeout=1800, trust_env=False)
    r.raise_for_status()
    memory = [p for p in r.json()["proposals"] if p["layer"] == "memory"]
    if not memory or not memory[0].get("version"):
        raise RuntimeError(f"no memory candidate was proposed for {tenant}: {r.json()}")
    return memory[0]["version"]


def propose_harness(proxy_url: str, admin_key: str, tenant: str, hint: str = HINT) -> dict[str, Any]:
    """An operator's overlay for `tenant` as a harness candidate; answers once its gates are done."""
    import httpx

    r = httpx.post(f"{proxy_url}/atdp/v1/versions", headers={"authorization": f"Bearer {admin_key}"}, timeout=1800,
                   trust_env=False, json={"layer": "harness", "tenant": tenant, "overlay": {"system_append": hint},
                                          "reason": "operator: spell out the lookup task's two turns", "wait": True})
    r.raise_for_status()
    return r.json()


def held_out(clients: dict[str, openai.OpenAI], model: str, taught: list[Service], untaught: list[Service],
             max_tokens: int) -> list[Row]:
    """Every service's HELD_OUT question, asked as each tenant in `clients`, each in a session of its own."""
    taught_ports = {s.port for s in taught}
    rows = []
    for tenant, client in clients.items():
        for kind, group in (("taught", taught), ("untaught", untaught)):
            for s in group:
                answer, served = ask(client, model, HELD_OUT.format(name=s.name), f"h-{tenant}-{s.name}", max_tokens)
                rows.append(Row(tenant, kind, s.name, s.port, answer, served, has_port(answer, s.port),
                                any(has_port(answer, p) for p in taught_ports - {s.port})))
    return rows


def rate(rows: list[Row], key: str = "right") -> dict[str, Any]:
    k, n = sum(bool(getattr(r, key)) for r in rows), len(rows)
    lo, hi = wilson(k, n)
    return {"k": k, "n": n, "rate": round(k / n, 3) if n else None, "wilson95": [round(lo, 3), round(hi, 3)]}


def compare(rows: list[Row], tenant: str, control: str) -> dict[str, Any]:
    """Taught services: the tenant's answers that memory served against the control tenant's on the same
    services (rates with Wilson intervals, the paired difference with a bootstrap interval); the tenant's
    answers that memory did not serve (a canary's serving arm) apart; on untaught services, how often
    memory made the model answer with a taught service's port."""
    mine = [r for r in rows if r.tenant == tenant]
    ctrl = {(r.kind, r.service): r for r in rows if r.tenant == control}
    with_memory = [r for r in mine if r.kind == "taught" and r.memory_version]
    diffs = [float(r.right) - float(ctrl[("taught", r.service)].right) for r in with_memory]
    lo, hi = bootstrap_interval(diffs) if diffs else (None, None)
    untaught = [r for r in mine if r.kind == "untaught" and r.memory_version]
    return {
        "taught": {
            "memory": rate(with_memory),
            "control": rate([ctrl[("taught", r.service)] for r in with_memory]),
            "paired_difference": {"mean": round(sum(diffs) / len(diffs), 3) if diffs else None,
                                  "bootstrap95": [None if lo is None else round(lo, 3),
                                                  None if hi is None else round(hi, 3)]},
            "without_memory": rate([r for r in mine if r.kind == "taught" and not r.memory_version]),
        },
        "untaught": {"memory": rate(untaught), "memory_gave_a_taught_port": rate(untaught, "taught_port")},
        "memory_applied": sum(r.memory_version is not None for r in mine),
        "asked": len(mine),
    }


def memory_lines(result: dict[str, Any]) -> list[str]:
    """The comparison as the board shows it."""
    t, u = result["taught"], result["untaught"]

    def show(r: dict[str, Any]) -> str:
        lo, hi = r["wilson95"]
        return f"{r['k']}/{r['n']} [{lo:.2f}, {hi:.2f}]"

    d = t["paired_difference"]
    diff = "-" if d["mean"] is None else f"{d['mean']:+.2f} [{d['bootstrap95'][0]:+.2f}, {d['bootstrap95'][1]:+.2f}]"
    lines = [f"held-out, taught services: with memory {show(t['memory'])} vs control tenant {show(t['control'])}, "
             f"paired difference {diff}"]
    if t["without_memory"]["n"]:
        lines.append(f"held-out, taught services in the canary's serving arm (no memory): {show(t['without_memory'])}")
    lines.append(f"held-out, untaught services: memory answered with a taught port {show(u['memory_gave_a_taught_port'])}")
    return lines


def rows_as_dicts(rows: list[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]


# --- the demo's rounds -------------------------------------------------------------------------------

MEMORY_TENANT, CONTROL_TENANT = "demo-memory", "demo-control"


@dataclass
class LayerRound:
    """One layer candidate's round, as the summary records it."""

    layer: str
    version: str
    status: str
    gates: dict[str, Any]  # GateRound.as_dict()
    measured: dict[str, Any] | None = None  # the memory round's held-out comparison


def memory_round(board: Board, *, db_url: str, proxy_url: str, admin_key: str, model: str, suites: Path,
                 n_services: int, seed: int, max_tokens: int) -> LayerRound:
    """Users of MEMORY_TENANT correct the agent; the proposal becomes a memory candidate and meets the gates;
    held-out questions measure it against CONTROL_TENANT."""
    import time

    import openai

    from proxy.auth import create_key
    from proxy.demo.gates import GateRound, read_card
    from proxy.store import db

    catalog = services(n_services, seed)
    taught, untaught = catalog[: len(catalog) // 2], catalog[len(catalog) // 2:]
    engine = db.make_engine(db_url, pool_size=1, max_overflow=0)
    try:
        with db.transaction(db.session_factory(engine)) as s:
            keys = {t: create_key(s, t, name="demo")[1] for t in (MEMORY_TENANT, CONTROL_TENANT)}
    finally:
        engine.dispose()
    write_memory_suite(suites, MEMORY_TENANT, taught, max_tokens)
    clients = {t: openai.OpenAI(base_url=proxy_url + "/v1", api_key=k, max_retries=2, timeout=300)
               for t, k in keys.items()}
    board.phase(f"memory round: {len(taught)} users of {MEMORY_TENANT} ask for a service's port and correct the "
                "agent's answer in their feedback")
    teach(clients[MEMORY_TENANT], proxy_url, keys[MEMORY_TENANT], model, taught, max_tokens)
    time.sleep(2.0)  # the writer's last batch reaches the database
    board.phase("memory round: the diagnosis proposes a memory version from the corrections; its gates run")
    version = propose_memory(proxy_url, admin_key, MEMORY_TENANT)
    card = read_card(db_url, version["name"])
    gates = GateRound.from_card(card) if card else None
    for line in gates.lines() if gates else []:
        board.note(f"  {version['name']} (memory) {line}")
    board.phase(f"memory round: held-out questions ({HELD_OUT.format(name='X')!r}) to {MEMORY_TENANT} and to "
                f"{CONTROL_TENANT}, which has no memory")
    rows = held_out({MEMORY_TENANT: clients[MEMORY_TENANT], CONTROL_TENANT: clients[CONTROL_TENANT]}, model,
                    taught, untaught, max_tokens)
    measured = compare(rows, MEMORY_TENANT, CONTROL_TENANT)
    for line in memory_lines(measured):
        board.note(f"  {version['name']} (memory) {line}")
    if version["status"] == "canary":
        # The users react: a right port is worth 1, anything else 0. The canary compares its two arms'
        # rewards (sequential test) and promotes or rolls back once the difference is shown.
        board.phase(f"memory round: {MEMORY_TENANT}'s users reward the held-out answers; the canary of "
                    f"{version['name']} compares its arms")
        reward_answers(proxy_url, keys[MEMORY_TENANT], [r for r in rows if r.tenant == MEMORY_TENANT])
        card = wait_for_canary(db_url, version["name"], timeout_s=30.0) or card
        gates = GateRound.from_card(card) if card else gates
        if gates and gates.canary is not None:
            board.note(f"  {version['name']} (memory) canary [{gates.canary['state']}]: "
                       f"{canary_summary(gates.canary.get('numbers') or {})}")
    status = card["version"]["status"] if card else version["status"]
    return LayerRound("memory", version["name"], status, gates.as_dict() if gates else {}, measured)


def reward_answers(proxy_url: str, key: str, rows: list[Row]) -> None:
    """Each held-out session's reward from its user: 1 for the right port, else 0."""
    import httpx

    with httpx.Client(base_url=proxy_url, headers={"authorization": f"Bearer {key}"}, timeout=60,
                      trust_env=False) as c:
        for r in rows:
            c.post(f"/atdp/v1/sessions/h-{r.tenant}-{r.service}/feedback",
                   json={"reward": 1.0 if r.right else 0.0, "source": "human"}).raise_for_status()


def wait_for_canary(db_url: str, name: str, timeout_s: float) -> dict[str, Any] | None:
    """The version's card once its canary has decided, or as it stands after `timeout_s`."""
    import time

    from proxy.demo.gates import read_card

    deadline = time.monotonic() + timeout_s
    card = read_card(db_url, name)
    while card is not None and card["version"]["status"] == "canary" and time.monotonic() < deadline:
        time.sleep(1.0)
        card = read_card(db_url, name)
    return card


def canary_summary(numbers: dict[str, Any]) -> str:
    """The arms' rewards and the verdict, in one line."""
    arms = numbers.get("arms") or {}

    def arm(name: str) -> str:
        r = (arms.get(name) or {}).get("reward") or {}
        return f"{name} {r['mean']:.2f} (n={r['n']})" if r.get("mean") is not None else f"{name} - (n=0)"

    return f"{arm('candidate')} vs {arm('serving')}, verdict {numbers.get('verdict', '-')}"


def harness_round(board: Board, *, db_url: str, proxy_url: str, admin_key: str, tenant: str) -> LayerRound:
    """An operator's overlay for `tenant`'s lookup task as a harness candidate, gated like the weights were."""
    from proxy.demo.gates import GateRound, read_card

    board.phase(f"harness round: an operator's system-prompt addition for {tenant}; its gates replay the "
                "held-out sessions and the suite with and without it")
    version = propose_harness(proxy_url, admin_key, tenant)
    card = read_card(db_url, version["name"])
    gates = GateRound.from_card(card) if card else None
    for line in gates.lines() if gates else []:
        board.note(f"  {version['name']} (harness) {line}")
    return LayerRound("harness", version["name"], version["status"], gates.as_dict() if gates else {})
