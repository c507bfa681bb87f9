"""Redaction of persisted text: Presidio recognizers plus the secret kinds Presidio lacks.

Everything the store or the spool keeps goes through `Redactor.redact_value` first; what is served to
the client is never touched. The design follows the cost model in the field notes:

- Presidio's `AnalyzerEngine.analyze` costs ~26 ms per 3 KB on one core. Profiling showed where:
  `PhoneRecognizer` (python-phonenumbers, 8 regions over the whole text) ~14 ms, the lemma context
  enhancer ~6 ms (it walks the spaCy doc once per result, and with a blank pipeline every lemma is
  empty, so it never boosts anything), the spaCy tokenizer ~3 ms, a dozen country recognizers the
  rest. So the `Redactor` drives Presidio's recognizers itself: each one sits behind a cheap `re`
  gate that says whether it can match at all, phonenumbers only sees short windows around digit runs,
  and context words are read from the text just before a match (Presidio's prefix window of five
  words, substring match) instead of from spaCy lemmas.
- Offline: the default NLP pipeline is `spacy.blank("en")`; it yields no entities and no lemmas, so it
  is not run at all. When `ner_model` names an installed spaCy pipeline (a package or a path) it is run
  once per text and Presidio's `SpacyRecognizer` turns its entities into PERSON / LOCATION / ...
  The email recognizer's tldextract uses its bundled suffix list and never fetches.
- `RedactionPool` spreads distinct contents over worker processes; callers scan each distinct content
  once (the store is content-addressed) and off the request path (the writer).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import math
import os
import re
import string
import sys
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "DEFAULT_ENTITIES",
    "OPT_IN_ENTITIES",
    "SECRET_ENTITIES",
    "RedactionConfig",
    "PendingRedaction",
    "RedactionPool",
    "RedactionResult",
    "Redactor",
    "looks_secret",
    "shannon_entropy",
]

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

_LANGUAGE = "en"


@dataclass(frozen=True)
class RedactionConfig:
    """What to redact and how. `entities=None` means `DEFAULT_ENTITIES` (plus PERSON and LOCATION when
    `ner_model` is set); name an `OPT_IN_ENTITIES` member explicitly to get it."""

    entities: tuple[str, ...] | None = None
    style: Literal["placeholder", "hash"] = "placeholder"
    allow_list: tuple[str, ...] = ()
    salt: bytes = b""
    ner_model: str | None = None
    score_threshold: float = 0.4

    def __post_init__(self) -> None:
        if self.style not in ("placeholder", "hash"):
            raise ValueError(f"style must be 'placeholder' or 'hash', not {self.style!r}")
        if not 0.0 <= self.score_threshold <= 1.0:
            raise ValueError("score_threshold must be within [0, 1]")
        # Lists from TOML/JSON are accepted but stored as tuples so the config stays hashable.
        if self.entities is not None:
            object.__setattr__(self, "entities", tuple(self.entities))
        object.__setattr__(self, "allow_list", tuple(self.allow_list))


@dataclass
class RedactionResult:
    text: str
    counts: dict[str, int]
    spans: list[tuple[int, int, str]] = field(default_factory=list)  # offsets in the input; no values


def shannon_entropy(value: str) -> float:
    """Bits per character of `value`'s own character distribution."""
    if not value:
        return 0.0
    n = len(value)
    return -sum(c / n * math.log2(c / n) for c in Counter(value).values())


# --------------------------------------------------------------------------------------------------
# Secret rules. Each is a plain `re` pattern; the named group `s` (when present) is the part redacted,
# so `password=` or `Bearer ` stay readable and only the value goes.


@dataclass(frozen=True)
class _Rule:
    entity: str
    pattern: re.Pattern[str]
    score: float
    check: Any = None  # callable(match) -> bool, for values a regex alone cannot judge


_PLACEHOLDER_WORDS = frozenset(
    {
        "none", "null", "nil", "true", "false", "undefined", "required", "optional", "string", "str",
        "bytes", "int", "password", "passwd", "secret", "token", "redacted", "hidden", "masked",
        "example", "placeholder", "your_password", "your_token", "your_api_key", "your-api-key",
    }
)  # fmt: skip
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z_.]*")  # code such as `password = self.password`
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
    if len(value) < 8 or not any(c.isalpha() for c in value):
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


