"""Names and places by default: the pinned spaCy model, loaded offline, kept off identifiers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proxy.config import Settings
from proxy.governance.ner import DEFAULT_NER_MODEL, ner_status
from proxy.governance.redaction import RedactionConfig, Redactor
from tests.ner_corpus import negatives, positives


@pytest.fixture(scope="module")
def redactor() -> Redactor:
    return Redactor(RedactionConfig(salt=b"test"))


def test_names_and_places_are_redacted_by_default(redactor: Redactor) -> None:
    assert redactor.ner_status.available and {"PERSON", "LOCATION"} <= set(redactor.entities)
    out = redactor.redact_text("Patient John Smith, DOB 1980-03-14, moved to Berlin last year.", "t")
    assert out.text == "Patient <PERSON>, DOB 1980-03-14, moved to <LOCATION> last year."
    body, counts = redactor.redact_value({"customer": {"name": "Maria Gonzalez", "note": "call Maria Gonzalez"}}, "t")
    assert body == {"customer": {"name": "<PERSON>", "note": "call <PERSON>"}} and counts == {"PERSON": 2}


def test_identifiers_paths_and_operator_content_are_not_names(redactor: Redactor) -> None:
    for text in ("class JohnSmith(Base): pass", "john_smith = load_user(id)", "see /home/Maria/Berlin.py line 3",
                 "import os.Path as Berlin_cfg", "raise ValueError('Bad Input')", "    at com.acme.Maria.run(Maria.java:12)"):
        assert redactor.redact_text(text, "t").text == text, text
    # Operator content (system prompts, tool schemas) is scanned for secrets only.
    text = "Patient John Smith lives in Berlin."
    assert redactor.redact_text(text, "t", operator=True).text == text


def test_status_says_why_without_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().ner_model == DEFAULT_NER_MODEL == RedactionConfig().ner_model
    missing = ner_status("xx_not_installed_model")
    assert not missing.available and "not installed" in (missing.reason or "")
    assert not ner_status("").available
    # A model built for another spaCy: not loaded, and said so.
    pkg = tmp_path / "xx_future_model"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "meta.json").write_text(json.dumps({"spacy_version": ">=9.0,<9.1", "pipeline": ["ner"]}))
    monkeypatch.syspath_prepend(str(tmp_path))
    future = ner_status("xx_future_model")
    assert not future.available and "needs spaCy >=9.0,<9.1" in (future.reason or "")
    r = Redactor(RedactionConfig(ner_model="xx_future_model"))
    assert "PERSON" not in r.entities and r.ner_status == future
    assert r.redact_text("Patient John Smith", "t").text == "Patient John Smith"


def test_quality_floor_on_the_dev_split(redactor: Redactor) -> None:
    """A small regression floor on the dev split (bench/ner_quality.py reports the held-out split)."""
    false_pos = 0
    for _, text in negatives("dev", kb=20):
        found: list[tuple[str, str]] = []
        redactor.redact_value(text, "t", found=found)
        false_pos += sum(1 for _, rep in found if rep in ("<PERSON>", "<LOCATION>"))
    found_n = total = 0
    for sample in positives("dev", n=40):
        out, _ = redactor.redact_value(sample.text, "t")
        total += len(sample.labels)
        found_n += sum(1 for _, v in sample.labels if v not in out)
    assert found_n / total >= 0.7, (found_n, total)
    assert false_pos <= 25, false_pos  # per 20 KB of identifier-heavy agent text (dev: ~65 per 100 KB)
