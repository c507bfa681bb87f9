"""Redaction on agent traffic: the false positives that made real agents untrainable, and the misses
(object keys, bare JSON numbers, operator content scanned for secrets only)."""

from __future__ import annotations

import json

import pytest

from proxy.governance.redaction import RedactionConfig, Redactor
from tests.pii_corpus import SEEDED


@pytest.fixture(scope="module")
def redactor() -> Redactor:
    return Redactor(RedactionConfig(salt=b"test-salt"))


# One line per false-positive class seen in agent prompts and tool output.
NOT_PII = {
    "model id with a date": "Use 'claude-haiku-4-5-20251001' for quick tasks, gpt-4o-2024-08-06 otherwise.",
    "model ids in JSON": '{"model": "claude-sonnet-4-5-20250929", "fallback": "claude-opus-4-1-20250805"}',
    "versions": "bumped presidio 2.2.366 -> v0.32.1, node v20.11.1, torch==2.13.0+cpu, 1.2.3-rc.4, 10.0.19045.4529",
    "version under a token key": "image: acme/token:2.16.3-rc.2 tokenizer_version: 0.21.1",
    "ISO dates and timestamps": "2024-06-11T10:23:45.123456+00:00 2025-10-01 12:00:01 2026/01/31 14:02 20251001 31/12/2025",
    "git date line": "Date:   Tue Jun 11 10:23:31 2019 -0700\nDate:   Mon Mar 3 01:02:47 2023 +0530",
    "git hashes": "commit 3f2a9c1b7e4d5a6b8c9d0e1f2a3b4c5d6e7f8a9b\nMerge: 4151555 0132987\nabc1234 (HEAD -> main)",
    "uuids": "session 0190a7c2-5e3b-7d41-9f2a-3c8e6b1d4f70 run 41555501-3200-4000-8000-000000000001",
    "hex digests": "sha256:4155550132a8f5f167f44f4964e6c998dee827110c4155550132a8f5f167f44f49 md5 2125551234abcdef",
    "ports": "listening on 127.0.0.1:41555, 0.0.0.0:8080->80/tcp, [::]:21708->7756/tcp, host:4155550132",
    "line numbers": "src/proxy/redaction.py:4155550 and app.js:2125551234:12, File \"/srv/x.py\", line 4155550132",
    "paths": "/home/dev/2024/4155550132/out.json ./runs/2125551234/log.txt C:\\\\builds\\\\6175550100\\\\x",
    "request ids": "request_id=req_2125551234 call_0_104640775 toolu_01A4155550132 evt_6175550100",
    "epoch timestamps": "created 1717602776 at 1717602776123 (ns 1717602776123456789) pid 4155550",
    "decimals": "loss 16.498936 ratio 0.561123720002216 took 4155550.132 ms",
    "arithmetic": "x = 0x1f3a + 672353541 - 2125551234",
    "cat -n listing": "  1201\tTIMEOUT_MS = 415555  # changed 2024-06-11\n  1202\tBUILD = 2125551234",
    "epoch ms that passes Luhn": "created_at_ms 1717602776125 1648225533012",
    "sizes and counts": "mem 1073741824 bytes, 4111111111 rows, size_bytes: 6057375422",
}


@pytest.mark.parametrize("text", NOT_PII.values(), ids=NOT_PII.keys())
def test_agent_lookalikes_are_not_pii(redactor: Redactor, text: str) -> None:
    result = redactor.redact_text(text, "t")
    assert result.counts == {}, [text[s:e] for s, e, _ in result.spans]


PHONES = {
    "international": "+1 415-555-0132",
    "E.164": "+14155550132",
    "national US": "(415) 555-0132",
    "UK": "+44 20 7946 0958",
    "with a phone word, bare digits": "call me on 4155550132",
    "with a phone word, dashes": "Tel: 415-555-0132",
}


@pytest.mark.parametrize("text", PHONES.values(), ids=PHONES.keys())
def test_phone_numbers_written_as_phone_numbers_are_found(redactor: Redactor, text: str) -> None:
    result = redactor.redact_text(f"notes: {text}, thanks", "t")
    assert result.counts == {"PHONE_NUMBER": 1}, result.text


