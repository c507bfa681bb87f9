"""`atdp forget`, `atdp retention run`, `atdp policy show|set`: governance from the command line.

They work on the database directly (audited with actor "cli"). A forget or retention run announces
what it deleted when it commits, and every proxy listening on the database lets go of it (its
caches, spool and dead letters: proxy.control.admin.ForgetFollower); dead letters are purged here in
every worker's folder. While a proxy serves, the admin API (`DELETE /atdp/v1/...`) also writes out
that proxy's queue first.
"""

from __future__ import annotations

import json
import sys
import tomllib
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sqlalchemy import Engine
    from sqlalchemy.orm import Session

    from proxy.governance.policies import Policies


def _transaction() -> tuple[Engine, AbstractContextManager[Session], Policies]:
    """The database (migrated) and the tenant policies, as the settings name them."""
    from proxy.config import load_settings
    from proxy.governance.policies import Policies
    from proxy.store import db

    settings = load_settings()
    url = db.database_url(settings)
    db.upgrade(url)
    engine = db.make_engine(url)
    return engine, db.transaction(db.session_factory(engine)), Policies.from_settings(settings)


def _print(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True, default=str))


def cmd_forget(args) -> int:
    from proxy.config import load_settings, spool_folders
    from proxy.governance import forget
    from proxy.record import deadletters

    if not args.session and not args.tenant:
        print("atdp forget needs --session ID or --tenant T", file=sys.stderr)
        return 2
    home = load_settings().home
    engine, tx, _ = _transaction()
    try:
        with tx as s:
            if args.session:
                try:
                    report = forget.forget_session(s, args.session, tenant=args.tenant, actor="cli", reason=args.reason)
                except LookupError as e:
                    print(str(e), file=sys.stderr)
                    return 2
                letters = [d for folder in spool_folders(home) for d in deadletters.purge_session(
                    folder, args.session, report.tenant if report else args.tenant)]
                if report is None and not letters:
                    print(f"no session {args.session!r}", file=sys.stderr)
                    return 1
                if report is None:  # only dead letters: as the route does, a tombstone, and every proxy told
                    forget.tombstone(s, letters[0].tenant, args.session)
                    forget.announce(s, forget.Forgotten(tenant=letters[0].tenant), sessions=[args.session])
                _print({"forgotten": "session", "session_id": args.session,
                        "tenant": report.tenant if report else letters[0].tenant,
                        **(report.counts() if report else {}), "dead_letters": len(letters)})
            else:
                report = forget.forget_tenant(s, args.tenant, actor="cli", reason=args.reason)
                letters = [d for folder in spool_folders(home)
                           for d in deadletters.purge_tenant(folder, args.tenant)]
                _print({"forgotten": "tenant", "tenant": args.tenant, **report.counts(), "dead_letters": len(letters)})
    finally:
        engine.dispose()
    return 0


def cmd_retention(args) -> int:
    from proxy.config import load_settings, spool_folders
    from proxy.governance import forget
    from proxy.record import deadletters

    settings = load_settings()
    home = settings.home
    engine, tx, policies = _transaction()
    try:
        with tx as s:
            reports = forget.run_retention(s, policy_for=policies.policy_for, actor="cli",
                                           quiet_s=settings.session_ttl_s)
            letters = [d for folder in spool_folders(home) for d in deadletters.purge_expired(
                folder, lambda tenant: policies.policy_for(s, tenant).retention_days)]
        _print({"tenants": [{"tenant": r.tenant, **r.counts()} for r in reports], "dead_letters": len(letters)})
    finally:
        engine.dispose()
    return 0


def parse_assignment(item: str) -> tuple[str, object]:
    """`key=value`; the value is read as TOML (`true`, `30`, `["a", "b"]`, `"text"`), else as a string."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ValueError(f"expected key=value, not {item!r}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    if raw in ("none", "null"):
        value = None
    return key.strip(), value


def cmd_policy(args) -> int:
    from proxy.governance.policy import PolicyError

    try:
        changes = dict(parse_assignment(x) for x in getattr(args, "assignments", None) or [])
    except ValueError as e:
        print(str(e), file=sys.stderr)
        return 2
    engine, tx, policies = _transaction()
    try:
        with tx as s:
            if args.policy_command == "show":
                policy = policies.policy_for(s, args.tenant)
            else:
                policy = policies.set_policy(s, args.tenant, changes, actor="cli")
    except PolicyError as e:  # the transaction rolled back: nothing changed, nothing audited
        print(f"invalid policy: {e}", file=sys.stderr)
        return 2
    finally:
        engine.dispose()
    _print({"tenant": args.tenant, "policy": policy.to_dict()})
    return 0


def register(sub) -> None:
    f = sub.add_parser("forget", help="delete a session's or a tenant's recorded data (audited)")
    f.add_argument("--session", help="public (or internal) session id")
    f.add_argument("--tenant", help="the tenant (with --session: the session's tenant; alone: forget it all)")
    f.add_argument("--reason", help="kept in the audit row")
    f.set_defaults(func=cmd_forget)

    r = sub.add_parser("retention", help="retention deadlines")
    rsub = r.add_subparsers(dest="retention_command", required=True)
    rsub.add_parser("run", help="forget sessions past their retention deadline now").set_defaults(func=cmd_retention)

    p = sub.add_parser("policy", help="tenant governance policy")
    psub = p.add_subparsers(dest="policy_command", required=True)
    show = psub.add_parser("show", help="print the effective policy")
    show.add_argument("--tenant", required=True)
    show.set_defaults(func=cmd_policy)
    st = psub.add_parser("set", help="change policy keys: key=value ... (audited)")
    st.add_argument("--tenant", required=True)
    st.add_argument("assignments", nargs="+", metavar="key=value")
    st.set_defaults(func=cmd_policy)
