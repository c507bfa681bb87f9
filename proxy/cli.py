"""The `atdp` command line: one explicit table of commands (torch, uvicorn and Presidio load inside them)."""

from __future__ import annotations

import argparse
import logging
import sys

from proxy import logs
from proxy.demo import run as demo
from proxy.tools import deadletters, diagnose, export, governance, replay, serve, versions
from trainer import main as train


def _settings():
    from proxy.config import load_settings

    return load_settings()


def _url(settings) -> str:
    from proxy.store.db import database_url

    return database_url(settings)


def cmd_db(args) -> int:
    from proxy.store import db

    url = _url(_settings())
    if args.action == "upgrade":
        db.upgrade(url, args.revision or "head")
        print(f"database at {db.current(url)}")
    elif args.action == "downgrade":
        if not args.revision:
            print("atdp db downgrade needs a revision (e.g. base)", file=sys.stderr)
            return 2
        db.downgrade(url, args.revision)
        print(f"database at {db.current(url)}")
    else:
        print(db.current(url) or "empty (no migration applied)")
    return 0


def cmd_keys(args) -> int:
    from proxy.auth import create_key
    from proxy.store import db

    url = _url(_settings())
    db.upgrade(url)
    engine = db.make_engine(url)
    try:
        with db.transaction(db.session_factory(engine)) as s:
            key_id, key = create_key(s, args.tenant, admin=args.admin, name=args.name, scopes=args.scope)
    except ValueError as e:
        print(f"atdp keys create: {e}", file=sys.stderr)
        return 2
    finally:
        engine.dispose()
    print(key)
    kind = " (admin)" if args.admin else f" (scoped: {', '.join(args.scope)})" if args.scope else ""
    print(f"key id {key_id} for tenant {args.tenant}{kind}; the key is shown once and stored hashed", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="atdp", description="Agent Trajectory Data Protocol: proxy, store and trainer.")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("db", help="database migrations")
    d.add_argument("action", choices=["upgrade", "downgrade", "current"])
    d.add_argument("revision", nargs="?")
    d.set_defaults(func=cmd_db)

    k = sub.add_parser("keys", help="API keys")
    ksub = k.add_subparsers(dest="keys_command", required=True)
    kc = ksub.add_parser("create", help="print a new API key (stored hashed)")
    kc.add_argument("--tenant", required=True)
    kc.add_argument("--admin", action="store_true", help="an operator key (control routes, all tenants)")
    kc.add_argument("--name")
    kc.add_argument("--scope", action="append", choices=["versions:write"],
                    help="a key that may do only this (repeatable); versions:write: the trainer's key, "
                         "registers versions and nothing else")
    kc.set_defaults(func=cmd_keys)

    # Every command, explicitly imported above: a module that fails to import fails the CLI loudly.
    # Heavy dependencies (torch, uvicorn, the demo's processes) are imported inside each command.
    for register in (serve.register, export.register, replay.register, governance.register, diagnose.register,
                     deadletters.register, versions.register, train.register, demo.register):
        register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logs.configure(logging.DEBUG if args.verbose else logging.INFO)
    return args.func(args) or 0


if __name__ == "__main__":
    raise SystemExit(main())
