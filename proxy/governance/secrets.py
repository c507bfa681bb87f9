"""What counts as PII or a secret: entity names, the secret rules Presidio lacks, cheap gates that say
whether a recognizer can match at all, and how overlapping detections merge. Pure (regexes only)."""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

SECRET_ENTITIES: frozenset[str] = frozenset(
    {
        "API_KEY",
        "AWS_ACCESS_KEY",
        "GITHUB_TOKEN",
        "GITLAB_TOKEN",
        "JWT",
        "PRIVATE_KEY",
        "URL_CREDENTIALS",
        "AUTH_HEADER",
        "HIGH_ENTROPY_SECRET",
    }
)


PII_ENTITIES: tuple[str, ...] = (
    "EMAIL_ADDRESS",
    "PHONE_NUMBER",
    "CREDIT_CARD",
    "IP_ADDRESS",
    "IBAN_CODE",
    "US_SSN",
    "US_ITIN",
    "CRYPTO",
    "MAC_ADDRESS",
)


# Only produced when an NER model is configured (a blank pipeline finds no names).
NER_ENTITIES: tuple[str, ...] = ("PERSON", "LOCATION", "NRP", "ORGANIZATION")


DEFAULT_NER_ENTITIES: tuple[str, ...] = ("PERSON", "LOCATION")


# Detectable, but off unless named: agent traffic is full of URLs, dates, UUIDs and long digit runs,
# and these recognizers would mangle them (URL) or need context words to be right (the rest).
OPT_IN_ENTITIES: tuple[str, ...] = (
    "URL",
    "DATE_TIME",
    "UUID",
    "US_DRIVER_LICENSE",
    "US_BANK_NUMBER",
    "US_PASSPORT",
    "UK_NHS",
    "MEDICAL_LICENSE",
)


DEFAULT_ENTITIES: tuple[str, ...] = PII_ENTITIES + tuple(sorted(SECRET_ENTITIES))


# Values that look like PII to a pattern but carry none; they stay as they are.
BENIGN_VALUES: frozenset[str] = frozenset(
    {
        "127.0.0.1",
        "0.0.0.0",
        "255.255.255.255",
        "255.255.255.0",
        "::",
        "::1",
        "git@github.com",
        "git@gitlab.com",
        "git@bitbucket.org",
        "noreply@github.com",
        "noreply@anthropic.com",
    }
)


def shannon_entropy(value: str) -> float:
    """Bits per character of `value`'s own character distribution."""
    if not value:
        return 0.0
    n = len(value)
    return -sum(c / n * math.log2(c / n) for c in Counter(value).values())


@dataclass(frozen=True)
class _Rule:
    entity: str
    pattern: re.Pattern[str]
    score: float
    check: Callable[[re.Match[str]], bool] | None = None  # for values a regex alone cannot judge


_PLACEHOLDER_WORDS = frozenset(
    {
        "none", "null", "nil", "true", "false", "undefined", "required", "optional", "string", "str",
        "bytes", "int", "password", "passwd", "secret", "token", "redacted", "hidden", "masked",
        "example", "placeholder", "your_password", "your_token", "your_api_key", "your-api-key",
    }
)  # fmt: skip


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z_.]*")  # code such as `password = self.password`


# A version, not a credential: `image/token:2.16.3-rc.2`, `token_version: v0.32.1+cpu`.
_VERSION = re.compile(r"v?\d+(?:\.\d+)+(?:[-+.~]?[A-Za-z0-9]+(?:\.\d+)*)?")


_PASSWORD_KEY = re.compile(r"(?i)(?:password|passwd|passphrase|pwd|pass)$")


def _is_reference(value: str) -> bool:
    """Env references, templates, masks and our own placeholders are not secrets."""
    if value.startswith(("$2a$", "$2b$", "$2y$")):  # bcrypt hashes are worth hiding
        return False
    if value.startswith(("$", "%(", "{{", "<", "#{", "process.env", "os.environ", "getenv")):
        return True
    if len(set(value)) <= 2:  # ****, xxxx, ....
        return True
    lowered = value.lower()
    return lowered in _PLACEHOLDER_WORDS or lowered.startswith(("your_", "your-", "<your"))


