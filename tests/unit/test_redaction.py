"""Redaction: the seeded corpus leaves no value, benign agent text is untouched, styles, allow-lists,
JSON-in-strings, the NER path, the process pool, and offline operation."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.governance.redaction import RedactionConfig, Redactor, _without_torch
from proxy.governance.redaction_pool import RedactionPool
from proxy.governance.secrets import DEFAULT_ENTITIES, SECRET_ENTITIES, _merge, looks_secret
from tests.pii_corpus import BENIGN, SEEDED, seeded_messages

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def redactor() -> Redactor:
    return Redactor(RedactionConfig(salt=b"test-salt"))


def _leaves(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v)


def test_seeded_corpus_leaves_no_seeded_value(redactor: Redactor) -> None:
    messages = seeded_messages()
    redacted, counts = redactor.redact_value(messages, "acme")
    text = "\n".join(_leaves(redacted))
    dumped = json.dumps(redacted, ensure_ascii=False)
    leaked = [(kind, v[:24]) for kind, values in SEEDED.items() for v in values if v in text or v in dumped]
    assert leaked == []
    # Every kind was found as what it is, not only swept up by a neighbour.
    assert set(SEEDED) <= set(counts), set(SEEDED) - set(counts)
    # Structure is kept: same roles, same tool call ids, arguments still JSON.
    assert [m["role"] for m in redacted] == [m["role"] for m in messages]
    args = json.loads(redacted[2]["tool_calls"][0]["function"]["arguments"])
    assert args["env"]["JWT"] == "<JWT>"
    assert redacted[3]["tool_call_id"] == "call_1"


@pytest.mark.parametrize(("kind", "value"), [(k, v) for k, vs in SEEDED.items() for v in vs])
def test_each_seeded_value_in_plain_prose(redactor: Redactor, kind: str, value: str) -> None:
    # The secret kinds that are only secret by context get theirs; the rest stand alone in a sentence.
    context = {
        "URL_CREDENTIALS": "DATABASE_URL=postgresql://app:{}@db.internal:5432/main",
        "AUTH_HEADER": "Authorization: Bearer {}",
        "HIGH_ENTROPY_SECRET": 'config = {{"db_password": "{}"}}',
        "AWS_ACCESS_KEY": "aws_secret_access_key = {}"
        if not value.startswith("AKIA")
        else "key id {} in use",
    }.get(kind, "the value is {} as discussed")
    text = "Note from ops: " + context.format(value) + ". Thanks!"
    result = redactor.redact_text(text, "acme")
    assert value not in result.text
    assert result.text.startswith("Note from ops: ") and result.text.endswith(". Thanks!")
    assert sum(result.counts.values()) >= 1


@pytest.mark.parametrize("text", BENIGN)
def test_benign_agent_text_is_not_touched(redactor: Redactor, text: str) -> None:
    result = redactor.redact_text(text, "acme")
    assert result.counts == {}, [text[s:e] for s, e, _ in result.spans]
    assert result.text == text


def test_benign_tool_ids_and_json_pass_unchanged(redactor: Redactor) -> None:
    message = {
        "role": "assistant",
        "tool_calls": [
            {
                "id": "call_0_104640775",
                "type": "function",
                "function": {"name": "read", "arguments": '{"path":"src/app.py","offset":120,"limit":4096}'},
            }
        ],
    }
    redacted, counts = redactor.redact_value(message, "acme")
    assert counts == {}
    assert redacted == message  # byte-identical: a JSON string with nothing found is not re-serialised


def test_json_strings_stay_valid_json(redactor: Redactor) -> None:
    arguments = json.dumps(
        {"to": "maria.gonzalez@fastmail.com", "body": 'say "hi"\nbye', "n": [1, 2.5, None]}
    )
    redacted, counts = redactor.redact_value({"arguments": arguments, "nested": [arguments]}, "acme")
    assert counts == {"EMAIL_ADDRESS": 2}
    for s in (redacted["arguments"], redacted["nested"][0]):
        assert json.loads(s) == {"to": "<EMAIL_ADDRESS>", "body": 'say "hi"\nbye', "n": [1, 2.5, None]}
    # Malformed JSON-looking strings are redacted as text.
    broken = '{"to": "maria.gonzalez@fastmail.com", '
    out, _ = redactor.redact_value(broken + "}x", "acme")
    assert "fastmail" not in out


def test_keys_and_values_are_redacted(redactor: Redactor) -> None:
    # A chat template renders object keys as text: an email used as a key is PII like any other.
    value = {
        "maria.gonzalez@fastmail.com": "owner",
        "contact": ["j.smith+billing@acme-corp.io", 42, True, None],
    }
    out, counts = redactor.redact_value(value, "acme")
    assert out == {"<EMAIL_ADDRESS>": "owner", "contact": ["<EMAIL_ADDRESS>", 42, True, None]}
    assert counts == {"EMAIL_ADDRESS": 2}


def test_key_context_for_dict_leaves(redactor: Redactor) -> None:
    secret = SEEDED["HIGH_ENTROPY_SECRET"][1]
    out, counts = redactor.redact_value(
        {
            "apiKey": secret,
            "Authorization": "Bearer " + secret,
            "x-api-key": "$API_KEY",
            "max_tokens": "4096",
        },
        "t",
    )
    assert out["apiKey"] == "<HIGH_ENTROPY_SECRET>"
    assert out["Authorization"] == "Bearer <AUTH_HEADER>"
    assert out["x-api-key"] == "$API_KEY"  # a reference, not a secret
    assert out["max_tokens"] == "4096"
    assert counts == {"HIGH_ENTROPY_SECRET": 1, "AUTH_HEADER": 1}


def test_spans_are_offsets_into_the_input_and_hold_no_values(redactor: Redactor) -> None:
    text = "mail maria.gonzalez@fastmail.com, card 4111 1111 1111 1111, key " + SEEDED["API_KEY"][0]
    result = redactor.redact_text(text, "acme")
    assert [(text[s:e], t) for s, e, t in result.spans] == [
        ("maria.gonzalez@fastmail.com", "EMAIL_ADDRESS"),
        ("4111 1111 1111 1111", "CREDIT_CARD"),
        (SEEDED["API_KEY"][0], "API_KEY"),
    ]
    assert result.text == "mail <EMAIL_ADDRESS>, card <CREDIT_CARD>, key <API_KEY>"
    assert all(isinstance(x, (int, str)) and len(str(x)) < 20 for span in result.spans for x in span)


def test_hash_style_is_stable_per_tenant_and_differs_across_tenants() -> None:
    r = Redactor(RedactionConfig(style="hash", salt=b"s1"))
    text = "from maria.gonzalez@fastmail.com to j.smith+billing@acme-corp.io, cc maria.gonzalez@fastmail.com"
    a = r.redact_text(text, "acme").text
    tokens = re.findall(r"<EMAIL_ADDRESS:([0-9a-f]{8})>", a)
    assert len(tokens) == 3 and tokens[0] == tokens[2] != tokens[1]
    assert r.redact_text(text, "acme").text == a
    b = r.redact_text(text, "globex").text
    assert re.findall(r"<EMAIL_ADDRESS:([0-9a-f]{8})>", b)[0] != tokens[0]
    other_salt = Redactor(RedactionConfig(style="hash", salt=b"s2")).redact_text(text, "acme").text
    assert other_salt != a
    assert "fastmail" not in a + b


def test_allow_list_and_entity_selection() -> None:
    text = "ping maria.gonzalez@fastmail.com or support@acme-corp.io, call +1 (415) 555-0132"
    allowed = Redactor(RedactionConfig(allow_list=("support@acme-corp.io",)))
    assert (
        allowed.redact_text(text, "t").text
        == "ping <EMAIL_ADDRESS> or support@acme-corp.io, call <PHONE_NUMBER>"
    )
    only_email = Redactor(RedactionConfig(entities=("EMAIL_ADDRESS",)))
    assert (
        only_email.redact_text(text, "t").text
        == "ping <EMAIL_ADDRESS> or <EMAIL_ADDRESS>, call +1 (415) 555-0132"
    )
    with pytest.raises(ValueError, match="unsupported entities"):
        Redactor(RedactionConfig(entities=("EMAIL_ADRESS",)))
    with pytest.raises(ValueError, match="style"):
        RedactionConfig(style="mask")  # type: ignore[arg-type]


def test_urls_are_opt_in(redactor: Redactor) -> None:
    text = "docs at https://docs.python.org/3/library/re.html"
    assert "URL" not in DEFAULT_ENTITIES
    assert redactor.redact_text(text, "t").text == text
    with_urls = Redactor(RedactionConfig(entities=(*DEFAULT_ENTITIES, "URL")))
    assert "docs.python.org" not in with_urls.redact_text(text, "t").text


def test_url_credentials_keep_the_host(redactor: Redactor) -> None:
    text = "postgresql://svc:Tr0ub4dor&3x@db.example.com:5432/app and redis://:r3disP4ss@cache:6379/0"
    out = redactor.redact_text(text, "t")
    assert (
        out.text
        == "postgresql://svc:<URL_CREDENTIALS>@db.example.com:5432/app and redis://:<URL_CREDENTIALS>@cache:6379/0"
    )


def test_private_key_json_escaped_and_truncated(redactor: Redactor) -> None:
    pem = SEEDED["PRIVATE_KEY"][0]
    escaped = json.dumps({"key": pem})[9:-2]  # the block as it appears inside a JSON string: literal \n
    out = redactor.redact_text("payload: " + escaped + " end", "t").text
    assert out == "payload: <PRIVATE_KEY> end"
    truncated = pem.split("-----END")[0][:200]
    out = redactor.redact_text("cat key.pem\n" + truncated, "t").text
    assert out == "cat key.pem\n<PRIVATE_KEY>"


def test_overlaps_merge_so_no_detected_character_survives() -> None:
    merged = _merge([(0, 10, "A", 0.5), (8, 20, "B", 0.9), (25, 30, "C", 0.4), (26, 28, "D", 0.4)])
    assert merged == [(0, 20, "B", 0.9), (25, 30, "C", 0.4)]
    # An email inside user:password@host belongs to the URL rule.
    assert _merge([(10, 16, "URL_CREDENTIALS", 0.95), (10, 40, "EMAIL_ADDRESS", 1.0)]) == [
        (10, 16, "URL_CREDENTIALS", 0.95)
    ]


@pytest.mark.parametrize(
    ("value", "key", "quoted", "expected"),
    [
        ("hunter2", "password", False, True),
        ("self.password", "password", False, False),
        ("correcthorse", "DB_PASSWORD", True, True),
        ("${DB_PASSWORD}", "password", True, False),
        ("********", "password", True, False),
        ("<HIGH_ENTROPY_SECRET>", "token", True, False),
        ("a8f5f167f44f4964e6c998dee827110c", "token", True, True),
        ("db-credentials", "secret", False, False),
        ("Qwen/Qwen2.5-0.5B-Instruct", "token", True, True),  # under a token key, random-looking is enough
        ("Bearer", "token", True, False),
    ],
)
def test_key_value_secret_heuristic(value: str, key: str, quoted: bool, expected: bool) -> None:
    assert looks_secret(value, key, quoted=quoted) is expected


def test_ner_model_from_a_path(tmp_path: Path) -> None:
    with _without_torch():
        import spacy

    nlp = spacy.blank("en")
    nlp.add_pipe("entity_ruler").add_patterns(
        [{"label": "PERSON", "pattern": "Ada Lovelace"}, {"label": "GPE", "pattern": "London"}]
    )
    nlp.to_disk(tmp_path / "ner")
    r = Redactor(RedactionConfig(ner_model=str(tmp_path / "ner")))
    assert {"PERSON", "LOCATION"} <= set(r.entities)
    out = r.redact_text("Ada Lovelace moved to London; mail ada@analytical.org", "t")
    assert out.text == "<PERSON> moved to <LOCATION>; mail <EMAIL_ADDRESS>"
    # A model that is not installed is not downloaded: the blank default is used instead.
    fallback = Redactor(RedactionConfig(ner_model="xx_not_installed_model"))
    assert "PERSON" not in fallback.entities
    assert fallback.redact_text("Ada Lovelace", "t").text == "Ada Lovelace"


def test_pool_matches_inline_and_keeps_order(redactor: Redactor) -> None:
    messages = seeded_messages()
    items = [(tenant, m) for tenant in ("acme", "globex") for m in messages] * 2
    expected = [redactor.redact_value(v, t) for t, v in items]
    with RedactionPool(RedactionConfig(salt=b"test-salt"), max_workers=2) as pool:
        assert pool.redact_many(items) == expected
        small = [("acme", "mail maria.gonzalez@fastmail.com")]
        assert pool.redact_many(small) == [("mail <EMAIL_ADDRESS>", {"EMAIL_ADDRESS": 1})]
        assert pool.redact_many([]) == []
        pending = pool.submit_many(items[:6])
        assert pending.result() == expected[:6]


def test_offline_and_without_torch() -> None:
    code = (
        "import socket, sys\n"
        "def boom(*a, **k): raise AssertionError('network used')\n"
        "socket.socket.connect = boom\nsocket.create_connection = boom\n"
        "from proxy.governance.redaction import Redactor\n"
        "r = Redactor()\n"
        "out = r.redact_text('mail maria.gonzalez@fastmail.com now', 't')\n"
        "assert out.counts == {'EMAIL_ADDRESS': 1}, out\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
        "import importlib.util; assert importlib.util.find_spec('json')\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "connection" not in proc.stderr.lower()
    assert proc.stdout.strip() == "ok"


def test_secret_entities_are_in_the_default_set() -> None:
    assert set(DEFAULT_ENTITIES) >= SECRET_ENTITIES
