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
- Offline: no spaCy pipeline runs for the pattern recognizers (they need no tokens or lemmas). Names
  and places come from `ner_model`, an installed spaCy pipeline (by default the pinned small English
  one), run by `proxy.governance.ner` on the lines where a name can be, never on operator content.
  The email recognizer's tldextract uses its bundled suffix list and never fetches.
- `RedactionPool` (`proxy.governance.redaction_pool`) spreads distinct contents over worker processes; callers scan each distinct content
  once (the store is content-addressed) and off the request path (the writer).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import re
import sys
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from proxy.governance.ner import DEFAULT_NER_MODEL, NerModel, NerStatus, ner_status
from proxy.governance.recognizers import recognizer_classes
from proxy.governance.scan_gates import LiteralGate, key_matters, key_says_secret
from proxy.governance.secrets import (
    _AUTH_KEY,
    _AUTH_VALUE,
    _PRESIDIO_GATES,
    _SECRET_GATES,
    _SECRET_RULES,
    BENIGN_VALUES,
    DEFAULT_ENTITIES,
    DEFAULT_NER_ENTITIES,
    NER_ENTITIES,
    SECRET_ENTITIES,
    _kv_span,
    _merge,
    glued,
    kv_matches,
)


@dataclass(frozen=True)
class RedactionConfig:
    """What to redact and how. `entities=None` means `DEFAULT_ENTITIES` (plus PERSON and LOCATION when
    the NER model loads); name an `OPT_IN_ENTITIES` member explicitly to get it. `ner_model`: an
    installed spaCy pipeline (a package name or a path), by default the pinned small English one;
    None or empty: no NER (names and places are then not found)."""

    entities: tuple[str, ...] | None = None
    style: Literal["placeholder", "hash"] = "placeholder"
    allow_list: tuple[str, ...] = ()
    salt: bytes = b""
    ner_model: str | None = DEFAULT_NER_MODEL
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


# Entities that are digit runs: a match glued into an identifier (`-`, `_`, `.`, `/` or a letter
# touching it) is part of an id, a version or a path, never the value itself.
_NUMBER_ENTITIES = frozenset({"PHONE_NUMBER", "CREDIT_CARD", "US_SSN", "US_ITIN", "US_BANK_NUMBER", "UK_NHS"})


