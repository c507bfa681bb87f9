"""ATDP v1: the Agent Trajectory Data Protocol (models, JSON Schema)."""

import json
from functools import cache
from pathlib import Path

from atdp_schema.models import (
    ATDP_VERSION,
    Action,
    Document,
    Eligibility,
    Feedback,
    FeedbackSource,
    Governance,
    Message,
    ModelVersion,
    Observation,
    Session,
    SessionStatus,
    Step,
    StepStatus,
    TokenRecord,
    TokenSource,
    VersionStatus,
)
from atdp_schema.record import StepFields


@cache
def json_schema() -> dict:
    """The committed JSON Schema of an ATDP `Document`."""
    return json.loads(Path(__file__).with_name("schema.json").read_text())


__all__ = [
    "ATDP_VERSION", "Action", "Document", "Eligibility", "Feedback", "FeedbackSource", "Governance",
    "Message", "ModelVersion", "Observation", "Session", "SessionStatus", "Step", "StepFields", "StepStatus",
    "TokenRecord", "TokenSource", "VersionStatus", "json_schema",
]
