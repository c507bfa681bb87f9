"""The labelled redaction corpus: real client prompts, code-like lookalikes, seeded PII and secrets.

Three parts, shared by `bench/redaction_quality.py` (full numbers) and the fast test
(`tests/unit/test_redaction_quality.py`):

- `client_operator_content()`: the system prompts and tool schemas Claude Code, Codex CLI and Hermes
  Agent really send, captured by `bench/capture_client_prompts.py` into `bench/corpus/clients/`.
  Nothing in them is PII or a secret: every detection there is a false positive.
- `lookalikes(seed, kb)`: tool output of the kinds agents read all day (git log, pip freeze, stack
  traces, ls -l, JSON API answers, docker ps, logs, `cat -n` listings) full of ids, versions, dates,
  hashes, UUIDs, ports and line numbers, generated from a fixed seed. None of it is sensitive.
- `seeded(seed, n)`: the same lookalikes with fresh values of every supported entity type inserted at
  known places (`Sample.labels`), in the contexts agent traffic carries them (prose, JSON, .env lines,
  headers, URLs) and sometimes bare.

Splits: tune on `DEV_SEED`, report on `HELD_OUT_SEED` (different lookalikes, different values).
"""

from __future__ import annotations

import base64
import hashlib
import json
import random
import string
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEV_SEED = 1
HELD_OUT_SEED = 20260601

CLIENTS_DIR = Path(__file__).resolve().parents[1] / "bench" / "corpus" / "clients"
CLIENTS = ("claude-code", "codex", "hermes")

_ALNUM = string.ascii_letters + string.digits
_HEX = "0123456789abcdef"


def client_operator_content() -> dict[str, dict[str, Any]]:
    """client -> {"system": ..., "tools": [...]} as the client sent them."""
    return {c: json.loads((CLIENTS_DIR / f"{c}.json").read_text()) for c in CLIENTS}


# --- code-like lookalikes -------------------------------------------------------------------------

_WORDS = ["proxy", "store", "record", "redact", "token", "session", "parser", "config", "loader", "writer", "batch", "schema", "client", "server", "cache", "queue", "worker", "router", "model", "trainer", "engine", "upstream", "handler", "request", "response", "update", "version"]
_PKGS = ["numpy", "pandas", "torch", "requests", "httpx", "aiohttp", "fastapi", "uvicorn", "pydantic", "sqlalchemy", "alembic", "psycopg", "presidio-analyzer", "spacy", "orjson", "pyarrow", "tokenizers", "transformers", "safetensors", "accelerate", "rich", "click", "jinja2", "pyyaml", "protobuf", "grpcio", "boto3", "botocore", "urllib3", "certifi", "idna", "charset-normalizer"]
_MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]
_DAYS = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]
_MODEL_IDS = (
    "claude-haiku-4-5-20251001", "claude-sonnet-4-5-20250929", "claude-opus-4-1-20250805",
    "claude-3-5-sonnet-20241022", "gpt-4o-2024-08-06", "gpt-4o-mini-2024-07-18", "o3-mini-2025-01-31",
    "gemini-2.0-flash-001", "Qwen2.5-7B-Instruct", "Llama-3.1-8B-Instruct", "mistral-large-2411",
)  # fmt: skip


def _hex(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(_HEX) for _ in range(n))


def _word(rng: random.Random) -> str:
    return rng.choice(_WORDS)


def _ident(rng: random.Random) -> str:
    return f"{_word(rng)}_{_word(rng)}"


def _path(rng: random.Random) -> str:
    return "/".join(["src", _word(rng), _word(rng)]) + rng.choice((".py", ".ts", ".rs", ".go", ".md"))


def _semver(rng: random.Random) -> str:
    v = f"{rng.randint(0, 12)}.{rng.randint(0, 40)}.{rng.randint(0, 300)}"
    return rng.choice((v, "v" + v, v + f"-rc.{rng.randint(1, 5)}", v + "+cpu", v + f".post{rng.randint(1, 3)}"))