@dataclass
class _Scan:
    """One `redact_value` walk: whose content, what was found, and whether it is operator content."""

    tenant: str
    counts: Counter[str]
    found: list[tuple[str, str]] | None
    operator: bool = False
    memo: dict[tuple, tuple] | None = None  # (text, key, operator, tenant) -> a leaf's scan, in one batch


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

        email_cls, phone_cls, card_cls = recognizer_classes()
        cfg = self.config
        self._ner: NerModel | None = None
        self.ner_status = NerStatus(None, False, "no NER model configured")
        if cfg.ner_model:
            self._load_ner(cfg.ner_model)

        presidio: dict[str, Any] = {
            "EMAIL_ADDRESS": email_cls,
            "PHONE_NUMBER": phone_cls,
            "CREDIT_CARD": card_cls,
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
        if self._ner is not None:
            supported |= set(NER_ENTITIES)
        self.supported_entities: tuple[str, ...] = tuple(sorted(supported))

        if cfg.entities is None:
            wanted = list(DEFAULT_ENTITIES)
            if self._ner is not None:
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
        self._literal_gate = LiteralGate(self._secret_gates)
        self._ner_entities = [e for e in self.entities if e in NER_ENTITIES]
        self._allow = frozenset(cfg.allow_list) | BENIGN_VALUES
        # Object keys repeat endlessly (`type`, `description`, `properties`): remember the clean ones.
        self._clean_keys: set[str] = set()
        self._clean_leaves: set[tuple[str, str | None, bool]] = set()  # so do `assistant`, `stop`, ...

    def _load_ner(self, name: str) -> None:
        import logging

        self.ner_status = ner_status(name)
        if not self.ner_status.available:
            # Never download: without the model no names are found, and the log says so.
            logging.getLogger(__name__).warning("NER off: %s", self.ner_status.reason)
            return
        try:
            self._ner = NerModel(name)
        except Exception as exc:  # a model that is there but will not load: the same, said louder
            self.ner_status = NerStatus(name, False, f"spaCy model {name!r} failed to load: {type(exc).__name__}: {exc}")
            logging.getLogger(__name__).error("NER off: %s", self.ner_status.reason)

    # -- detection ---------------------------------------------------------------------------------

    def analyze(self, text: str, *, key: str | None = None, operator: bool = False
                ) -> list[tuple[int, int, str, float]]:
        """Detections as (start, end, entity, score), overlaps merged, allow-list applied.

        `key`: the JSON object key the text sits under, read as context (`{"phone": "4155550132"}`).
        `operator`: the text is operator content (a system prompt, tool schemas: written by the agent's
        vendor, not its user), scanned for secrets only; see docs/governance.md.
        """
        if len(text) < 6:  # shorter than anything detectable (`a@b.io`, `hunter2` needs its key)
            return []
        found: list[tuple[int, int, str, float]] = []
        threshold = self.config.score_threshold

        for entity, recognizer, gate in () if operator else self._recognizers:
            if gate is not None and gate.search(text) is None:
                continue
            if entity == "PHONE_NUMBER":
                hits = recognizer.find(text, key)
            else:
                hits = recognizer.analyze(text, [entity], None)
            for r in hits:
                if entity in _NUMBER_ENTITIES and glued(text, r.start, r.end):
                    continue  # a digit run inside an identifier: `run-536-90-4412`, `build_4111...`
                score = r.score
                if score < threshold and recognizer.context:
                    score = self._with_context(text, r.start, score, recognizer.context)
                if score >= threshold:
                    found.append((r.start, r.end, r.entity_type, score))

        lowered = text.lower()
        gates = self._secret_gates.items() if self._literal_gate.may_match(text, lowered) else ()
        for entity, (literals, on_lowered) in gates:
            haystack = lowered if on_lowered else text
            if not any(lit in haystack for lit in literals):
                continue
            if entity == "HIGH_ENTROPY_SECRET":
                for m in kv_matches(text, lowered):
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

        if self._ner is not None and self._ner_entities and not operator:
            found += [f for f in self._ner.find(text, self._ner_entities) if f[3] >= threshold]

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

    def redact_text(self, text: str, tenant: str, *, found: list[tuple[str, str]] | None = None,
                    key: str | None = None, operator: bool = False) -> RedactionResult:
        """Redact one text. With `found`, each removed raw value and its replacement are appended to it
        (in memory only: the governance token guard needs them to clean token ids; never persist them).
        `key`, `operator`: as for `analyze`."""
        return self._apply(text, self.analyze(text, key=key, operator=operator), tenant, found)

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

    def redact_value(self, value: Any, tenant: str, *, found: list[tuple[str, str]] | None = None,
                     operator: bool = False) -> tuple[Any, dict[str, int]]:
        """Redact a JSON-like value: every string leaf, every object key, and numbers long enough to be
        a card or phone number (a chat template renders all of them into the prompt).

        A string that is itself a JSON object or array (tool call `arguments`, JSON tool results) is
        parsed, redacted leaf by leaf and serialised again, so it stays valid JSON; it is returned
        unchanged when nothing in it was found. A number found to be PII becomes its placeholder string.
        `found`: as for `redact_text`; `operator`: secrets only (system prompts, tool schemas).
        """
        return self._redact(value, tenant, found, operator, None)

    def _redact(self, value: Any, tenant: str, found: list[tuple[str, str]] | None, operator: bool,
                memo: dict[tuple, tuple] | None) -> tuple[Any, dict[str, int]]:
        counts: Counter[str] = Counter()
        return self._walk(value, _Scan(tenant, counts, found, operator, memo), None), dict(counts)

    def redact_many(self, items: list[tuple[str, Any]], *, with_values: bool = False,
                    operator: Sequence[bool] | None = None) -> list[tuple]:
        """`(tenant, value)` pairs in, `(redacted value, counts)` out, in order. With `with_values`,
        `(redacted value, counts, found)` where `found` lists the (raw value, replacement) pairs removed
        (for the token guard; raw, so keep them in memory only). `operator[i]`: item i is operator
        content (secrets only)."""
        out: list[tuple] = []
        memo: dict[tuple, tuple] = {}  # a text in several items (a model's text and its message) once
        for i, (tenant, value) in enumerate(items):
            op = bool(operator[i]) if operator is not None else False
            if not with_values:
                out.append(self._redact(value, tenant, None, op, memo))
                continue
            found: list[tuple[str, str]] = []
            body, counts = self._redact(value, tenant, found, op, memo)
            out.append((body, counts, found))
        return out

    def close(self) -> None:
        """Nothing to release: the redactor lives in this process."""

    def _walk(self, value: Any, scan: _Scan, key: str | None) -> Any:
        if isinstance(value, str):
            return self._leaf(value, scan, key)
        if isinstance(value, dict):
            out: dict[Any, Any] = {}
            for k, v in value.items():
                name = self._key(k, scan) if isinstance(k, str) else k
                while name in out:  # two keys redacted to the same placeholder: keep both values
                    name = f"{name}#"
                out[name] = self._walk(v, scan, k if isinstance(k, str) else None)
            return out
        if isinstance(value, (list, tuple)):
            return [self._walk(v, scan, key) for v in value]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return self._number(value, scan, key)
        return value

    def _key(self, key: str, scan: _Scan) -> str:
        """An object key is text too: `{"maria@example.com": {...}}` maps people to values."""
        if len(key) < 6 or key in self._clean_keys:
            return key
        result = self.redact_text(key, scan.tenant, found=scan.found, operator=scan.operator)
        if not result.counts:
            if len(self._clean_keys) < 100_000:
                self._clean_keys.add(key)
            return key
        scan.counts.update(result.counts)
        return result.text

    def _number(self, value: int | float, scan: _Scan, key: str | None) -> int | float | str:
        """A bare JSON number can be a card (Luhn-valid, a known scheme) or, under a key such as
        `phone`, a phone number; shorter than seven digits it is neither."""
        text = repr(value) if isinstance(value, float) else str(value)
        if scan.operator or sum(c.isdigit() for c in text) < 7:
            return value
        result = self.redact_text(text, scan.tenant, found=scan.found, key=key)
        if not result.counts:
            return value
        scan.counts.update(result.counts)
        return result.text

    def _leaf(self, text: str, scan: _Scan, key: str | None) -> str:
        # Scanned once per batch, short clean ones once per process (`key_matters` says when it may).
        if key is not None and not key_matters(key):
            key = None
        if (text, key, scan.operator) in self._clean_leaves:
            return text
        memo_key = (text, key, scan.operator, scan.tenant)
        hit = scan.memo.get(memo_key) if scan.memo is not None else None
        if hit is None:
            inner = _Scan(scan.tenant, Counter(), [], scan.operator, scan.memo)
            hit = (self._scan_leaf(text, inner, key), inner.counts, inner.found)
            if not inner.counts and len(text) <= 64 and len(self._clean_leaves) < 50_000:
                self._clean_leaves.add((text, key, scan.operator))
            elif scan.memo is not None:
                scan.memo[memo_key] = hit
        scan.counts.update(hit[1])
        if scan.found is not None:
            scan.found.extend(hit[2] or ())
        return hit[0]

    def _scan_leaf(self, text: str, scan: _Scan, key: str | None) -> str:
        stripped = text.strip()
        if len(stripped) >= 2 and stripped[0] in "{[" and stripped[-1] in "}]":
            try:
                parsed = json.loads(stripped)
            except ValueError:
                parsed = None
            if isinstance(parsed, (dict, list)):
                inner = _Scan(scan.tenant, Counter(), [], scan.operator, scan.memo)
                redacted = self._walk(parsed, inner, None)
                if not inner.counts:
                    return text
                scan.counts.update(inner.counts)
                if scan.found is not None:
                    scan.found.extend(inner.found or ())
                return json.dumps(redacted, ensure_ascii=False)
        leaf_found: list[tuple[str, str]] = []
        result = self.redact_text(text, scan.tenant, found=leaf_found, key=key, operator=scan.operator)
        # The key of a dict leaf is context the text itself lacks: {"api_key": "..."},
        # {"Authorization": "Bearer ..."}. Used when the value alone showed nothing.
        if not result.counts and key is not None and key_says_secret(key, text):
            entity = "AUTH_HEADER" if _AUTH_KEY.search(key) else "HIGH_ENTROPY_SECRET"
            if entity in self.entities and text.strip() not in self._allow:
                m = _AUTH_VALUE.match(text) if entity == "AUTH_HEADER" else None
                start = m.start("s") if m else 0
                scan.counts[entity] += 1
                replacement = self._replacement(entity, text[start:], scan.tenant)
                if scan.found is not None:
                    scan.found.append((text[start:], replacement))
                return text[:start] + replacement
        scan.counts.update(result.counts)
        if scan.found is not None:
            scan.found.extend(leaf_found)
        return result.text


# pydantic's validation messages quote the offending input (`input_value='...'`), cut in the middle when
# long (`'maria.gonzalez@...-555-0132'`): fragments no recognizer can know for what they were. vLLM's 400s
# are such messages. The quote goes; the rest (which field, what was expected) stays for debugging.
_ECHOED_INPUT = re.compile(r"input_value=.*?, input_type=", re.S)


def elide_echoes(error: dict[str, Any] | None) -> dict[str, Any] | None:
    """A step's error with the request values its message echoes removed (redaction still follows)."""
    if not error or not isinstance(error.get("message"), str):
        return error
    return {**error, "message": _ECHOED_INPUT.sub("input_value=<elided>, input_type=", error["message"])}


class TextRedactor(Protocol):
    """What the writer, replay and the control routes need from a redactor (in-process or pooled)."""

    def redact_value(self, value: Any, tenant: str, *, found: list[tuple[str, str]] | None = None,
                     operator: bool = False) -> tuple[Any, dict[str, int]]: ...

    def redact_many(self, items: list[tuple[str, Any]], *, with_values: bool = False,
                    operator: Sequence[bool] | None = None) -> list[tuple]: ...

    def close(self) -> None: ...


class LazyRedactor:
    """An in-process Redactor built on first use (Presidio takes a second to load)."""

    def __init__(self, secret: bytes, ner_model: str | None = DEFAULT_NER_MODEL) -> None:
        self._secret = secret
        self._ner_model = ner_model
        self._r: Redactor | None = None
        self._lock = threading.Lock()

    def get(self) -> Redactor:
        with self._lock:
            if self._r is None:
                self._r = Redactor(RedactionConfig(salt=self._secret, ner_model=self._ner_model))
            return self._r

    def redact_value(self, value: Any, tenant: str, *, found: list[tuple[str, str]] | None = None,
                     operator: bool = False) -> tuple[Any, dict[str, int]]:
        return self.get().redact_value(value, tenant, found=found, operator=operator)

    def redact_text(self, text: str, tenant: str) -> RedactionResult:
        return self.get().redact_text(text, tenant)

    def redact_many(self, items: list[tuple[str, Any]], *, with_values: bool = False,
                    operator: Sequence[bool] | None = None) -> list[tuple]:
        return self.get().redact_many(items, with_values=with_values, operator=operator)

    def close(self) -> None:
        """Nothing to release: the redactor lives in this process."""
