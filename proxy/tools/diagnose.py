"""`atdp diagnose`: where to fix, from the store (proxy.evolve.diagnose; docs/diagnosis.md).

    atdp diagnose                      # a readable table of ranked findings, every tenant
    atdp diagnose --tenant acme --json # the same JSON as GET /atdp/v1/diagnosis
    atdp diagnose --rules rules.toml   # thresholds from a file (default: ATDP_DIAGNOSIS_FILE)

Exit status: 0, or 2 when the rules are invalid.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

from proxy.evolve.diagnose import diagnose, render_table
from proxy.evolve.rules import RulesError, load_rules, rules_from_mapping


def cmd_diagnose(args: argparse.Namespace) -> int:
    from proxy.config import load_settings
    from proxy.store import db

    settings = load_settings()
    try:
        rules = load_rules(args.rules or settings.diagnosis_file)
        if args.window_days is not None:
            rules = rules_from_mapping({"window_days": args.window_days}, rules)
    except RulesError as e:
        print(f"atdp diagnose: {e}", file=sys.stderr)
        return 2
    engine = db.make_engine(db.database_url(settings))
    try:
        with db.session_factory(engine)() as s:
            result = diagnose(s, rules, tenant=args.tenant)
    finally:
        engine.dispose()
    if args.json:
        sys.stdout.buffer.write(orjson.dumps(result.to_dict(), option=orjson.OPT_INDENT_2) + b"\n")
        sys.stdout.buffer.flush()
    else:
        sys.stdout.write(render_table(result))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("diagnose", help="ranked findings: where to fix (harness, memory or policy)")
    p.add_argument("--tenant", help="one tenant (default: every tenant)")
    p.add_argument("--json", action="store_true", help="JSON, as GET /atdp/v1/diagnosis returns it")
    p.add_argument("--rules", type=Path, help="a TOML file of rules (default: ATDP_DIAGNOSIS_FILE)")
    p.add_argument("--window-days", type=float, help="diagnose sessions started this many days back")
    p.set_defaults(func=cmd_diagnose)