def _iso(rng: random.Random) -> str:
    y, mo, d = rng.randint(2019, 2026), rng.randint(1, 12), rng.randint(1, 28)
    h, mi, s = rng.randint(0, 23), rng.randint(0, 59), rng.randint(0, 59)
    return rng.choice((
        f"{y}-{mo:02d}-{d:02d}T{h:02d}:{mi:02d}:{s:02d}Z",
        f"{y}-{mo:02d}-{d:02d}T{h:02d}:{mi:02d}:{s:02d}.{rng.randint(0, 999999):06d}+00:00",
        f"{y}-{mo:02d}-{d:02d} {h:02d}:{mi:02d}:{s:02d}",
        f"{y}/{mo:02d}/{d:02d} {h:02d}:{mi:02d}",
        f"{y}{mo:02d}{d:02d}",
        f"{d:02d}/{mo:02d}/{y}",
    ))  # fmt: skip


def _epoch(rng: random.Random) -> str:
    s = rng.randint(1_500_000_000, 1_800_000_000)
    return rng.choice((str(s), str(s * 1000 + rng.randint(0, 999)), str(s * 10**9 + rng.randint(0, 10**9 - 1))))


def _git_log(rng: random.Random) -> str:
    out = []
    for _ in range(rng.randint(3, 8)):
        out.append(
            f"commit {_hex(rng, 40)}\nMerge: {_hex(rng, 7)} {_hex(rng, 7)}\n"
            f"Author: {rng.choice(('Dev Bot', 'Release Bot', 'CI'))} <noreply@github.com>\n"
            f"Date:   {rng.choice(_DAYS)} {rng.choice(_MONTHS)} {rng.randint(1, 28)} {rng.randint(0, 23):02d}:"
            f"{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d} {rng.randint(2019, 2026)} "
            f"{rng.choice(('+0000', '+0200', '-0700', '+0530'))}\n\n"
            f"    {_word(rng).capitalize()} {_word(rng)} in {_path(rng)} (#{rng.randint(10, 99999)})\n\n"
        )
    out.append(f"{_hex(rng, 7)} (HEAD -> main, origin/main) bump to {_semver(rng)}\n")
    return "".join(out)


def _pip_freeze(rng: random.Random) -> str:
    lines = [f"{p}=={_semver(rng).lstrip('v')}" for p in rng.sample(_PKGS, rng.randint(8, 20))]
    lines.append(f"{_word(rng)} @ file:///home/dev/wheels/{_word(rng)}-{_semver(rng).lstrip('v')}-py3-none-any.whl")
    lines.append(f"{_word(rng)}-sdk @ git+https://github.com/acme/{_word(rng)}.git@{_hex(rng, 40)}")
    lines.append(f"--hash=sha256:{_hex(rng, 64)}")
    return "\n".join(lines) + "\n"


def _traceback(rng: random.Random) -> str:
    if rng.random() < 0.5:
        frames = "".join(
            f'  File "/srv/app/{_path(rng)}", line {rng.randint(1, 4000)}, in {_ident(rng)}\n'
            f"    {_ident(rng)}({_word(rng)}={rng.randint(0, 65535)}, timeout={rng.randint(1, 600)})\n"
            for _ in range(rng.randint(2, 6))
        )
        return (f"Traceback (most recent call last):\n{frames}"
                f"ConnectionError: HTTPConnectionPool(host='localhost', port={rng.randint(1024, 65535)}): Max retries "
                f"exceeded with url: /v1/{_word(rng)}/{uuid.UUID(int=rng.getrandbits(128))} "
                f"(request id req_{_hex(rng, 24)})\n")
    frames = "".join(
        f"    at {_ident(rng)} ({_path(rng)}:{rng.randint(1, 2000)}:{rng.randint(1, 120)})\n"
        for _ in range(rng.randint(2, 6))
    )
    return f"TypeError: Cannot read properties of undefined (reading '{_word(rng)}')\n{frames}Node.js v{rng.randint(16, 24)}.{rng.randint(0, 20)}.{rng.randint(0, 9)}\n"