def looks_secret(value: str, key: str, *, quoted: bool, env_line: bool = False) -> bool:
    """Is `value`, found under `key` in a key/value context, a credential?

    Passwords are short and low-entropy, so under a password-like key any value goes unless it reads as
    code (a bare identifier). Under token/secret/api-key keys the value must look random: long enough,
    letters with digits or symbols, and Shannon entropy of at least 3 bits per character.
    """
    value = value.strip()
    if len(value) < 4 or _is_reference(value):
        return False
    key = key.strip("\"' ").lower()
    if _PASSWORD_KEY.search(key):
        return quoted or env_line or not _IDENTIFIER.fullmatch(value)
    if len(value) < 8 or not any(c.isalpha() for c in value) or _VERSION.fullmatch(value):
        return False
    has_digit = any(c.isdigit() for c in value)
    has_symbol = any(not c.isalnum() for c in value)
    if not has_digit:
        # Random 20+ character secrets almost always hold a digit; without one, ask for more evidence
        # so that names such as `db-credentials` or `my_secret_name` stay.
        mixed_case = any(c.islower() for c in value) and any(c.isupper() for c in value)
        return len(value) >= 20 and mixed_case and shannon_entropy(value) >= 4.0
    if len(value) < 12:
        return shannon_entropy(value) >= 2.5
    return shannon_entropy(value) >= 3.0 and (has_digit or has_symbol)


_SECRET_KEY_WORDS = (
    r"password|passwd|passphrase|pwd|pass|secret|token|api[_-]?key|apikey|access[_-]?key|"
    r"secret[_-]?key|private[_-]?key|client[_-]?secret|credentials?|auth[_-]?token|session[_-]?key|"
    r"signing[_-]?key|encryption[_-]?key|master[_-]?key"
)


# A key must *end* with one of the words (`max_tokens`, `tokenizer`, `TOKEN_URL` do not).
_SECRET_KEY = re.compile(rf"(?i)(?:^|[^A-Za-z0-9]|(?<=[a-z])(?=[A-Z]))(?:{_SECRET_KEY_WORDS})$")


# Anchored on the key word (an alternation of literals is cheap to scan for); the key's own start is
# checked in Python: `DB_PASSWORD`, `client.secret` and camelCase `accessToken` count, `bypass` not.
_KV_SECRET = re.compile(
    rf"""(?ix)
    (?:{_SECRET_KEY_WORDS})
    ["']?\s*(?::=|=>|[:=])\s*
    (?:"(?P<dq>[^"\n]{{4,400}})"|'(?P<sq>[^'\n]{{4,400}})'|(?P<bare>[^\s"',;(){{}}\[\]<>]{{4,400}}))
    """
)


_KEY_CHARS = frozenset(string.ascii_letters + string.digits + "_.-")


_ENV_LINE_START = re.compile(r"(?:^|\n)[ \t]*(?:export[ \t]+)?\Z")


def _kv_span(text: str, m: re.Match[str]) -> tuple[int, int] | None:
    start = m.start()
    if start > 0:
        prev = text[start - 1]
        if prev.isalnum() and not (prev.islower() and text[start].isupper()):
            return None
    key_start = start
    while key_start > 0 and text[key_start - 1] in _KEY_CHARS:
        key_start -= 1
    group = "dq" if m.group("dq") is not None else "sq" if m.group("sq") is not None else "bare"
    keyword = _KV_KEYWORD.match(text, start)
    assert keyword is not None
    # `DB_PASSWORD=correcthorse` at the start of a line is config (.env), not code: trust it.
    env_line = (
        group == "bare"
        and text[keyword.end() : m.start(group)] == "="
        and _ENV_LINE_START.search(text[max(0, key_start - 40) : key_start]) is not None
    )
    value = m.group(group)
    if group == "bare":
        value = value.rstrip(".")  # a sentence's full stop, not part of the value
    if not looks_secret(value, keyword.group(), quoted=group != "bare", env_line=env_line):
        return None
    return m.start(group), m.start(group) + len(value)


_KV_KEYWORD = re.compile(rf"(?i)(?:{_SECRET_KEY_WORDS})")