def test_a_phone_word_on_another_line_is_not_context(redactor: Redactor) -> None:
    text = "tel +1 201-325-6888\n  \"size_bytes\": 6057375422,"
    assert redactor.redact_text(text, "t").text == "tel <PHONE_NUMBER>\n  \"size_bytes\": 6057375422,"


def test_object_keys_are_scanned_and_colliding_keys_both_kept(redactor: Redactor) -> None:
    value = {"maria.gonzalez@fastmail.com": 3, "j.smith+billing@acme-corp.io": 5, "description": "x"}
    out, counts = redactor.redact_value(value, "t")
    assert counts == {"EMAIL_ADDRESS": 2}
    assert sorted(out.values(), key=str) == [3, 5, "x"]
    assert "fastmail" not in json.dumps(out) and "acme-corp" not in json.dumps(out)


def test_bare_json_numbers_are_scanned(redactor: Redactor) -> None:
    value = {
        "card": 4111111111111111,
        "phone": 14155550132,
        "mobile_number": 4155550132,
        "items": [{"amex": 378282246310005}],
        "created": 1717602776,
        "id": 2125551234,
        "ratio": 0.5,
        "count": 12,
    }
    out, counts = redactor.redact_value(value, "t")
    assert counts == {"CREDIT_CARD": 2, "PHONE_NUMBER": 2}
    assert out["card"] == "<CREDIT_CARD>" and out["items"][0]["amex"] == "<CREDIT_CARD>"
    assert out["phone"] == "<PHONE_NUMBER>" and out["mobile_number"] == "<PHONE_NUMBER>"
    # Numbers without a reason to be PII stay numbers.
    assert (out["created"], out["id"], out["ratio"], out["count"]) == (1717602776, 2125551234, 0.5, 12)


def test_numbers_inside_a_json_tool_result_string(redactor: Redactor) -> None:
    result = json.dumps({"customer": {"phone": 14155550132, "card": 4111111111111111, "orders": 3}})
    found: list[tuple[str, str]] = []
    out, counts = redactor.redact_value({"role": "tool", "content": result}, "t", found=found)
    assert counts == {"PHONE_NUMBER": 1, "CREDIT_CARD": 1}
    assert json.loads(out["content"]) == {"customer": {"phone": "<PHONE_NUMBER>", "card": "<CREDIT_CARD>", "orders": 3}}
    # The token guard gets the raw values, as the template renders them (digits).
    assert {raw for raw, _ in found} == {"14155550132", "4111111111111111"}


def test_operator_content_is_scanned_for_secrets_only(redactor: Redactor) -> None:
    key = SEEDED["API_KEY"][0]
    system = {
        "type": "text",
        "text": f"Support: help@acme-corp.io, +1 415-555-0132. Use 'claude-haiku-4-5-20251001'. Key {key}.",
    }
    out, counts = redactor.redact_value(system, "t", operator=True)
    assert counts == {"API_KEY": 1}
    assert out["text"].endswith("Key <API_KEY>.") and "help@acme-corp.io" in out["text"]
    # The same text as user content gets the full scan.
    _, user_counts = redactor.redact_value(system, "t")
    assert user_counts == {"EMAIL_ADDRESS": 1, "PHONE_NUMBER": 1, "API_KEY": 1}
    # Secrets are found in operator content too: a token pasted into a tool description.
    tools = [{"name": "deploy", "description": f"Push with {SEEDED['GITHUB_TOKEN'][0]} (owner ops@acme-corp.io)",
              "parameters": {"properties": {"branch": {"type": "string"}}}}]
    out_tools, tool_counts = redactor.redact_value(tools, "t", operator=True)
    assert tool_counts == {"GITHUB_TOKEN": 1}
    assert "ops@acme-corp.io" in out_tools[0]["description"]


def test_redact_many_takes_operator_flags(redactor: Redactor) -> None:
    items = [("t", "mail help@acme-corp.io"), ("t", "mail help@acme-corp.io")]
    out = redactor.redact_many(items, operator=[True, False])
    assert out == [("mail help@acme-corp.io", {}), ("mail <EMAIL_ADDRESS>", {"EMAIL_ADDRESS": 1})]