def _ls_l(rng: random.Random) -> str:
    lines = [f"total {rng.randint(8, 9000)}"]
    for _ in range(rng.randint(5, 15)):
        lines.append(
            f"{rng.choice(('-rw-r--r--', 'drwxr-xr-x', '-rwxr-xr-x', 'lrwxrwxrwx'))} {rng.randint(1, 9)} "
            f"{rng.choice(('dev', 'root', 'www-data'))} {rng.choice(('dev', 'root', 'staff'))} "
            f"{rng.randint(0, 99_999_999):>9} {rng.choice(_MONTHS)} {rng.randint(1, 28):>2} "
            f"{rng.choice((f'{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}', str(rng.randint(2019, 2026))))} "
            f"{_word(rng)}_{rng.randint(0, 999):03d}.{rng.choice(('py', 'json', 'log', 'tar.gz'))}"
        )
    return "\n".join(lines) + "\n"


def _json_api(rng: random.Random) -> str:
    items = []
    for _ in range(rng.randint(2, 6)):
        items.append({
            "id": rng.choice((str(uuid.UUID(int=rng.getrandbits(128))), rng.randint(1, 10**12), f"evt_{_hex(rng, 24)}")),
            "object": _word(rng), "created": int(_epoch(rng)[:10]), "updated_at": _iso(rng),
            "etag": f'W/"{_hex(rng, 32)}"', "sha": _hex(rng, 40), "size_bytes": rng.randint(0, 10**10),
            "version": _semver(rng), "model": rng.choice(_MODEL_IDS), "port": rng.randint(1, 65535),
            "duration_ms": round(rng.random() * 10**5, 3), "count": rng.randint(0, 10**7),
            "price": round(rng.random() * 1000, 2), "ratio": rng.random(), "line": rng.randint(1, 9999),
            "checksum": "sha256:" + _hex(rng, 64), "build": int(f"{rng.randint(2019, 2026)}{rng.randint(1, 12):02d}{rng.randint(1, 28):02d}"),
            "request_id": f"req_{_hex(rng, 26)}", "trace_id": _hex(rng, 32), "span_id": _hex(rng, 16),
        })  # fmt: skip
    return json.dumps({"data": items, "has_more": rng.random() < 0.5, "total": rng.randint(0, 10**6)},
                      indent=rng.choice((None, 2)))


def _docker_ps(rng: random.Random) -> str:
    lines = ["CONTAINER ID   IMAGE                          COMMAND                  CREATED       STATUS       PORTS                    NAMES"]
    for _ in range(rng.randint(2, 8)):
        p = rng.randint(1024, 65535)
        lines.append(
            f"{_hex(rng, 12)}   {_word(rng)}/{_word(rng)}:{_semver(rng).lstrip('v')}   \"/entrypoint.sh {_word(rng)}\"   "
            f"{rng.randint(2, 59)} minutes ago   Up {rng.randint(2, 59)} minutes   0.0.0.0:{p}->{rng.randint(80, 9999)}/tcp, "
            f"[::]:{p}->{rng.randint(80, 9999)}/tcp   {_word(rng)}-{_word(rng)}-{rng.randint(1, 9)}"
        )
    lines.append(f"sha256:{_hex(rng, 64)}")
    return "\n".join(lines) + "\n"


def _log_lines(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(5, 20)):
        lines.append(
            f"{_iso(rng)} {rng.choice(('INFO', 'WARN', 'DEBUG', 'ERROR'))} [{_word(rng)}:{rng.randint(1, 999)}] "
            f"pid={rng.randint(1, 4_194_304)} step={rng.randint(0, 10**6)} took={rng.randint(0, 99999)}ms "
            f"session={uuid.UUID(int=rng.getrandbits(128))} trace={_hex(rng, 32)} model={rng.choice(_MODEL_IDS)} "
            f"listening on 127.0.0.1:{rng.randint(1024, 65535)} epoch={_epoch(rng)} mem={rng.randint(10**6, 10**11)}"
        )
    return "\n".join(lines) + "\n"


