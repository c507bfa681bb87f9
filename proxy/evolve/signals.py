"""Pure helpers of the diagnosis: error signatures, fact-supplying corrections, argument schema checks,
distribution drift. No I/O: the unit tests pin each rule down."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Mapping

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, UnknownType

JsonValue = None | bool | int | float | str | list["JsonValue"] | dict[str, "JsonValue"]

# --- error signatures -------------------------------------------------------------------------------
# A signature is the error text with what varies between occurrences (paths, ids, numbers, quoted
# values) replaced by placeholders, so "no such file: /a/b.txt" and "no such file: /c.txt" cluster.
_SIGNATURE_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b"), "<id>"),
    (re.compile(r"https?://\S+"), "<url>"),
    (re.compile(r"[\w.~@+-]*(?:/[\w.@+-]+)+/?"), "<path>"),
    (re.compile(r"\"[^\"]*\"|'[^']*'|`[^`]*`"), "<str>"),
    (re.compile(r"\b0x[0-9a-f]+\b|\b[0-9a-f]{12,}\b"), "<hex>"),
    (re.compile(r"\b\d+(?:[.:]\d+)*\b"), "<n>"),
    (re.compile(r"\s+"), " "),
)
MAX_SIGNATURE = 120


def error_signature(text: str) -> str:
    """The normalised first non-empty line of an error text."""
    line = next((ln for ln in text.strip().splitlines() if ln.strip()), "")
    sig = line.strip().lower()
    for pattern, repl in _SIGNATURE_RULES:
        sig = pattern.sub(repl, sig)
    return sig.strip()[:MAX_SIGNATURE] or "<empty>"


def text_of(value: JsonValue) -> str:
    """The text of a result's content: a string, a list of parts (joined by lines), or a part's
    `text`, `content` or `output`."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(text_of(v) for v in value)
    if isinstance(value, dict):
        for key in ("text", "content", "output"):
            if key in value:
                return text_of(value[key])
    return ""


def result_text(body: JsonValue) -> str:
    """The text of a stored tool result, whichever API shape it arrived in (chat `tool` message,
    Anthropic `tool_result` block, Responses `function_call_output` item)."""
    if isinstance(body, dict):
        for key in ("content", "output"):
            if key in body:
                return text_of(body[key])
    return text_of(body)


# --- corrections that supply facts ----------------------------------------------------------------
# A correction supplies a fact when it states something the agent could not know (a value, a name,
# a place, a number) rather than asking for different behaviour ("shorter", "don't ..."). Such a
# finding is fixed by memory (retrieval, a facts store), not by changing the policy's weights.
_FACT = re.compile(
    r"\d|<[A-Z_]+>|\"[^\"]+\"|\b(?:is|are|was|were|lives?|located|called|named|equals?|means|"
    r"belongs?|costs?|runs? on|uses?)\b", re.IGNORECASE)
_BEHAVIOUR = re.compile(
    r"\b(?:don'?t|do not|stop|never|always|shorter|longer|too (?:long|short|verbose)|be (?:more|less)|"
    r"instead of|please (?:be|use|try)|format|tone|verbose|concise|rude|polite)\b", re.IGNORECASE)


def supplies_facts(correction: str) -> bool:
    """True when a correction reads as a fact (a value, name, place) rather than a behaviour request."""
    return bool(_FACT.search(correction)) and not _BEHAVIOUR.search(correction)


# --- tool-call arguments against the declared schema ---------------------------------------------


def tool_schemas(tools: JsonValue) -> dict[str, dict[str, JsonValue]]:
    """name -> JSON schema of each declared tool, in the chat (`function.parameters`), Anthropic
    (`input_schema`) or Responses (`parameters`) shape."""
    out: dict[str, dict[str, JsonValue]] = {}
    for tool in tools if isinstance(tools, list) else []:
        if not isinstance(tool, dict):
            continue
        inner = tool.get("function")
        fn = inner if isinstance(inner, dict) else tool
        name = fn.get("name")
        schema = fn.get("parameters", fn.get("input_schema"))
        if isinstance(name, str) and isinstance(schema, dict):
            out[name] = schema
    return out


def argument_violations(arguments: JsonValue, schema: Mapping[str, JsonValue]) -> list[tuple[str, str]]:
    """(argument path, problem) for each way the emitted arguments break the schema. Arguments are
    stored as the model emitted them (a JSON string); text that is not JSON is one violation."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return [("$", "arguments are not valid JSON")]
    try:
        Draft202012Validator.check_schema(dict(schema))
        validator = Draft202012Validator(dict(schema))
        errors = sorted(validator.iter_errors(arguments), key=lambda e: [str(p) for p in e.absolute_path])
    except (SchemaError, UnknownType):
        return []  # a broken declared schema is not the model's fault; nothing to check against
    out = []
    for e in errors:
        path = "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path)
        if e.validator == "required" and isinstance(e.validator_value, list):
            missing = [r for r in e.validator_value if isinstance(e.instance, dict) and r not in e.instance]
            path = f"{path}.{missing[0]}" if missing else path
        out.append((path, str(e.validator)))
    return out


# --- drift -------------------------------------------------------------------------------------------
PSI_EPSILON = 1e-4  # share given to a category one side never saw, so the index stays finite


def psi(expected: Counter[str], actual: Counter[str]) -> float:
    """Population stability index: sum over categories of (a - e) * ln(a / e), shares smoothed.
    Rule of thumb (docs/diagnosis.md): < 0.1 stable, 0.1-0.2 moderate, > 0.2 shifted."""
    e_total, a_total = sum(expected.values()), sum(actual.values())
    if not e_total or not a_total:
        return 0.0
    total = 0.0
    for key in set(expected) | set(actual):
        e = max(expected[key] / e_total, PSI_EPSILON)
        a = max(actual[key] / a_total, PSI_EPSILON)
        total += (a - e) * math.log(a / e)
    return total


def total_variation(expected: Counter[str], actual: Counter[str]) -> float:
    """Half the L1 distance between the two shares: 0 identical, 1 disjoint."""
    e_total, a_total = sum(expected.values()), sum(actual.values())
    if not e_total or not a_total:
        return 0.0
    return 0.5 * sum(abs(expected[k] / e_total - actual[k] / a_total) for k in set(expected) | set(actual))


def length_bucket(tokens: int) -> str:
    """Powers-of-two buckets of a step's total tokens: '<64', '64-127', ..."""
    if tokens < 64:
        return "<64"
    low = 1 << (int(tokens).bit_length() - 1)
    return f"{low}-{2 * low - 1}"
