"""`atdp versions show NAME [--json]`: a version's card (docs/control-plane.md), read from the database.

The same card as `GET /atdp/v1/versions/{id}/card` (both read the view `atdp_version_cards`), as
Markdown by default.
"""

from __future__ import annotations

import json
import sys


def register(sub) -> None:
    p = sub.add_parser("versions", help="model versions: cards")
    vsub = p.add_subparsers(dest="versions_command", required=True)
    show = vsub.add_parser("show", help="a version's card: what changed, why, gates, affected, rollback")
    show.add_argument("name", help="the version's name or id")
    show.add_argument("--json", action="store_true", help="the card as JSON instead of Markdown")
    show.set_defaults(func=cmd_show)


def cmd_show(args) -> int:
    from proxy.config import load_settings
    from proxy.store import db
    from proxy.store.cards import card_markdown, version_card

    url = db.database_url(load_settings())
    db.upgrade(url)
    engine = db.make_engine(url)
    try:
        with db.session_factory(engine)() as s:
            card = version_card(s, args.name)
    finally:
        engine.dispose()
    if card is None:
        print(f"atdp versions show: version {args.name!r} not found", file=sys.stderr)
        return 1
    print(json.dumps(card, indent=2, default=str) if args.json else card_markdown(card), end="" if not args.json else "\n")
    return 0