def _cat_n(rng: random.Random) -> str:
    start = rng.randint(1, 3000)
    body = []
    for i in range(rng.randint(8, 30)):
        line = rng.choice((
            f"def {_ident(rng)}(self, limit: int = {rng.randint(1, 100000)}) -> list[str]:",
            f"    return self.{_ident(rng)}[{rng.randint(0, 99)}:{rng.randint(100, 9999)}]",
            f"    # see {_path(rng)}:{rng.randint(1, 999)} and issue #{rng.randint(1, 99999)}",
            f'    TIMEOUT_MS = {rng.randint(1, 10**6)}  # changed {_iso(rng)}',
            f'    VERSION = "{_semver(rng)}"',
            f'    MODEL = "{rng.choice(_MODEL_IDS)}"',
            f'    DIGEST = "{_hex(rng, 64)}"',
            f"    x = 0x{_hex(rng, 8)} + {rng.randint(0, 10**9)}",
        ))  # fmt: skip
        body.append(f"{start + i:>6}\t{line}")
    return "\n".join(body) + "\n"


def _misc(rng: random.Random) -> str:
    return (
        f"Downloading {_word(rng)}-{_semver(rng).lstrip('v')}-cp311-cp311-manylinux_2_17_x86_64.whl "
        f"({rng.randint(1, 900)}.{rng.randint(0, 9)} MB)\n"
        f"npm notice {rng.choice(_PKGS)}@{_semver(rng).lstrip('v')} integrity sha512-"
        f"{base64.b64encode(rng.randbytes(48)).decode()}\n"
        f"pod/{_word(rng)}-{_hex(rng, 10)}-{_hex(rng, 5)}   1/1   Running   {rng.randint(0, 9)}   {rng.randint(1, 99)}h\n"
        f"CPU {rng.randint(0, 100)}% MEM {rng.randint(1, 65536)}MiB / {rng.randint(1, 256)}GiB  PIDS {rng.randint(1, 999)}\n"
        f"HTTP/1.1 200 OK\nx-request-id: {uuid.UUID(int=rng.getrandbits(128))}\ncontent-length: {rng.randint(0, 10**6)}\n"
        f"date: {rng.choice(_DAYS)}, {rng.randint(1, 28):02d} {rng.choice(_MONTHS)} {rng.randint(2019, 2026)} "
        f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d} GMT\n"
        f"ETA {rng.randint(0, 99)}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}  "
        f"{rng.randint(0, 10**6)}/{rng.randint(10**6, 10**7)} [{rng.randint(0, 100)}%]  {rng.random() * 100:.2f} it/s\n"
        f"ulid {''.join(rng.choice('0123456789ABCDEFGHJKMNPQRSTVWXYZ') for _ in range(26))} "
        f"ksuid {''.join(rng.choice(_ALNUM) for _ in range(27))} build {rng.randint(1000, 99999)}.{rng.randint(0, 999)}\n"
    )


LOOKALIKE_KINDS = {
    "git_log": _git_log, "pip_freeze": _pip_freeze, "traceback": _traceback, "ls_l": _ls_l,
    "json_api": _json_api, "docker_ps": _docker_ps, "logs": _log_lines, "cat_n": _cat_n, "misc": _misc,
}  # fmt: skip


def lookalikes(seed: int, kb: int = 100) -> list[tuple[str, str]]:
    """(kind, text) tool outputs, about `kb` KB in all, none of them sensitive."""
    rng = random.Random(seed)
    out: list[tuple[str, str]] = []
    size = 0
    while size < kb * 1000:
        kind = rng.choice(sorted(LOOKALIKE_KINDS))
        text = LOOKALIKE_KINDS[kind](rng)
        out.append((kind, text))
        size += len(text.encode())
    return out


# --- seeded values ------------------------------------------------------------------------------

