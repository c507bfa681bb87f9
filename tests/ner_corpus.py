"""A labelled set for names and places (PERSON, LOCATION) in agent-shaped text.

Shared by `bench/ner_quality.py` (the reported numbers) and `tests/unit/test_ner_quality.py`.

- `negatives(split, kb)`: agent traffic full of capitalised identifiers that are not names: Python,
  TypeScript and Java code, Java and Python stack traces, framework logs, git logs with bot authors
  and capitalised commit subjects, JSON tool schemas, Markdown, Windows and macOS paths, plus the
  generic tool output of `tests/redaction_corpus.py`. Every PERSON or LOCATION found there is wrong.
- `positives(split, n)`: the same text with people's names and places inserted where agents meet
  them (a user's request, a git author, a JSON or CSV tool result, an e-mail header, a ticket, an
  address, a code comment), each labelled.

Splits: `dev` (tune rules here) and `held-out` (report only). They differ in the random seed and in
the pools of names and places (disjoint), so a rule fitted to a dev name cannot help on held-out.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

from tests.redaction_corpus import DEV_SEED, HELD_OUT_SEED, lookalikes

SPLITS = {"dev": DEV_SEED, "held-out": HELD_OUT_SEED}

# Disjoint pools per split: first names, last names, cities / countries / regions.
_POOLS: dict[str, tuple[list[str], list[str], list[str]]] = {
    "dev": (
        ["Maria", "John", "Aisha", "Wei", "Olga", "Pedro", "Fatima", "Lars", "Yuki", "Omar", "Chloe", "Ivan",
         "Nadia", "Thomas", "Priya", "Carlos", "Ingrid", "Kwame", "Sofia", "Daniel"],
        ["Gonzalez", "Smith", "Khan", "Chen", "Petrova", "Silva", "Haddad", "Lindqvist", "Tanaka", "Farouk",
         "Martin", "Novak", "Rossi", "Okafor", "Patel", "Moreau", "Schmidt", "Kowalski", "Nguyen", "Brown"],
        ["Lisbon", "Berlin", "Nairobi", "Toronto", "Osaka", "Madrid", "Krakow", "Melbourne", "Chicago", "Cairo",
         "Oslo", "Manchester", "Lyon", "Bangalore", "Denver", "Kenya", "Portugal", "Bavaria", "Texas", "Vietnam"],
    ),
    "held-out": (
        ["Elena", "James", "Zainab", "Hiroshi", "Anna", "Miguel", "Leila", "Erik", "Mei", "Tariq", "Camille",
         "Dmitri", "Amara", "Robert", "Ananya", "Luis", "Astrid", "Kofi", "Giulia", "Michael"],
        ["Fernandez", "Johnson", "Rahman", "Yamamoto", "Ivanova", "Costa", "Nasser", "Johansson", "Wang",
         "Mansour", "Dubois", "Horvat", "Bianchi", "Adeyemi", "Sharma", "Lefebvre", "Weber", "Nowak",
         "Tran", "Wilson"],
        ["Porto", "Hamburg", "Lagos", "Vancouver", "Kyoto", "Seville", "Gdansk", "Brisbane", "Boston", "Casablanca",
         "Bergen", "Liverpool", "Marseille", "Chennai", "Seattle", "Ghana", "Austria", "Tuscany", "Ohio", "Thailand"],
    ),
}

# The identifiers, title words and products of the negatives differ per split too: rules set on dev's
# vocabulary are measured on words they never saw.
_VOCAB: dict[str, tuple[list[str], list[str], list[str]]] = {
    "dev": (
        ["OrderService", "UserConfig", "SessionStore", "TokenParser", "RequestHandler", "CacheManager",
         "PaymentGateway", "HttpClient", "EventBus", "RetryPolicy", "Scheduler", "Worker", "Router",
         "Pipeline", "Registry", "Validator", "Serializer", "Repository", "Controller", "Factory"],
        ["Add", "Fix", "Update", "Remove", "Refactor", "Bump", "Merge", "Revert", "Support", "Handle",
         "Cache", "Session", "Parser", "Token", "Config", "Docs", "Tests", "Build", "Release", "Redis",
         "Docker", "Kafka", "Postgres", "Python", "Node", "React", "Rust", "Linux", "Windows", "Azure"],
        ["Docker Desktop", "Visual Studio Code", "Google Chrome", "GitHub Actions", "Amazon S3",
         "Apache Kafka", "Spring Boot", "Node.js", "PostgreSQL", "Microsoft Teams", "Slack", "Jira"],
    ),
    "held-out": (
        ["InvoiceService", "AccountConfig", "QueueStore", "FrameDecoder", "UploadHandler", "LockManager",
         "BillingGateway", "GrpcClient", "MessageBroker", "BackoffPolicy", "Dispatcher", "Consumer", "Gateway",
         "Executor", "Catalog", "Sanitizer", "Encoder", "Mapper", "Presenter", "Builder"],
        ["Implement", "Correct", "Upgrade", "Drop", "Rename", "Pin", "Squash", "Rollback", "Enable", "Guard",
         "Queue", "Account", "Decoder", "Frame", "Schema", "Readme", "Benchmarks", "Deploy", "Hotfix", "Nginx",
         "Podman", "Celery", "Mongo", "Golang", "Deno", "Svelte", "Kotlin", "Ubuntu", "Android", "Heroku"],
        ["Kubernetes", "Terraform", "Homebrew", "Xcode", "Android Studio", "Jupyter Notebook", "Firefox",
         "Google Cloud", "Vercel", "Datadog Agent", "Grafana", "Sublime Text"],
    ),
}


@dataclass(frozen=True)
class _Words:
    rng: random.Random
    classes: list[str]
    titles: list[str]
    products: list[str]

    def cls(self) -> str:
        return self.rng.choice(self.classes)

    def title(self, n: int = 1) -> str:
        return " ".join(self.rng.choice(self.titles) for _ in range(n))

    def product(self) -> str:
        return self.rng.choice(self.products)


def _python_code(w: _Words) -> str:
    rng = w.rng
    a, b = w.cls(), w.cls()
    return (
        f"from app.{a.lower()} import {a}, {b}\n\n\n"
        f"class {a}Error(RuntimeError):\n    \"\"\"Raised when the {b} cannot be reached.\"\"\"\n\n\n"
        f"@dataclass(frozen=True)\nclass {a}Settings:\n    timeout: float = {rng.randint(1, 90)}.0\n"
        f"    backend: Optional[{b}] = None\n\n"
        f"    def build(self) -> {b}:\n        # Returns the {b} for this {a}; see {w.title(2)} notes.\n"
        f"        return {b}(self.timeout, name=\"{w.title()}\")\n"
    )


def _ts_code(w: _Words) -> str:
    a, b = w.cls(), w.cls()
    return (
        f"import {{ Injectable }} from '@angular/core';\nimport {{ {b} }} from './{b.lower()}';\n\n"
        f"@Injectable({{ providedIn: 'root' }})\nexport class {a} {{\n"
        f"  constructor(private readonly {b[0].lower() + b[1:]}: {b}) {{}}\n"
        f"  async load(id: string): Promise<{b} | undefined> {{\n"
        f"    console.log(`Loading {a} ${{id}}`);\n    throw new Error('{w.title(2)} Failed');\n  }}\n}}\n"
    )


def _java_trace(w: _Words) -> str:
    rng = w.rng
    a = w.cls()
    frames = "".join(f"\tat com.acme.{w.cls().lower()}.{w.cls()}.{rng.choice(('process', 'handle', 'run'))}"
                     f"({w.cls()}.java:{rng.randint(10, 999)})\n" for _ in range(rng.randint(3, 7)))
    return (f"Exception in thread \"main\" java.lang.IllegalStateException: {a} Not Initialized\n{frames}"
            f"Caused by: java.net.ConnectException: Connection refused\n\t... {rng.randint(2, 40)} more\n")


def _python_trace(w: _Words) -> str:
    rng = w.rng
    a = w.cls()
    return (f"Traceback (most recent call last):\n  File \"/Users/Shared/Projects/{a}/main.py\", line "
            f"{rng.randint(1, 500)}, in <module>\n    app = {a}.from_env()\n"
            f"  File \"/opt/venv/lib/python3.11/site-packages/pydantic/main.py\", line 212, in __init__\n"
            f"pydantic_core._pydantic_core.ValidationError: 1 validation error for {a}Settings\n"
            f"Timeout\n  Input should be a valid number [type=float_parsing, input_value='Soon', input_type=str]\n")


def _framework_log(w: _Words) -> str:
    rng = w.rng
    lines = []
    for _ in range(rng.randint(4, 10)):
        lines.append(rng.choice((
            f"INFO  [main] o.s.b.StartupInfoLogger - Starting Application using Java {rng.randint(11, 21)}",
            f"WARN  Kafka Consumer {w.cls()} lagging by {rng.randint(1, 9999)} messages",
            f"DEBUG Hikari Pool-{rng.randint(1, 4)} - Added connection org.postgresql.jdbc.PgConnection@{rng.randint(10**6, 10**7):x}",
            f"[{w.cls()}] Listening on port {rng.randint(1024, 65535)} (Press CTRL+C to quit)",
            f"Compiled Successfully in {rng.randint(100, 9000)} ms - Webpack Dev Server",
            f"ERROR Unhandled Promise Rejection in {w.cls()}: Request Timeout",
        )))  # fmt: skip
    return "\n".join(lines) + "\n"


def _git_log(w: _Words) -> str:
    rng = w.rng
    out = []
    for _ in range(rng.randint(2, 5)):
        out.append(
            f"commit {rng.getrandbits(160):040x}\nAuthor: {rng.choice(('dependabot[bot]', 'Renovate Bot', 'GitHub Actions'))}"
            f" <noreply@github.com>\nDate:   Tue Mar {rng.randint(1, 28)} 10:12:01 2026 +0000\n\n"
            f"    {w.title(1)} {w.cls()} for {w.title(1)} Support (#{rng.randint(10, 9999)})\n\n"
            f"    Merge pull request #{rng.randint(10, 9999)} from acme/{w.title(1)}-Branch\n\n"
        )
    return "".join(out)


def _tool_schema(w: _Words) -> str:
    rng = w.rng
    tool = w.cls()
    return json.dumps({
        "name": tool, "description": f"Search the Web for a Query and return {w.title(2)} Results. "
        f"Use {w.product()} when the User asks about Files.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "The Search Query"},
            "region": {"type": "string", "enum": ["US", "EU", "APAC"]}}, "required": ["query"]},
    }, indent=rng.choice((None, 2)))  # fmt: skip


def _markdown(w: _Words) -> str:
    rng = w.rng
    p, q = rng.sample(w.products, 2)
    return (f"## Getting Started\n\nInstall {p} and {q}, then run `make dev`.\n\n### {w.title(2)}\n\n"
            f"- **{w.cls()}**: handles {w.title(1)} Requests\n- See the Troubleshooting Guide on the Wiki.\n")


def _paths(w: _Words) -> str:
    p = w.product()
    return (f"C:\\Program Files\\{p}\\bin\\{w.cls()}.exe\n/Users/Shared/Library/Application Support/{p}/Logs\n"
            f"/Applications/{p}.app/Contents/MacOS/{w.cls()}\n")


_KINDS = {
    "python": _python_code, "typescript": _ts_code, "java_trace": _java_trace, "python_trace": _python_trace,
    "framework_log": _framework_log, "git_log": _git_log, "tool_schema": _tool_schema, "markdown": _markdown,
    "paths": _paths,
}  # fmt: skip


def negatives(split: str, kb: int = 120) -> list[tuple[str, str]]:
    """(kind, text), about `kb` KB: two thirds capitalised-identifier-heavy, one third generic tool output."""
    seed = SPLITS[split]
    rng = random.Random(seed * 31 + 7)
    words = _Words(rng, *_VOCAB[split])
    out: list[tuple[str, str]] = []
    size = 0
    while size < kb * 1000 * 2 // 3:
        kind = rng.choice(sorted(_KINDS))
        text = _KINDS[kind](words)
        out.append((kind, text))
        size += len(text)
    out += lookalikes(seed + 3, kb=kb // 3)
    return out


@dataclass
class Sample:
    text: str
    kind: str
    labels: list[tuple[str, str]] = field(default_factory=list)  # (PERSON | LOCATION, value)


def _mention(rng: random.Random, firsts: list[str], lasts: list[str], places: list[str]) -> tuple[str, list[tuple[str, str]]]:
    first, last, place = rng.choice(firsts), rng.choice(lasts), rng.choice(places)
    full = f"{first} {last}"
    mail = f"{first.lower()}.{last.lower()}@example.com"
    p, f = ("PERSON", full), ("PERSON", first)
    loc = ("LOCATION", place)
    choices: list[tuple[str, list[tuple[str, str]]]] = [
        (f"Please send the signed contract to {full} before Friday.", [p]),
        (f"Can you check why the order for {full} in {place} failed?", [p, loc]),
        (f"Author: {full} <{mail}>", [p]),
        (json.dumps({"customer": {"name": full, "city": place, "tier": "gold"}}), [p, loc]),
        (f"id,name,city,plan\n{rng.randint(1, 999)},{full},{place},pro", [p, loc]),
        (f"From: {full} <{mail}>\nSubject: Invoice {rng.randint(1000, 9999)}", [p]),
        (f"Ticket #{rng.randint(100, 99999)}: customer {full} reports the app crashes on login.", [p]),
        (f"Ship to: {full}, {rng.randint(1, 200)} Harbour Road, {place}", [p, loc]),
        (f"    # reviewed by {full}, see the thread", [p]),
        (f"Thanks, {first}! I moved the meeting to {place}.", [f, loc]),
        (f"Our office in {place} opens at nine.", [loc]),
        (f"I talked to {first} about the flaky test.", [f]),
        (f"{full} approved the change.", [p]),
        (f"Hi {first}, the build on main is green again.", [f]),
    ]
    return rng.choice(choices)


def positives(split: str, n: int = 200) -> list[Sample]:
    """`n` agent-shaped texts, each with one to two labelled mentions inserted at line boundaries."""
    seed = SPLITS[split]
    rng = random.Random(seed * 104729 + 11)
    firsts, lasts, places = _POOLS[split]
    base = negatives(split, kb=max(30, n // 4))
    out: list[Sample] = []
    for i in range(n):
        kind, text = base[i % len(base)]
        sample = Sample(text=text, kind=kind)
        for _ in range(rng.randint(1, 2)):
            line, labels = _mention(rng, firsts, lasts, places)
            lines = sample.text.split("\n")
            at = rng.randint(0, len(lines))
            sample.text = "\n".join([*lines[:at], line, *lines[at:]])
            sample.labels += labels
        out.append(sample)
    return out