# Every key word holds one of these (the HIGH_ENTROPY_SECRET gate's literals), at most _KV_LEAD
# characters in (`encryption_key`): a match of _KV_SECRET starts at most that far before one.
_KV_ROOTS = ("pass", "pwd", "secret", "token", "key", "credential")
_KV_LEAD = 11


def kv_matches(text: str, lowered: str) -> Iterator[re.Match[str]]:
    """`_KV_SECRET.finditer(text)`, the same matches, tried only where a key word can start.

    A case-blind alternation is tried at every position by Python's `re` (a fifth of the writer's
    redaction time went there on agent text, where `key` and `token` are everywhere); `str.find` on
    the lowered text finds the few places worth trying, and `match` there is what `finditer`'s search
    finds at that start. ASCII only: there `lower()` keeps every index and `re`'s case folding is
    `lower()`'s (elsewhere `ſ` matches `s`); other text takes `finditer` itself."""
    if not text.isascii():
        yield from _KV_SECRET.finditer(text)
        return
    starts: set[int] = set()
    for root in _KV_ROOTS:
        i = lowered.find(root)
        while i >= 0:
            starts.update(range(max(0, i - _KV_LEAD), i + 1))
            i = lowered.find(root, i + 1)
    end = 0
    for q in sorted(starts):
        if q >= end and (m := _KV_SECRET.match(text, q)) is not None:
            yield m
            end = m.end()


def _c(pattern: str, flags: int = 0) -> re.Pattern[str]:
    return re.compile(pattern, flags)


_TOKEN_CHARS = r"[A-Za-z0-9_\-]"