_FIRST = ["maria", "john", "aisha", "wei", "olga", "pedro", "fatima", "lars", "yuki", "omar", "chloe", "ivan", "nadia", "tom", "priya"]
_LAST = ["gonzalez", "smith", "khan", "chen", "petrova", "silva", "haddad", "berg", "tanaka", "farouk", "martin", "novak", "rossi", "lee", "patel"]
_DOMAINS = ["fastmail.com", "acme-corp.io", "northwind.co.uk", "example-mail.de", "corp.example.org", "mailbox.org", "gmx.net"]


def _luhn_complete(prefix: str, length: int, rng: random.Random) -> str:
    digits = prefix + "".join(rng.choice(string.digits) for _ in range(length - len(prefix) - 1))
    total = 0
    for i, d in enumerate(reversed(digits)):
        n = int(d)
        if i % 2 == 0:
            n *= 2
            n -= 9 if n > 9 else 0
        total += n
    return digits + str((10 - total % 10) % 10)


def _iban(country: str, bban: str) -> str:
    rearranged = bban + country + "00"
    num = int("".join(str(int(c, 36)) for c in rearranged))
    return f"{country}{98 - num % 97:02d}{bban}"


_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def _btc(rng: random.Random) -> str:
    payload = b"\x00" + rng.randbytes(20)
    check = hashlib.sha256(hashlib.sha256(payload).digest()).digest()[:4]
    n = int.from_bytes(payload + check, "big")
    out = ""
    while n:
        n, r = divmod(n, 58)
        out = _B58[r] + out
    return "1" + out  # one leading zero byte


def _phone(rng: random.Random) -> str:
    import phonenumbers

    region, prefix = rng.choice((("US", "+1"), ("US", "+1"), ("GB", "+44"), ("DE", "+49"), ("IN", "+91"),
                                 ("FR", "+33"), ("BR", "+55")))
    while True:
        example = phonenumbers.example_number_for_type(region, rng.choice(
            (phonenumbers.PhoneNumberType.MOBILE, phonenumbers.PhoneNumberType.FIXED_LINE)))
        national = str(example.national_number)
        # Same length and leading digits as the region's example, random subscriber digits.
        keep = 3 if region in ("US", "BR") else 2
        candidate = national[:keep] + "".join(rng.choice(string.digits) for _ in range(len(national) - keep))
        num = phonenumbers.parse(prefix + candidate, None)
        if phonenumbers.is_valid_number(num):
            break
    fmt = phonenumbers.PhoneNumberFormat
    style = rng.choice((fmt.INTERNATIONAL, fmt.E164, fmt.NATIONAL if region == "US" else fmt.INTERNATIONAL))
    return phonenumbers.format_number(num, style)


def _ssn(rng: random.Random) -> str:
    while True:
        area = rng.randint(1, 899)
        if area != 666:
            break
    return f"{area:03d}-{rng.randint(1, 99):02d}-{rng.randint(1, 9999):04d}"