def test_the_pool_passes_operator_flags_to_its_workers(redactor: Redactor) -> None:
    from proxy.governance.redaction_pool import RedactionPool

    text = "owner help@acme-corp.io " + "x" * 3000  # big enough to be sent to a worker
    items = [("t", text), ("t", text), ("t", {"a": text})]
    flags = [True, False, True]
    with RedactionPool(RedactionConfig(salt=b"test-salt"), max_workers=2, inline_chars=0) as pool:
        got = pool.redact_many(items, operator=flags)
    assert got == redactor.redact_many(items, operator=flags)
    assert [counts for _, counts in got] == [{}, {"EMAIL_ADDRESS": 1}, {}]


def _glued_number_texts(n: int, seed: int) -> list[str]:
    """Phone-shaped digit groups with letters glued on either side, extensions and phone words: the
    cases the glued-group shortcut (`secrets._free_part`) decides."""
    import random

    rng = random.Random(seed)
    numbers = ["415-555-0132", "(415) 555-0132", "+1 415 555 0132", "020 7946 0958", "+44 20 7946 0958",
               "4155550132", "2 172687", "83 74649184", "555 0132", "1 415 555", "201-325-6888", "10000399 8",
               "4155550132 7"]
    before = ["", "", " ", "id", "tel ", "call: ", "x", "+", "phone ", "abc-", "_", "v"]
    after = ["", "", " ", "bd5e", "x12", "ext 7", "ext. 12", "extension 3", "int 4", "anexo 5", "Xtn9",
             "abc", "e9f0", "a45", "i", "_x", "zz", ", thanks", "#12", "~3", "ф"]
    texts = []
    for _ in range(n):
        num = rng.choice(numbers)
        if rng.random() < 0.5:  # vary the digits, keep the shape
            num = "".join(str(rng.randrange(10)) if c.isdigit() else c for c in num)
        texts.append(f"{rng.choice(['', 'note ', 'request '])}{rng.choice(before)}{num}{rng.choice(after)}"
                     f"{rng.choice(['', ' done', '7 more', ' call 212-555-0199'])}")
    return texts


def test_the_glued_group_shortcut_finds_what_the_full_phone_scan_finds(redactor: Redactor, monkeypatch) -> None:
    """The windows handed to python-phonenumbers skip digit groups glued to letters; on 3,000 generated
    texts the recognizer finds exactly what it finds when every >= 7-digit candidate is scanned."""
    from proxy.governance import secrets

    texts = _glued_number_texts(3000, seed=7)
    phone = next(r for e, r, _ in redactor._recognizers if e == "PHONE_NUMBER")
    fast = [[(r.start, r.end) for r in phone.find(t, None)] for t in texts]
    fast_windows = [list(secrets._phone_windows(t)) for t in texts]
    monkeypatch.setattr(secrets, "_free_part", lambda text, start, cand: cand)
    full = [[(r.start, r.end) for r in phone.find(t, None)] for t in texts]
    skipped = sum(a != b for a, b in zip(fast_windows, (list(secrets._phone_windows(t)) for t in texts), strict=True))
    assert skipped > 300  # the shortcut left windows out of that many texts
    assert sum(map(len, full)) > 300  # the corpus holds phone numbers the scan finds
    assert fast == full, [(t, a, b) for t, a, b in zip(texts, fast, full, strict=True) if a != b][:5]


# The gates' plain forms (`secrets._PRESIDIO_GATES` starts each on a rare character instead): the same
# texts must open each gate, so every text a recognizer could match still reaches it.
GATES_PLAIN = {
    "EMAIL_ADDRESS": r"\w@\w",
    "CREDIT_CARD": r"\b\d{4}[ -]?\d{3,4}[ -]?\d{3,4}[ -]?\d{3,5}\b",
    "IP_ADDRESS": r"\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}|::|(?:[0-9A-Fa-f]{1,4}:){4}",
    "IBAN_CODE": r"[A-Z]{2}\d{2}[ ]?[A-Z0-9]{4}",
    "US_SSN": r"\b\d{3}[- .]?\d{2}[- .]?\d{4}\b",
    "US_ITIN": r"\b9\d{2}[- ]?[5-9]\d[- ]?\d{4}\b",
    "CRYPTO": r"(?:bc1|[13])[a-zA-HJ-NP-Z0-9]{25}",
    "MAC_ADDRESS": r"[0-9A-Fa-f]{2}[:-][0-9A-Fa-f]{2}[:-][0-9A-Fa-f]{2}|[0-9A-Fa-f]{4}\.[0-9A-Fa-f]{4}\.",
    "URL": r"[A-Za-z0-9]\.[A-Za-z]{2}",
    "UUID": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-",
    "US_DRIVER_LICENSE": r"\d{5}",
    "US_BANK_NUMBER": r"\d{8}",
    "US_PASSPORT": r"\d{8}",
    "UK_NHS": r"\d{3}[ -]?\d{3}[ -]?\d{4}",
    "MEDICAL_LICENSE": r"[A-Za-z]{2}\d{7}",
    "DATE_TIME": r"\d",
}


