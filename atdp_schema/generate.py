"""Write `schema.json` from the pydantic models: `python -m atdp_schema.generate [--check]`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from atdp_schema.models import ATDP_VERSION, Document

SCHEMA_PATH = Path(__file__).with_name("schema.json")


def render() -> str:
    schema = Document.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = f"https://atdp.dev/schema/{ATDP_VERSION}/document.json"
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if "--check" in argv:
        if SCHEMA_PATH.read_text() != text:
            print("atdp_schema/schema.json is stale: run python -m atdp_schema.generate", file=sys.stderr)
            return 1
        return 0
    SCHEMA_PATH.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