def _secret_value(entity: str, rng: random.Random) -> str:
    r = lambda a, n: "".join(rng.choice(a) for _ in range(n))  # noqa: E731
    if entity == "API_KEY":
        return rng.choice((
            "sk-proj-" + r(_ALNUM, 48), "sk-ant-api03-" + r(_ALNUM + "-_", 93) + "AA", "sk-" + r(_ALNUM, 48),
            "xoxb-" + r(string.digits, 12) + "-" + r(string.digits, 13) + "-" + r(_ALNUM, 24),
            "AIza" + r(_ALNUM + "-_", 35), "sk_" + "live_" + r(_ALNUM, 24), "hf_" + r(_ALNUM, 34),
        ))  # fmt: skip
    if entity == "AWS_ACCESS_KEY":
        return "AKIA" + r(string.ascii_uppercase + "234567", 16)
    if entity == "GITHUB_TOKEN":
        return rng.choice(("ghp_" + r(_ALNUM, 36), "github_pat_" + r(_ALNUM, 22) + "_" + r(_ALNUM, 59)))
    if entity == "GITLAB_TOKEN":
        return "glpat-" + r(_ALNUM + "-_", 20)
    if entity == "JWT":
        head = base64.urlsafe_b64encode(b'{"alg":"HS256","typ":"JWT"}').decode().rstrip("=")
        body = base64.urlsafe_b64encode(json.dumps({"sub": r(_ALNUM, 8), "exp": rng.randint(1, 2**31)}).encode())
        return head + "." + body.decode().rstrip("=") + "." + r(_ALNUM + "-_", 43)
    if entity == "PRIVATE_KEY":
        kind = rng.choice(("RSA ", "EC ", "OPENSSH ", ""))
        lines = "\n".join(r(_ALNUM + "+/", 64) for _ in range(rng.randint(3, 8)))
        return f"-----BEGIN {kind}PRIVATE KEY-----\n{lines}\n-----END {kind}PRIVATE KEY-----"
    if entity == "URL_CREDENTIALS":
        return r(_ALNUM, rng.randint(6, 10)) + rng.choice("!#%&*") + r(string.digits, 2)
    if entity == "AUTH_HEADER":
        return rng.choice((r(_HEX, 40), r(_ALNUM, 32)))
    if entity == "HIGH_ENTROPY_SECRET":
        return rng.choice((r(_ALNUM, 36), r(_HEX, 64), "django-insecure-" + r(_ALNUM + "!@#%^&*", 40)))
    raise ValueError(entity)


def _pii_value(entity: str, rng: random.Random) -> str:
    if entity == "EMAIL_ADDRESS":
        sep = rng.choice((".", "_", "", "+"))
        local = rng.choice(_FIRST) + sep + rng.choice(_LAST) if sep != "+" else rng.choice(_FIRST) + "+billing"
        return f"{local}@{rng.choice(_DOMAINS)}"
    if entity == "PHONE_NUMBER":
        return _phone(rng)
    if entity == "CREDIT_CARD":
        prefix, length = rng.choice((("4", 16), ("51", 16), ("55", 16), ("37", 15), ("34", 15), ("6011", 16)))
        digits = _luhn_complete(prefix, length, rng)
        if length == 16 and rng.random() < 0.6:
            sep = rng.choice((" ", "-"))
            digits = sep.join(digits[i : i + 4] for i in range(0, 16, 4))
        return digits
    if entity == "IP_ADDRESS":
        if rng.random() < 0.25:
            return f"2001:db8:{rng.randint(1, 0xFFFF):x}::{rng.randint(1, 0xFFFF):x}:{rng.randint(1, 0xFFFF):x}"
        return f"{rng.choice((23, 45, 81, 93, 142, 185, 203))}.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}"
    if entity == "IBAN_CODE":
        country, bban = rng.choice((
            ("DE", "".join(rng.choice(string.digits) for _ in range(18))),
            ("GB", "WEST" + "".join(rng.choice(string.digits) for _ in range(14))),
            # bank (5) + branch (5) + account (11, may hold a letter) + key (2)
            ("FR", "".join(rng.choice(string.digits) for _ in range(17)) + "M" + "".join(rng.choice(string.digits) for _ in range(5))),
        ))  # fmt: skip
        iban = _iban(country, bban)
        return " ".join(iban[i : i + 4] for i in range(0, len(iban), 4)) if rng.random() < 0.4 else iban
    if entity == "US_SSN":
        return _ssn(rng)
    if entity == "US_ITIN":
        return f"9{rng.randint(0, 99):02d}-{rng.choice((50, 65, 70, 78, 80, 88, 92, 94))}-{rng.randint(1, 9999):04d}"
    if entity == "CRYPTO":
        return _btc(rng)
    if entity == "MAC_ADDRESS":
        sep = rng.choice((":", "-"))
        return sep.join(f"{b:02x}" for b in rng.randbytes(6))
    raise ValueError(entity)