def _gate_texts(n: int, seed: int) -> list[str]:
    """Short texts: random strings of the characters the gates turn on (digits, hex letters, capitals,
    the separators, `@`, a letter and a digit that are not ASCII), runs of one kind of character, the
    gates' own shapes with a character changed, and the seeded PII values, each with glue on either side."""
    import random

    rng = random.Random(seed)
    alphabet = "0123456789" * 4 + "abcdefABCDEF" * 2 + "XYZbcq" + "..::--  @_9" + "é٣\n"
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(n)]

    def group() -> str:  # a run of one kind: digits, hex, capitals, or a separator
        kind = rng.randrange(5)
        if kind == 0:
            return "".join(rng.choice("0123456789٣") for _ in range(rng.randint(1, 5)))
        if kind == 1:
            return "".join(rng.choice("0123456789abcdefABCDEF") for _ in range(rng.randint(1, 4)))
        if kind == 2:
            return "".join(rng.choice("ABCXYZ") for _ in range(rng.randint(1, 3)))
        if kind == 3:
            return rng.choice([" ", "-", ".", ":", "::", "@", "_", "é", "\n"])
        return rng.choice(["bc1", "1", "3", "9", "a", "x"])

    texts += ["".join(group() for _ in range(rng.randint(1, 12))) for _ in range(n)]
    # The gates' own shapes (d digit, h hex, A capital, w letter), some characters changed, glued to
    # whatever comes first or last.
    shapes = ["ddd-dd-dddd", "9dd-7d-dddd", "9dd 5d dddd", "dddd dddd dddd dddd", "dddd-ddd-dddd-ddd",
              "d.d.d.d", "ddd.dd.ddd.d", "hh:hh:hh:hh:", "hh-hh-hh", "hhhh.hhhh.", "AAdd AAAA", "AAddAdAd",
              "w@w", "hhhhhhhh-hhhh-", "AAddddddd", "bc1hhhhhhhhhhhhhhhhhhhhhhhhhh", "ddddddddd"]
    fill = {"d": "0123456789", "h": "0123456789abcdefABCDEF", "A": "ABCDEFXYZ", "w": "abcxyz_é"}
    glue = ["", "", " ", "a", "7", "_", "é", "٣", ".", ":", "-"]
    for _ in range(n):
        body = "".join(rng.choice(fill[c]) if c in fill else c for c in rng.choice(shapes))
        if rng.random() < 0.3:
            i = rng.randrange(len(body))
            body = body[:i] + rng.choice("0a-.: A٣") + body[i + 1 :]
        texts.append(rng.choice(glue) + body + rng.choice(glue))
    values = [v for vs in SEEDED.values() for v in vs]
    texts += [f"{rng.choice(['', 'a', '1', ' ', '_', '.'])}{v}{rng.choice(['', 'a', '1', ' ', '-', ':'])}"
              for v in values for _ in range(3)]
    return texts


def test_each_gate_opens_on_the_same_texts_as_its_plain_form() -> None:
    import re

    from proxy.governance.secrets import _PRESIDIO_GATES

    assert set(GATES_PLAIN) == set(_PRESIDIO_GATES)
    texts = _gate_texts(40_000, seed=3)
    for entity, plain in GATES_PLAIN.items():
        if entity == "CRYPTO":
            continue  # narrower than its plain form: the next test
        plain_re, gate = re.compile(plain), _PRESIDIO_GATES[entity]
        opened = [t for t in texts if plain_re.search(t)]
        assert 50 < len(opened) < len(texts), entity  # both outcomes occur: the comparison means something
        differ = [t for t in texts if (plain_re.search(t) is None) != (gate.search(t) is None)]
        assert not differ, (entity, differ[:5])