_SECRET_RULES: tuple[_Rule, ...] = (
    # Provider API keys: OpenAI (sk-, sk-proj-, sk-svcacct-), Anthropic (sk-ant-), Stripe, Slack,
    # Google, Hugging Face, Groq, xAI, Replicate, npm, PyPI, SendGrid, DigitalOcean, Shopify.
    _Rule("API_KEY", _c(rf"(?<![A-Za-z0-9])(?P<s>sk-(?:ant-|proj-|svcacct-|admin-|or-v1-)?{_TOKEN_CHARS}{{20,}})"), 0.95,
          lambda m: any(c.isdigit() for c in m.group("s"))),
    _Rule("API_KEY", _c(r"(?<![A-Za-z0-9])(?P<s>(?:sk|rk|pk)_(?:live|test)_[0-9A-Za-z]{16,})"), 0.95),
    _Rule("API_KEY", _c(r"(?<![A-Za-z0-9])(?P<s>xox[abposr]-[0-9A-Za-z\-]{10,})"), 0.95),
    _Rule("API_KEY", _c(r"(?<![A-Za-z0-9])(?P<s>AIza[0-9A-Za-z_\-]{35})"), 0.95),
    _Rule("API_KEY", _c(r"(?<![A-Za-z0-9])(?P<s>hf_[A-Za-z0-9]{30,})"), 0.9),
    _Rule("API_KEY", _c(r"(?<![A-Za-z0-9])(?P<s>(?:gsk|xai|r8|npm|dop_v1|shpat|shpss)[_-][A-Za-z0-9]{30,})"), 0.9),
    _Rule("API_KEY", _c(r"(?<![A-Za-z0-9])(?P<s>pypi-AgE[A-Za-z0-9_\-]{50,})"), 0.95),
    _Rule("API_KEY", _c(r"(?<![A-Za-z0-9])(?P<s>SG\.[A-Za-z0-9_\-]{16,}\.[A-Za-z0-9_\-]{16,})"), 0.95),
    # AWS: access key ids by prefix; secret access keys by their key name (40 base64-ish chars).
    _Rule("AWS_ACCESS_KEY", _c(r"(?<![A-Z0-9])(?P<s>(?:AKIA|ASIA|AGPA|AIDA|AROA|AIPA|ANPA|ANVA|ABIA|ACCA)[A-Z0-9]{16})(?![A-Z0-9])"), 0.95),
    _Rule("AWS_ACCESS_KEY", _c(r"""(?i)aws_?secret_?(?:access_?)?key["']?\s*[:=]\s*["']?(?P<s>[A-Za-z0-9/+=]{40})(?![A-Za-z0-9/+=])"""), 0.95),
    _Rule("GITHUB_TOKEN", _c(r"(?<![A-Za-z0-9])(?P<s>(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{30,255})"), 0.95),
    _Rule("GITHUB_TOKEN", _c(r"(?<![A-Za-z0-9])(?P<s>github_pat_[A-Za-z0-9_]{40,255})"), 0.95),
    _Rule("GITLAB_TOKEN", _c(r"(?<![A-Za-z0-9])(?P<s>(?:glpat|gldt|glrt|glptt|glsoat|gloas)-[A-Za-z0-9_\-]{20,})"), 0.95),
    _Rule("JWT", _c(r"(?<![A-Za-z0-9_\-])(?P<s>eyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]*)"), 0.95),
    # PEM private keys, multi-line; also JSON-escaped (`\n`) and truncated ones (no END line).
    _Rule("PRIVATE_KEY", _c(
        r"(?P<s>-----BEGIN[A-Z0-9 ]{0,30} PRIVATE KEY(?: BLOCK)?-----"
        r"(?:[\s\S]{0,20000}?-----END[A-Z0-9 ]{0,30} PRIVATE KEY(?: BLOCK)?-----|[A-Za-z0-9+/=\s\\:\-,]*))"), 1.0),
    # scheme://user:password@host (postgres, mysql, redis, amqp, mongodb, https ...): the password.
    _Rule("URL_CREDENTIALS", _c(r"(?i)\b[a-z][a-z0-9+.\-]{1,20}://[^\s:/@'\"<>]*:(?P<s>[^\s/'\"<>]+)@[A-Za-z0-9\[]"), 0.95,
          lambda m: not _is_reference(m.group("s"))),
    # key=value connection strings (ADO.NET, JDBC properties, libpq): Password=...;
    _Rule("URL_CREDENTIALS", _c(
        r"(?i)(?:server|host|data source|database|initial catalog|user id|uid|username)\s*=[^;\n]*;"
        r"(?:[^;\n]*;)*?\s*(?:password|pwd)\s*=\s*(?P<s>[^;\n'\"]{1,200})"), 0.9,
          lambda m: not _is_reference(m.group("s").strip())),
    _Rule("AUTH_HEADER", _c(
        r"(?i)\b(?:proxy-)?authorization[\"']?\s*[:=]\s*[\"']?(?:bearer|basic|token|digest|bot|apikey|sso-key)\s+"
        r"(?P<s>[A-Za-z0-9._~+/=\-:]{8,})"), 0.95, lambda m: not _is_reference(m.group("s"))),
    _Rule("AUTH_HEADER", _c(
        r"(?i)\b(?:x-api-key|api-key|x-auth-token|x-goog-api-key|x-access-token|private-token|x-gitlab-token)"
        r"[\"']?\s*[:=]\s*[\"']?(?P<s>[A-Za-z0-9._~+/=\-]{8,})"), 0.95, lambda m: not _is_reference(m.group("s"))),
    _Rule("AUTH_HEADER", _c(r"(?i)(?:^|\n)\s*(?:set-)?cookie\s*:\s*(?P<s>[^\r\n]{8,})"), 0.9),
    _Rule("AUTH_HEADER", _c(r"(?<![A-Za-z])Bearer\s+(?P<s>[A-Za-z0-9._~+/=\-]{20,})"), 0.8,
          lambda m: not _is_reference(m.group("s")) and any(c.isdigit() for c in m.group("s"))),
)  # fmt: skip