# How each kind is written in agent traffic: `{}` is the value. A secret that is only a secret by
# context comes with its context (a password in a URL, a token after `Bearer`, a value under a
# secret key); the rest appear with or without a hint.
_CONTEXTS: dict[str, tuple[str, ...]] = {
    "EMAIL_ADDRESS": ("contact: {}", "Reply-To: {}", "{}", '"email": "{}"', "ping {} about it"),
    "PHONE_NUMBER": ("phone: {}", "call me on {}", '"phone": "{}"', "tel {}", "Mobile: {}", "{}"),
    "CREDIT_CARD": ("card {}", '"card_number": "{}"', "charged {} today", "{}"),
    "IP_ADDRESS": ("client {} connected", "inet {}/24", '"remote_addr": "{}"', "{}"),
    "IBAN_CODE": ("IBAN: {}", "wire to {}", '"iban": "{}"'),
    "US_SSN": ("SSN {}", "ssn: {}", "social security number {}"),
    "US_ITIN": ("ITIN {}", "itin: {}", "taxpayer id (ITIN) {}"),
    "CRYPTO": ("send BTC to {}", "wallet: {}", "{}"),
    "MAC_ADDRESS": ("link/ether {} brd ff:ff:ff:ff:ff:ff", "mac={}", "{}"),
    "API_KEY": ("OPENAI_API_KEY={}", "key: {}", "{}", '"apiKey": "{}"'),
    "AWS_ACCESS_KEY": ("AWS_ACCESS_KEY_ID={}", "aws_access_key_id = {}", "{}"),
    "GITHUB_TOKEN": ("GH_TOKEN={}", "{}", "git push https://x-access-token:{}@github.com/acme/app.git"),
    "GITLAB_TOKEN": ("private token {}", "{}", "CI_JOB_TOKEN={}"),
    "JWT": ("token={}", "{}", '"id_token": "{}"'),
    "PRIVATE_KEY": ("{}", "$ cat ~/.ssh/id_rsa\n{}"),
    "URL_CREDENTIALS": ("DATABASE_URL=postgresql://app:{}@db.internal:5432/main", "redis://:{}@cache:6379/0",
                        "amqp://guest:{}@rabbit.internal:5672/"),
    "AUTH_HEADER": ("Authorization: Bearer {}", "> authorization: token {}", "x-api-key: {}"),
    "HIGH_ENTROPY_SECRET": ('"client_secret": "{}"', "SECRET_KEY={}", "db_password = '{}'", "api_token: {}"),
}  # fmt: skip

SEEDED_ENTITIES: tuple[str, ...] = tuple(sorted(_CONTEXTS))


def seeded_value(entity: str, rng: random.Random) -> str:
    from proxy.governance.secrets import SECRET_ENTITIES

    return _secret_value(entity, rng) if entity in SECRET_ENTITIES else _pii_value(entity, rng)


@dataclass
class Sample:
    text: str
    kind: str
    labels: list[tuple[str, str]] = field(default_factory=list)  # (entity, value)


def seeded(seed: int, per_entity: int = 30) -> list[Sample]:
    """Lookalike tool outputs, each with one to three seeded values inserted at line boundaries."""
    rng = random.Random(seed * 7919 + 1)
    base = lookalikes(seed + 1, kb=per_entity * len(SEEDED_ENTITIES) * 3)
    todo = [e for e in SEEDED_ENTITIES for _ in range(per_entity)]
    rng.shuffle(todo)
    out: list[Sample] = []
    i = 0
    while todo:
        kind, text = base[i % len(base)]
        i += 1
        sample = Sample(text=text, kind=kind)
        for _ in range(min(len(todo), rng.randint(1, 3))):
            entity = todo.pop()
            value = seeded_value(entity, rng)
            line = rng.choice(_CONTEXTS[entity]).format(value)
            lines = sample.text.split("\n")
            at = rng.randint(0, len(lines))
            sample.text = "\n".join([*lines[:at], line, *lines[at:]])
            sample.labels.append((entity, value))
        out.append(sample)
    return out
