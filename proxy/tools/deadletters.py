"""`atdp deadletters list|replay|purge`: the step records the database refused, made visible.

They live in the spool's `rejected/` folder under `ATDP_HOME`, one per worker of `atdp serve --workers
N` (`spool/worker-K/rejected/`); every command covers them all (`proxy.record.deadletters`). `list`
prints one JSON object per dead letter (ids, status, reason; never content), `replay` writes them to
the database again (after the cause is fixed) and removes those that went in, `purge` deletes them.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime, timedelta
from typing import Any


def _spool_dirs():
    from proxy.config import load_settings, spool_folders

    return spool_folders(load_settings().home)


def _selected(args: argparse.Namespace):
    """The dead letters the filters (--tenant, --session, --step, --older-than-days) select."""
    from proxy.record import deadletters

    cutoff = datetime.now(UTC) - timedelta(days=args.older_than_days) if args.older_than_days is not None else None

    def match(d: deadletters.DeadLetter) -> bool:
        return ((args.tenant is None or d.tenant == args.tenant)
                and (args.session is None or d.session == args.session)
                and (args.step is None or d.step_id == args.step)
                and (cutoff is None or (d.started_at is not None and d.started_at < cutoff)))

    return match


def cmd_list(args: argparse.Namespace) -> int:
    from proxy.record import deadletters

    match = _selected(args)
    for d in (d for spool_dir in _spool_dirs() for d in deadletters.read(spool_dir)):
        if match(d):
            print(json.dumps(d.summary(), sort_keys=True))
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from proxy.config import load_settings
    from proxy.record import deadletters
    from proxy.store import db
    from proxy.store.ids import new_id
    from proxy.store.records import StepRecord
    from proxy.store.write import write_steps

    settings = load_settings()
    match = _selected(args)
    chosen = {spool_dir: [d for d in deadletters.read(spool_dir) if match(d)] for spool_dir in _spool_dirs()}
    url = db.database_url(settings)
    db.upgrade(url)
    engine = db.make_engine(url)
    factory = db.session_factory(engine)

    def write(record: dict[str, Any]) -> None:
        with factory() as s, s.begin():
            write_steps(s, [StepRecord.from_json(record)], new_id)

    written: list[str] = []
    failed: list[tuple[str, str]] = []
    try:
        for spool_dir, letters in chosen.items():
            result = deadletters.replay(spool_dir, write, letters)
            written += result.written
            failed += result.failed
    finally:
        engine.dispose()
    print(json.dumps({"written": written, "failed": [{"step_id": i, "error": e} for i, e in failed]}, sort_keys=True))
    return 1 if failed else 0


def cmd_purge(args: argparse.Namespace) -> int:
    from proxy.record import deadletters

    if not args.all and args.tenant is None and args.session is None and args.step is None \
            and args.older_than_days is None:
        print("atdp deadletters purge needs --all or a filter (--tenant, --session, --step, --older-than-days)",
              file=sys.stderr)
        return 2
    gone = [d for spool_dir in _spool_dirs() for d in deadletters.purge(spool_dir, _selected(args))]
    print(json.dumps({"purged": len(gone), "step_ids": [d.step_id for d in gone]}, sort_keys=True))
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("deadletters", help="step records the database refused (the spool's rejected/ folder)")
    psub = p.add_subparsers(dest="deadletters_command", required=True)
    for name, func, text in (("list", cmd_list, "print them (ids, status, reason; no content)"),
                             ("replay", cmd_replay, "write them to the database again; remove those written"),
                             ("purge", cmd_purge, "delete them")):
        c = psub.add_parser(name, help=text)
        c.add_argument("--tenant")
        c.add_argument("--session", help="public session id")
        c.add_argument("--step", help="step id")
        c.add_argument("--older-than-days", type=float, dest="older_than_days")
        if name == "purge":
            c.add_argument("--all", action="store_true", help="every dead letter")
        c.set_defaults(func=func)