# Cheap gates: a rule family runs only when one of its literals occurs (most texts hold no secret).
# Substring tests run at memchr speed; case-insensitive ones are checked against `text.lower()`.
_SECRET_GATES: dict[str, tuple[tuple[str, ...], bool]] = {  # entity -> (literals, on lowered text)
    "API_KEY": (("sk-", "_live_", "_test_", "xox", "AIza", "hf_", "gsk_", "xai-", "r8_", "npm_", "dop_v1", "shp", "pypi-", "SG."), False),
    "AWS_ACCESS_KEY": (("akia", "asia", "agpa", "aida", "aroa", "aipa", "anpa", "anva", "abia", "acca", "secret"), True),
    "GITHUB_TOKEN": (("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"), False),
    "GITLAB_TOKEN": (("glpat-", "gldt-", "glrt-", "glptt-", "glsoat-", "gloas-"), False),
    "JWT": (("eyJ",), False),
    "PRIVATE_KEY": (("PRIVATE KEY",), False),
    "URL_CREDENTIALS": (("://", "password", "pwd"), True),
    "AUTH_HEADER": (("authorization", "api-key", "auth-token", "access-token", "private-token", "gitlab-token", "cookie", "bearer"), True),
    "HIGH_ENTROPY_SECRET": (("pass", "pwd", "secret", "token", "key", "credential"), True),
}  # fmt: skip


def _phone_windows(text: str, key: str | None = None) -> Iterator[tuple[int, int]]:
    """Short windows around digit runs that could be phone numbers as they are written in text (>= 7
    digits, see `AgentPhoneRecognizer`): python-phonenumbers, the costly part of a scan, only sees these."""
    last_end = -1
    start = end = -1
    for m in _PHONE_CANDIDATE.finditer(text):
        candidate = m.group()
        free = _free_part(text, m.start(), candidate)
        if sum(c.isdigit() for c in free) < 7 or _DATE.fullmatch(candidate.strip()):
            continue  # logs are full of ISO dates; no region parses them as phone numbers
        if _DECIMAL.fullmatch(candidate):
            continue  # `16.498936`
        if candidate.isdigit() and (_word_at(text, m.start() - 1) or _word_at(text, m.end())):
            # Digits glued to letters (hex ids: phonenumbers at leniency VALID rejects these too) or
            # to an identifier (`call_104640775`, `req_2125551234`) are ids, not phone numbers.
            continue
        if not any(c.isspace() for c in candidate) and glued(text, m.start(), m.end()):
            continue  # `haiku-4-5-20251001`, `10:23:45.123456`: inside an identifier or a time
        if (candidate[0] != "+" and not _DIGIT_SEP.search(free)
                and not has_phone_context(text, m.start(), key)):
            continue  # a lone digit run (`10000399 8b55`: a count before a hex id) needs a phone word
        s, e = max(0, m.start() - 4), min(len(text), m.end() + 4)
        if s <= last_end:  # merge neighbours so a number is never cut in two
            end = e
        else:
            if start >= 0:
                yield start, end
            start, end = s, e
        last_end = end
    if start >= 0:
        yield start, end


def _free_part(text: str, start: int, candidate: str) -> str:
    """The part of the candidate a phone number could be made of. python-phonenumbers (leniency VALID)
    rejects a match that a Latin letter touches, and its inner matches end at separators, so a digit
    group glued to a letter at either end of the candidate can only be cut off (`request 2 172687bd5e`:
    a count before a hex id), unless the letters are an extension's label (`0132x12`, `0132ext. 12`)."""
    lo, hi = 0, len(candidate)
    if candidate[0].isdigit() and _letter_at(text, start - 1):
        while lo < hi and candidate[lo].isdigit():
            lo += 1
    after = start + len(candidate)
    if _letter_at(text, after) and not text[after : after + 5].lower().startswith(_EXTENSION_WORDS):
        while hi > lo and candidate[hi - 1].isdigit():
            hi -= 1
    return candidate[lo:hi]


_EXTENSION_WORDS = ("x", "ext", "int", "anexo")  # python-phonenumbers' extension labels in Latin letters


def _letter_at(text: str, i: int) -> bool:
    return 0 <= i < len(text) and text[i].isascii() and text[i].isalpha()


_DECIMAL = re.compile(r"\d+\.\d+")
_DIGIT_SEP = re.compile(r"\d[ \t().\-/]+\d|\(\d")


def _word_at(text: str, i: int) -> bool:
    return 0 <= i < len(text) and (text[i] == "_" or (text[i].isascii() and text[i].isalpha()))


_PHONE_CANDIDATE = _c(r"[+(]?\d[\d \t().\-/]{5,}\d")


_DATE = _c(r"\d{4}([-/.])\d{1,2}\1\d{1,2}|\d{1,2}([-/.])\d{1,2}\2\d{4}")


