"""The redactor's shortcuts (`proxy.governance.scan_gates`, the per-batch leaf memo, the clean-leaf
set) only skip work: on seeded PII and secrets, lookalike tool output and the real clients' operator
content, a batch gives exactly what a scan of every leaf, every secret family checked, gives."""

from __future__ import annotations

import random

import pytest

from proxy.governance.redaction import RedactionConfig, Redactor
from proxy.governance.scan_gates import LiteralGate, key_matters
from proxy.governance.secrets import _SECRET_GATES
from tests.redaction_corpus import SEEDED_ENTITIES, client_operator_content, lookalikes, seeded, seeded_value

KEYS = ("content", "text", "phone", "api_key", "Authorization", "note", "description", "mobile", "password")


def _items(seed: int) -> list[tuple[str, object, bool]]:
    """(tenant, value, operator): each text under several keys, in several items, for two tenants;
    short texts (under 64 characters, the clean-leaf set's size) as well as long ones."""
    rng = random.Random(seed)
    texts = [s.text for s in seeded(seed, per_entity=2)] + [t for _, t in lookalikes(seed, kb=8)]
    texts += [seeded_value(e, rng) for e in SEEDED_ENTITIES for _ in range(3)]
    texts += ["assistant", "function", "stop", "4155550132", "+1 415 555 0132", "hunter2hunter2", "Bearer abcdefgh12"]
    out: list[tuple[str, object, bool]] = []
    for text in texts:
        a, b = rng.sample(KEYS, 2)
        for tenant in ("t1", "t2"):
            out.append((tenant, {a: text, "native": {"role": "assistant", b: text}}, False))
            out.append((tenant, [text, {"args": f'{{"{a}": {text!r}}}'.replace("'", '"')}], False))
    for content in client_operator_content().values():
        out += [("t1", content["system"], True), ("t1", content["tools"], True)]
    return out


def _reference(config: RedactionConfig) -> Redactor:
    """A redactor without the shortcuts: every leaf scanned, every secret family's literals checked."""
    ref = Redactor(config)
    ref._leaf = ref._scan_leaf  # type: ignore[method-assign]
    ref._literal_gate.may_match = lambda text, lowered: True  # type: ignore[method-assign]
    return ref


@pytest.mark.parametrize("style", ["placeholder", "hash"])
def test_a_batch_with_the_shortcuts_finds_what_a_full_scan_finds(style: str) -> None:
    config = RedactionConfig(style=style, salt=b"s")
    fast, ref = Redactor(config), _reference(config)
    items = _items(5)
    values, operator = [(t, v) for t, v, _ in items], [op for *_, op in items]
    expected = [(*ref.redact_value(v, t, found=(found := []), operator=op), found) for t, v, op in items]
    for _ in range(2):  # the second time the clean-leaf set is warm
        got = fast.redact_many(values, with_values=True, operator=operator)
        assert got == expected
    assert sum(bool(c) for _, c, _ in expected) > len(items) / 4  # the corpus does hold findings
    # Alone (no batch memo), too.
    assert [fast.redact_value(v, t, operator=op) for t, v, op in items] == [e[:2] for e in expected]


def test_the_literal_gate_passes_every_text_a_secret_family_would_check() -> None:
    gate = LiteralGate(_SECRET_GATES)
    rng = random.Random(3)
    texts = [t for _, t in lookalikes(3, kb=20)] + [s.text for s in seeded(3, per_entity=1)]
    for literals, _ in _SECRET_GATES.values():
        for lit in literals:  # each literal alone, in other case, and inside other text
            texts += [lit, lit.upper(), lit.lower(), f"x{lit}y", f"{rng.choice(texts)} {lit} tail"]
    for text in texts:
        lowered = text.lower()
        wanted = any(any(lit in (lowered if low else text) for lit in lits) for lits, low in _SECRET_GATES.values())
        assert gate.may_match(text, lowered) == wanted, text[:80]


def test_keys_that_can_change_a_scan() -> None:
    for key in ("phone", "mobile_number", "fax", "tel", "Authorization", "x-api-key", "cookie", "api_key",
                "client_secret", "password", "accessToken"):
        assert key_matters(key), key
    for key in ("content", "text", "role", "arguments", "description", "name", "id", "path", "output"):
        assert not key_matters(key), key
