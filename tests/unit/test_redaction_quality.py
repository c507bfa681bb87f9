"""The redaction benchmark's goals as asserts, on the committed corpus (bench/redaction_quality.py has
the full numbers): nothing detected in Claude Code's, Codex's and Hermes' real system prompts and tool
schemas; seeded values of every entity type found; code-like tool output left alone. Runs the held-out
split, smaller than the bench's, so it is fast."""

from __future__ import annotations

import pytest

from bench.redaction_quality import GOAL_FP_PER_100KB, GOAL_RECALL, measure, report
from tests.redaction_corpus import CLIENTS, SEEDED_ENTITIES


@pytest.fixture(scope="module")
def quality() -> dict:
    return report(measure("held-out", per_entity=8, lookalike_kb=60))


def test_no_detection_in_the_clients_system_prompts_and_tool_schemas(quality: dict) -> None:
    for scope in ("operator", "full"):
        assert quality["client_detections"][scope] == dict.fromkeys(CLIENTS, 0), quality["client_detection_examples"]


def test_seeded_values_of_every_entity_type_are_found(quality: dict) -> None:
    assert set(SEEDED_ENTITIES) <= {e for e, row in quality["per_entity"].items() if row["seeded"]}
    assert quality["seeded_recall"] >= GOAL_RECALL, quality["missed"]


def test_code_like_tool_output_is_left_alone(quality: dict) -> None:
    assert quality["lookalike_kb"] >= 60
    assert quality["fp_per_100kb"] <= GOAL_FP_PER_100KB, quality["lookalike_fp_examples"]