def test_key_value_secrets_are_tried_where_a_key_word_can_start_and_found_as_before() -> None:
    """`kv_matches` tries `_KV_SECRET` only near a key word's root; on generated key-value text it
    yields exactly `finditer`'s matches (spans and groups), non-ASCII text included."""
    import random

    from proxy.governance.secrets import _KV_LEAD, _KV_ROOTS, _KV_SECRET, kv_matches

    words = ["password", "passwd", "passphrase", "pwd", "pass", "secret", "token", "apikey", "credential",
             "credentials", "api_key", "api-key", "access_key", "accesskey", "secret_key", "private-key",
             "client_secret", "clientsecret", "auth_token", "session_key", "signing_key", "encryption_key",
             "encryptionkey", "master-key", "PASSWORD", "ApiKey", "Db_Password", "max_tokens", "bypass", "keys"]
    # Every key word the pattern admits holds a root no further in than _KV_LEAD.
    assert all(min(w.lower().find(r) for r in _KV_ROOTS if r in w.lower()) <= _KV_LEAD
               for w in words if _KV_SECRET.match(w + "=abcdefgh"))
    rng = random.Random(11)
    seps = ["=", ": ", " = ", "\":\"", "' => '", ":=", " :", "=\"", "\t=\t", " "]
    values = ["hunter2hunter2", "\"s3cr3t-value!\"", "'ab cd ef gh'", "x", "Zq8#kLm2$vN5", "${VAR}", "abc.", "ſecret"]
    fillers = ["", " ", "\n", "{\"", "DB_", "my", "X", "é", ", ", "ſ", "(", "Ka"]
    texts = []
    for _ in range(20_000):
        parts = [rng.choice(fillers) + rng.choice(words) + rng.choice(seps) + rng.choice(values)
                 for _ in range(rng.randint(1, 4))]
        texts.append(rng.choice(fillers).join(parts))
    found = 0
    for t in texts:
        plain = [(m.span(), m.groupdict()) for m in _KV_SECRET.finditer(t)]
        fast = [(m.span(), m.groupdict()) for m in kv_matches(t, t.lower())]
        assert fast == plain, t
        found += len(plain)
    assert found > 10_000


def _base58check(payload: bytes) -> str:
    import hashlib

    raw = payload + hashlib.sha256(hashlib.sha256(payload).digest()).digest()[:4]
    alphabet = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
    n, out = int.from_bytes(raw, "big"), ""
    while n:
        n, r = divmod(n, 58)
        out = alphabet[r] + out
    return "1" * (len(raw) - len(raw.lstrip(b"\0"))) + out


def test_the_crypto_gate_opens_wherever_presidio_finds_an_address() -> None:
    """The CRYPTO gate asks for 25 base58 characters after a 1 or 3 (Presidio's checksum refuses any
    other): every text in which Presidio's recognizer finds a valid address opens it, and most hex ids
    that opened its plain form no longer do."""
    import random
    import re

    from presidio_analyzer.predefined_recognizers import CryptoRecognizer

    from proxy.governance.secrets import _PRESIDIO_GATES

    rng, recognizer, gate = random.Random(5), CryptoRecognizer(), _PRESIDIO_GATES["CRYPTO"]
    glue = ["", " ", "x", "1", "3", "0", "l", "é", "-", "bc1", "f0a9", "wallet "]
    texts = []
    for _ in range(1500):
        address = _base58check(bytes([rng.choice((0, 5))]) + rng.randbytes(20))
        texts.append(rng.choice(glue) + address + rng.choice(glue))
        texts.append(rng.choice(glue) + rng.randbytes(16).hex() + rng.choice(glue) + rng.randbytes(16).hex())
    texts += ["bc1qar0srrr7xfkvy5l643lydnw9re59gtzzwf5mdq", "send to bc1qw508d6qejxtdg4y5r3zarvary0c5xw7kv8f3t4 now"]
    found = [t for t in texts if recognizer.analyze(t, ["CRYPTO"], None)]
    assert len(found) > 300  # glue that joins the run (a letter or digit after it) hides the rest from Presidio too
    assert all(gate.search(t) for t in found), [t for t in found if not gate.search(t)][:5]
    plain = re.compile(GATES_PLAIN["CRYPTO"])
    hexes = [rng.randbytes(16).hex() for _ in range(2000)]
    assert sum(bool(gate.search(h)) for h in hexes) < sum(bool(plain.search(h)) for h in hexes) / 3