def _phone_windows(text: str) -> Iterator[tuple[int, int]]:
    """Short windows around digit runs that could be phone numbers (>= 7 digits)."""
    last_end = -1
    start = end = -1
    for m in _PHONE_CANDIDATE.finditer(text):
        candidate = m.group()
        if sum(c.isdigit() for c in candidate) < 7 or _DATE.fullmatch(candidate.strip()):
            continue  # logs are full of ISO dates; no region parses them as phone numbers
        if candidate.isdigit() and (_word_at(text, m.start() - 1) or _word_at(text, m.end())):
            # Digits glued to letters (hex ids: phonenumbers at leniency VALID rejects these too) or
            # to an identifier (`call_104640775`, `req_2125551234`) are ids, not phone numbers.
            continue
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


def _word_at(text: str, i: int) -> bool:
    return 0 <= i < len(text) and (text[i] == "_" or (text[i].isascii() and text[i].isalpha()))


_PHONE_CANDIDATE = _c(r"[+(]?\d[\d \t().\-/]{5,}\d")
_DATE = _c(r"\d{4}([-/.])\d{1,2}\1\d{1,2}|\d{1,2}([-/.])\d{1,2}\2\d{4}")

# Gates for Presidio's pattern recognizers (entity -> regex that must match somewhere first).
_PRESIDIO_GATES: dict[str, re.Pattern[str]] = {
    "EMAIL_ADDRESS": _c(r"\w@\w"),
    "CREDIT_CARD": _c(r"\d{4}[ -]?\d{3,4}[ -]?\d{3,4}[ -]?\d{3,5}"),
    "IP_ADDRESS": _c(r"\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}|::|(?:[0-9A-Fa-f]{1,4}:){4}"),
    "IBAN_CODE": _c(r"[A-Z]{2}\d{2}[ ]?[A-Z0-9]{4}"),
    "US_SSN": _c(r"\d{3}[- .]?\d{2}[- .]?\d{4}"),
    "US_ITIN": _c(r"9\d{2}[- ]?[5-9]\d[- ]?\d{4}"),
    "CRYPTO": _c(r"(?:bc1|[13])[a-zA-HJ-NP-Z0-9]{25}"),
    "MAC_ADDRESS": _c(r"[0-9A-Fa-f]{2}[:-][0-9A-Fa-f]{2}[:-][0-9A-Fa-f]{2}|[0-9A-Fa-f]{4}\.[0-9A-Fa-f]{4}\."),
    "URL": _c(r"[A-Za-z0-9]\.[A-Za-z]{2}"),
    "UUID": _c(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-"),
    "US_DRIVER_LICENSE": _c(r"\d{5}"),
    "US_BANK_NUMBER": _c(r"\d{8}"),
    "US_PASSPORT": _c(r"\d{8}"),
    "UK_NHS": _c(r"\d{3}[ -]?\d{3}[ -]?\d{4}"),
    "MEDICAL_LICENSE": _c(r"[A-Za-z]{2}\d{7}"),
    "DATE_TIME": _c(r"\d"),
}


@contextlib.contextmanager
def _without_torch() -> Iterator[None]:
    """spaCy's thinc imports torch when it is installed (seconds, hundreds of MB per process) and
    Presidio imports transformers; the redactor uses neither. Hide them while Presidio is imported,
    then unhide them so later real imports in the same process still work."""
    hidden = [m for m in ("torch", "transformers") if m not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


def _hash_key(salt: bytes, tenant: str) -> bytes:
    return salt + b"\x00" + tenant.encode()


class Redactor:
    """Finds PII and secrets in text and replaces them. Build once per process; thread-safe for reads."""

    def __init__(self, config: RedactionConfig | None = None) -> None:
        self.config = config or RedactionConfig()
        with _without_torch():
            self._build()

    # -- construction ------------------------------------------------------------------------------

    def _build(self) -> None:
        from presidio_analyzer import predefined_recognizers as pr

        email_cls, phone_cls = _recognizer_classes()
        cfg = self.config
        self._nlp = None
        self._nlp_engine = None
        self._ner_recognizer = None
        if cfg.ner_model:
            self._load_ner(cfg.ner_model)

        presidio: dict[str, Any] = {
            "EMAIL_ADDRESS": email_cls,
            "PHONE_NUMBER": phone_cls,
            "CREDIT_CARD": pr.CreditCardRecognizer,
            "IP_ADDRESS": pr.IpRecognizer,
            "IBAN_CODE": pr.IbanRecognizer,
            "US_SSN": pr.UsSsnRecognizer,
            "US_ITIN": pr.UsItinRecognizer,
            "CRYPTO": pr.CryptoRecognizer,
            "MAC_ADDRESS": pr.MacAddressRecognizer,
            "URL": pr.UrlRecognizer,
            "DATE_TIME": pr.DateRecognizer,
            "UUID": pr.UuidRecognizer,
            "US_DRIVER_LICENSE": pr.UsLicenseRecognizer,
            "US_BANK_NUMBER": pr.UsBankRecognizer,
            "US_PASSPORT": pr.UsPassportRecognizer,
            "UK_NHS": pr.NhsRecognizer,
            "MEDICAL_LICENSE": pr.MedicalLicenseRecognizer,
        }
        supported = set(presidio) | SECRET_ENTITIES
        if self._ner_recognizer is not None:
            supported |= set(NER_ENTITIES)
        self.supported_entities: tuple[str, ...] = tuple(sorted(supported))

        if cfg.entities is None:
            wanted = list(DEFAULT_ENTITIES)
            if self._ner_recognizer is not None:
                wanted += DEFAULT_NER_ENTITIES
        else:
            unknown = sorted(set(cfg.entities) - supported - set(NER_ENTITIES))
            if unknown:
                raise ValueError(f"unsupported entities {unknown}; supported: {sorted(supported)}")
            wanted = [e for e in cfg.entities if e in supported]
        self.entities: tuple[str, ...] = tuple(dict.fromkeys(wanted))

        self._recognizers = [
            (entity, presidio[entity](), _PRESIDIO_GATES.get(entity))
            for entity in self.entities
            if entity in presidio
        ]
        self._secret_rules = [r for r in _SECRET_RULES if r.entity in self.entities]
        self._secret_gates = {e: g for e, g in _SECRET_GATES.items() if e in self.entities}
        self._ner_entities = [e for e in self.entities if e in NER_ENTITIES]
        self._allow = frozenset(cfg.allow_list) | BENIGN_VALUES

    def _load_ner(self, name: str) -> None:
        import logging

        import spacy
        from presidio_analyzer.nlp_engine import SpacyNlpEngine
        from presidio_analyzer.predefined_recognizers import SpacyRecognizer

        if not (spacy.util.is_package(name) or os.path.isdir(name)):
            # Never download: fall back to the blank pipeline, which finds no names.
            logging.getLogger(__name__).warning("spaCy model %r is not installed; NER disabled", name)
            return
        engine = SpacyNlpEngine(models=[{"lang_code": _LANGUAGE, "model_name": name}])
        engine.load()
        self._nlp_engine = engine
        self._ner_recognizer = SpacyRecognizer(supported_entities=list(NER_ENTITIES))

    # -- detection ---------------------------------------------------------------------------------

    def analyze(self, text: str) -> list[tuple[int, int, str, float]]:
        """Detections as (start, end, entity, score), overlaps merged, allow-list applied."""
        if len(text) < 6:  # shorter than anything detectable (`a@b.io`, `hunter2` needs its key)
            return []
        found: list[tuple[int, int, str, float]] = []
        threshold = self.config.score_threshold

        for entity, recognizer, gate in self._recognizers:
            if gate is not None and gate.search(text) is None:
                continue
            for r in recognizer.analyze(text, [entity], None):
                score = r.score
                if score < threshold and recognizer.context:
                    score = self._with_context(text, r.start, score, recognizer.context)
                if score >= threshold:
                    found.append((r.start, r.end, r.entity_type, score))

        lowered = text.lower()
        for entity, (literals, on_lowered) in self._secret_gates.items():
            haystack = lowered if on_lowered else text
            if not any(lit in haystack for lit in literals):
                continue
            if entity == "HIGH_ENTROPY_SECRET":
                for m in _KV_SECRET.finditer(text):
                    span = _kv_span(text, m)
                    if span:
                        found.append((span[0], span[1], entity, 0.7))
                continue
            for rule in self._secret_rules:
                if rule.entity != entity:
                    continue
                for m in rule.pattern.finditer(text):
                    if rule.check is None or rule.check(m):
                        start, end = m.span("s")
                        while end > start + 1 and text[end - 1] == ".":  # a sentence's full stop
                            end -= 1
                        found.append((start, end, entity, rule.score))

        if self._ner_recognizer is not None and self._ner_entities:
            artifacts = self._nlp_engine.process_text(text, _LANGUAGE)
            for r in self._ner_recognizer.analyze(text, self._ner_entities, artifacts):
                if r.score >= threshold:
                    found.append((r.start, r.end, r.entity_type, r.score))

        if self._allow:
            found = [f for f in found if text[f[0] : f[1]].strip() not in self._allow]
        return _merge(found)

    @staticmethod
    def _with_context(text: str, start: int, score: float, context: list[str]) -> float:
        # Presidio's default: five words before the match, substring match, +0.35, floor 0.4.
        words = re.findall(r"[a-z0-9]+", text[max(0, start - 100) : start].lower())[-5:]
        if any(c in w for c in context for w in words):
            return min(1.0, max(score + 0.35, 0.4))
        return score

    # -- replacement -------------------------------------------------------------------------------

    def _replacement(self, entity: str, value: str, tenant: str) -> str:
        if self.config.style == "placeholder":
            return f"<{entity}>"
        digest = hmac.new(_hash_key(self.config.salt, tenant), value.encode(), hashlib.sha256)
        return f"<{entity}:{digest.hexdigest()[:8]}>"

    def redact_text(self, text: str, tenant: str, *, found: list[tuple[str, str]] | None = None) -> RedactionResult:
        """Redact one text. With `found`, each removed raw value and its replacement are appended to it
        (in memory only: the governance token guard needs them to clean token ids; never persist them)."""
        return self._apply(text, self.analyze(text), tenant, found)

    def _apply(self, text: str, spans: list[tuple[int, int, str, float]], tenant: str,
               found: list[tuple[str, str]] | None = None) -> RedactionResult:
        if not spans:
            return RedactionResult(text, {}, [])
        out: list[str] = []
        counts: dict[str, int] = {}
        pos = 0
        for start, end, entity, _ in spans:
            out.append(text[pos:start])
            out.append(self._replacement(entity, text[start:end], tenant))
            if found is not None:
                found.append((text[start:end], out[-1]))
            counts[entity] = counts.get(entity, 0) + 1
            pos = end
        out.append(text[pos:])
        return RedactionResult("".join(out), counts, [(s, e, t) for s, e, t, _ in spans])

    def redact_value(self, value: Any, tenant: str, *, found: list[tuple[str, str]] | None = None
                     ) -> tuple[Any, dict[str, int]]:
        """Redact every string leaf of a JSON-like value (dict values, list items; never keys).

        A string that is itself a JSON object or array (tool call `arguments`, JSON tool results) is
        parsed, redacted leaf by leaf and serialised again, so it stays valid JSON; it is returned
        unchanged when nothing in it was found. `found`: as for `redact_text`.
        """
        counts: Counter[str] = Counter()
        return self._walk(value, tenant, counts, None, found), dict(counts)

    def _walk(self, value: Any, tenant: str, counts: Counter[str], key: str | None,
              found: list[tuple[str, str]] | None = None) -> Any:
        if isinstance(value, str):
            return self._leaf(value, tenant, counts, key, found)
        if isinstance(value, dict):
            return {
                k: self._walk(v, tenant, counts, k if isinstance(k, str) else None, found) for k, v in value.items()
            }
        if isinstance(value, (list, tuple)):
            return [self._walk(v, tenant, counts, key, found) for v in value]
        return value

    def _leaf(self, text: str, tenant: str, counts: Counter[str], key: str | None,
              found: list[tuple[str, str]] | None = None) -> str:
        stripped = text.strip()
        if len(stripped) >= 2 and stripped[0] in "{[" and stripped[-1] in "}]":
            try:
                parsed = json.loads(stripped)
            except ValueError:
                parsed = None
            if isinstance(parsed, (dict, list)):
                inner: Counter[str] = Counter()
                inner_found: list[tuple[str, str]] = []
                redacted = self._walk(parsed, tenant, inner, None, inner_found)
                if not inner:
                    return text
                counts.update(inner)
                if found is not None:
                    found.extend(inner_found)
                return json.dumps(redacted, ensure_ascii=False)
        leaf_found: list[tuple[str, str]] = []
        result = self.redact_text(text, tenant, found=leaf_found)
        # The key of a dict leaf is context the text itself lacks: {"api_key": "..."},
        # {"Authorization": "Bearer ..."}. Used when the value alone showed nothing.
        if not result.counts and key is not None and self._key_says_secret(key, text):
            entity = "AUTH_HEADER" if _AUTH_KEY.search(key) else "HIGH_ENTROPY_SECRET"
            if entity in self.entities and text.strip() not in self._allow:
                m = _AUTH_VALUE.match(text) if entity == "AUTH_HEADER" else None
                start = m.start("s") if m else 0
                counts[entity] += 1
                replacement = self._replacement(entity, text[start:], tenant)
                if found is not None:
                    found.append((text[start:], replacement))
                return text[:start] + replacement
        counts.update(result.counts)
        if found is not None:
            found.extend(leaf_found)
        return result.text

    @staticmethod
    def _key_says_secret(key: str, value: str) -> bool:
        if _AUTH_KEY.search(key):
            m = _AUTH_VALUE.match(value)
            return bool(m) and not _is_reference(m.group("s")) and len(m.group("s")) >= 8
        if _SECRET_KEY.search(key):
            return looks_secret(value, key, quoted=True)
        return False


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


# --------------------------------------------------------------------------------------------------
# Presidio recognizers adapted for speed and offline use. Defined on first use: Presidio is imported
# only inside `_without_torch`.


_CLASSES: tuple[Any, Any] | None = None


def _recognizer_classes() -> tuple[Any, Any]:
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _define_recognizers()
    return _CLASSES


def _define_recognizers() -> tuple[Any, Any]:
    import phonenumbers
    import tldextract
    from presidio_analyzer import EntityRecognizer
    from presidio_analyzer.predefined_recognizers import EmailRecognizer, PhoneRecognizer

    # The bundled public suffix snapshot, no fetch, no cache directory.
    extractor = tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None, fallback_to_snapshot=True)

    class OfflineEmailRecognizer(EmailRecognizer):
        def validate_result(self, pattern_text: str) -> bool:
            return extractor(pattern_text).fqdn != ""

    class WindowedPhoneRecognizer(PhoneRecognizer):
        """python-phonenumbers over the whole text costs ~5 ms/KB (eight regions); it only ever
        matches digit runs, so it is given the runs with a little margin and offsets are shifted back."""

        def analyze(self, text, entities, nlp_artifacts=None):  # type: ignore[override]
            results = []
            for ws, we in _phone_windows(text):
                window = text[ws:we]
                for region in self.supported_regions:
                    for match in phonenumbers.PhoneNumberMatcher(window, region, leniency=self.leniency):
                        result = self._get_recognizer_result(match, window, region, nlp_artifacts)
                        result.start += ws
                        result.end += ws
                        results.append(result)
            return EntityRecognizer.remove_duplicates(results)

    return OfflineEmailRecognizer, WindowedPhoneRecognizer


# --------------------------------------------------------------------------------------------------
# Parallel redaction across processes.

_worker: Redactor | None = None


def _init_worker(config: RedactionConfig) -> None:
    global _worker
    _worker = Redactor(config)


def _redact_one(redactor: Redactor, tenant: str, value: Any, with_values: bool) -> tuple:
    if not with_values:
        return redactor.redact_value(value, tenant)
    found: list[tuple[str, str]] = []
    body, counts = redactor.redact_value(value, tenant, found=found)
    return body, counts, found


def _redact_chunk(items: list[tuple[str, Any]], with_values: bool = False) -> list[tuple]:
    assert _worker is not None
    return [_redact_one(_worker, tenant, value, with_values) for tenant, value in items]


def _text_size(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_size(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_text_size(v) for v in value)
    return 0


class _Done:
    def __init__(self, value: list[tuple[Any, dict[str, int]]]) -> None:
        self._value = value

    def result(self) -> list[tuple[Any, dict[str, int]]]:
        return self._value


class PendingRedaction:
    """Results of `RedactionPool.submit_many`, in input order once `result()` returns."""

    def __init__(self, chunks: list[list[int]], futures: list[Any]) -> None:
        self._chunks = chunks
        self._futures = futures

    def result(self) -> list[tuple[Any, dict[str, int]]]:
        out: list[Any] = [None] * sum(len(c) for c in self._chunks)
        for chunk, fut in zip(self._chunks, self._futures, strict=True):
            for i, res in zip(chunk, fut.result(), strict=True):
                out[i] = res
        return out


class RedactionPool:
    """`redact_value` over many distinct contents, spread across worker processes.

    Workers are spawned (not forked: the proxy runs threads and an event loop) and each builds its own
    `Redactor` from the config once. Batches smaller than `inline_chars` of text are done in the
    calling process, where shipping them to a worker would cost more than the scan.
    """

    def __init__(
        self,
        config: RedactionConfig | None = None,
        max_workers: int | None = None,
        *,
        inline_chars: int = 2_000,
        mp_context: str = "spawn",
    ) -> None:
        import multiprocessing

        self.config = config or RedactionConfig()
        self.max_workers = max_workers or os.cpu_count() or 1
        self.inline_chars = inline_chars
        self._local: Redactor | None = None
        self._executor: ProcessPoolExecutor | None = None
        if self.max_workers > 1:
            self._executor = ProcessPoolExecutor(
                max_workers=self.max_workers,
                mp_context=multiprocessing.get_context(mp_context),
                initializer=_init_worker,
                initargs=(self.config,),
            )

    @property
    def local(self) -> Redactor:
        if self._local is None:
            self._local = Redactor(self.config)
        return self._local

    def warm_up(self) -> None:
        """Start every worker now (each imports Presidio, about a second) rather than on first use."""
        if self._executor is not None:
            list(self._executor.map(_redact_chunk, [[] for _ in range(self.max_workers)]))

    def redact_many(self, items: list[tuple[str, Any]], *, with_values: bool = False) -> list[tuple]:
        """`(tenant, value)` pairs in, `(redacted value, counts)` out, in order. With `with_values`,
        `(redacted value, counts, found)` where `found` lists the (raw value, replacement) pairs removed
        (for the token guard; raw, so keep them in memory only)."""
        return self.submit_many(items, with_values=with_values).result()

    def submit_many(self, items: list[tuple[str, Any]], *, with_values: bool = False) -> PendingRedaction:
        """Like `redact_many` but returns at once; `.result()` waits. Lets a writer hash and queue the
        next batch while this one is scanned."""
        if not items:
            return PendingRedaction([], [])
        sizes = [_text_size(v) for _, v in items]
        if self._executor is None or len(items) == 1 or sum(sizes) < self.inline_chars:
            done = [_redact_one(self.local, tenant, value, with_values) for tenant, value in items]
            return PendingRedaction([list(range(len(items)))], [_Done(done)])
        # Balance by text size, not item count: one 40 KB tool result must not sit with ten others.
        n = min(self.max_workers * 2, len(items))
        chunks: list[list[int]] = [[] for _ in range(n)]
        loads = [0] * n
        for i in sorted(range(len(items)), key=lambda i: -sizes[i]):
            j = loads.index(min(loads))
            chunks[j].append(i)
            loads[j] += sizes[i] + 200  # per-item overhead
        chunks = [c for c in chunks if c]
        futures = [self._executor.submit(_redact_chunk, [items[i] for i in c], with_values) for c in chunks]
        return PendingRedaction(chunks, futures)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> RedactionPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