# --- precision on agent traffic ---------------------------------------------------------------------
# Agent prompts and tool output are full of digit runs that parse as phone numbers or pass Luhn:
# model ids with dates (`claude-haiku-4-5-20251001`), versions, epoch timestamps, line numbers, ids.
# The rules below say what a real phone number or card number looks like in text; each is measured
# by bench/redaction_quality.py (tuned on its dev split).

# Characters that join a digit run to a word around it: `haiku-4-5-20251001`, `v0.32.1`, `run_2024`,
# `src/2025/01`. A value glued on by one of them is part of an identifier, not a standalone number.
# `:` joins only after a digit (`10:23:31 2019 -0700`, `host:8080`), so `tel:+1...` still counts.
_GLUE = frozenset("-_./")


def glued(text: str, start: int, end: int) -> bool:
    """Is text[start:end] part of a longer identifier (letters/digits touching it, directly or across a
    joining character such as `-` or `.`)?"""
    before = text[start - 1] if start > 0 else ""
    after = text[end] if end < len(text) else ""
    if before.isalnum() or after.isalnum():
        return True
    if start > 1 and (before in _GLUE or (before == ":" and text[start - 2].isdigit())) and text[start - 2].isalnum():
        return True
    return after in _GLUE and end + 1 < len(text) and text[end + 1].isalnum()


# Words that make a number a phone number, as whole words (Presidio's list without `number`, which
# also precedes line, build and version numbers in agent text; substrings would let `string` say
# `ring` and `hotel` say `tel`).
_PHONE_WORDS = re.compile(r"(?i)\b(?:phone|telephone|tel|cell|cellphone|mobile|call|fax|whatsapp|sms|dial|contact)\b")
# JSON keys that name a phone number (`phone`, `mobile_number`, `faxNumber`, `tel`), not `call_id`.
_PHONE_KEY = re.compile(r"(?i)(?:phone|mobile|cell|fax|whatsapp|msisdn|^tel(?:ephone)?(?:[_-]?(?:no|number))?$)")


def has_phone_context(text: str, start: int, key: str | None, window: int = 40) -> bool:
    """A phone word in the JSON key the value sits under, or in the `window` characters before it."""
    if key is not None and _PHONE_KEY.search(key):
        return True
    # The words must be on the value's own line: `tel +1 ...` does not make the next line's number one.
    line_start = text.rfind("\n", 0, start) + 1
    return _PHONE_WORDS.search(text, max(line_start, start - window), start) is not None


def digit_groups(text: str) -> list[int]:
    """Lengths of the digit runs of a formatted number: `+1 (415) 555-0132` -> [1, 3, 3, 4]."""
    return [len(g) for g in re.findall(r"\d+", text)]


# Card schemes by IIN prefix and the lengths they issue. Presidio's pattern also admits a `1` prefix
# (UATP), which is what 13-digit epoch milliseconds look like.
_CARD_SCHEMES: tuple[tuple[re.Pattern[str], tuple[int, ...]], ...] = (
    (re.compile(r"4"), (13, 16, 19)),  # Visa
    (re.compile(r"5[1-5]|2(?:2[2-9]|[3-6]\d|7[01]|720)"), (16,)),  # Mastercard
    (re.compile(r"3[47]"), (15,)),  # Amex
    (re.compile(r"6(?:011|5|4[4-9])|62"), (16, 17, 18, 19)),  # Discover, UnionPay
    (re.compile(r"35(?:2[89]|[3-8])"), (16, 17, 18, 19)),  # JCB
    (re.compile(r"3(?:0[0-5]|[68])"), (14, 16, 19)),  # Diners
)


def card_scheme_ok(digits: str) -> bool:
    return any(p.match(digits) and len(digits) in lengths for p, lengths in _CARD_SCHEMES)


# Gates for Presidio's pattern recognizers (entity -> regex that must match somewhere first): each
# matches wherever its recognizer's patterns can (the `\b`s are the patterns' own), cheaper. Each
# starts with a rare literal or a narrow class, the rest of its first element checked behind it
# (`(?<=...)`): Python's `re` skips ahead to a possible first character in C, where a gate that
# began with `\b`, `\w` or a hex class was tried at nearly every position. `\d(?<!\w\d)` is `\b\d`.
# tests/unit/test_redaction_agent.py holds each to its plain form (GATES_PLAIN there) on generated text.
_PRESIDIO_GATES: dict[str, re.Pattern[str]] = {
    "EMAIL_ADDRESS": _c(r"@(?<=\w@)\w"),
    "CREDIT_CARD": _c(r"\d(?<!\w\d)\d{3}[ -]?\d{3,4}[ -]?\d{3,4}[ -]?\d{3,5}\b"),
    "IP_ADDRESS": _c(r"\.(?<=\d\.)\d{1,3}\.\d{1,3}\.\d|::|:(?<=[0-9A-Fa-f]:)(?:[0-9A-Fa-f]{1,4}:){3}"),
    "IBAN_CODE": _c(r"[A-Z]{2}\d{2}[ ]?[A-Z0-9]{4}"),  # capitals: rarer than digits in agent text
    "US_SSN": _c(r"\d(?<!\w\d)\d{2}[- .]?\d{2}[- .]?\d{4}\b"),
    "US_ITIN": _c(r"9(?<!\w9)\d{2}[- ]?[5-9]\d[- ]?\d{4}\b"),
    # Presidio's match starting 1 or 3 is valid only when all of it is base58 (its checksum decoder
    # refuses 0, O, I, l): a hex id (`1f0a...`) seldom has 25 such characters in a row.
    "CRYPTO": _c(r"bc1[a-zA-HJ-NP-Z0-9]{25}|[13][1-9A-HJ-NP-Za-km-z]{25}"),
    "MAC_ADDRESS": _c(r"[:-](?<=[0-9A-Fa-f]{2}[:-])[0-9A-Fa-f]{2}[:-][0-9A-Fa-f]{2}|\.(?<=[0-9A-Fa-f]{4}\.)[0-9A-Fa-f]{4}\."),
    "URL": _c(r"\.(?<=[A-Za-z0-9]\.)[A-Za-z]{2}"),
    "UUID": _c(r"-(?<=[0-9a-fA-F]{8}-)[0-9a-fA-F]{4}-"),
    "US_DRIVER_LICENSE": _c(r"\d{5}"),
    "US_BANK_NUMBER": _c(r"\d{8}"),
    "US_PASSPORT": _c(r"\d{8}"),
    "UK_NHS": _c(r"\d{3}[ -]?\d{3}[ -]?\d{4}"),
    "MEDICAL_LICENSE": _c(r"\d(?<=[A-Za-z]{2}\d)\d{6}"),
    "DATE_TIME": _c(r"\d"),
}


_AUTH_KEY = re.compile(
    r"(?i)^(?:(?:proxy-)?authorization|x-api-key|api-key|x-auth-token|x-goog-api-key|x-access-token|"
    r"private-token|x-gitlab-token|cookie|set-cookie)$"
)


_AUTH_VALUE = re.compile(r"(?i)\s*(?:(?:bearer|basic|token|digest|bot|apikey)\s+)?(?P<s>\S[\s\S]*)")


def _merge(found: list[tuple[int, int, str, float]]) -> list[tuple[int, int, str, float]]:
    """Overlapping detections become one span (no detected character may survive), labelled by the
    strongest member: highest score, then longest."""
    if not found:
        return []
    # An address after `user:password@` is the URL's host, not a mailbox: the URL rule owns it.
    creds = [(s, e) for s, e, t, _ in found if t == "URL_CREDENTIALS"]
    if creds:
        found = [f for f in found if f[2] != "EMAIL_ADDRESS" or not any(s <= f[0] < e for s, e in creds)]
    found.sort(key=lambda f: (f[0], -f[1]))
    merged: list[tuple[int, int, str, float]] = []
    best: tuple[int, int, str, float] | None = None
    for f in found:
        if merged and f[0] < merged[-1][1]:
            s, e, t, sc = merged[-1]
            assert best is not None
            if (f[3], f[1] - f[0]) > (best[3], best[1] - best[0]):
                best = f
            merged[-1] = (s, max(e, f[1]), best[2], best[3])
        else:
            merged.append(f)
            best = f
    return merged
