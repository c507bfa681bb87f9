"""Day partitions of `steps` and `tool_calls`, keyed by the session's internal id (migration 0015).

Session ids are UUIDv7 (proxy.store.ids): their text starts with the millisecond the writer minted
them, so a range of ids is a range of session start times, and the text order of canonical UUIDs is
the same in the C, glibc and ICU collations (digits before letters, hyphens at the same places).
Keying by the session, not by the step's time, keeps a session's steps in one partition (a read of
one session touches one partition; the unique (session_id, seq) still means what it says) and lets
retention drop a day whole, since retention forgets whole sessions (proxy.governance.forget).

Layout per table: `<table>_legacy` for ids before partitioning began (and any id that sorts below
the first day), `<table>_pYYYYMMDD` for the sessions begun that UTC day, created `AHEAD_DAYS` in
advance, and `<table>_default` for anything else (a writer whose clock ran far ahead, or a day no
one created in time: kept and served; the next `ensure` moves such a day into a partition of its own,
a day beyond the week ahead stays and is forgotten by row like the legacy rows).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

log = logging.getLogger("atdp.store")

TABLES = ("steps", "tool_calls")
AHEAD_DAYS = 7
_LOCK = 0x61746470  # pg_advisory_xact_lock key: one creator at a time across processes
_DAY = re.compile(r"^(steps|tool_calls)_p(\d{8})$")


def day_bound(day: date) -> str:
    """The smallest canonical UUIDv7 text minted at 00:00 UTC of `day`."""
    ms = int(datetime(day.year, day.month, day.day, tzinfo=UTC).timestamp() * 1000)
    h = f"{ms:012x}"
    return f"{h[:8]}-{h[8:]}-0000-0000-000000000000"


def name_of(table: str, day: date) -> str:
    return f"{table}_p{day:%Y%m%d}"


def id_range(day: date) -> tuple[str, str]:
    """The session ids a day's partitions hold: [lo, hi)."""
    return day_bound(day), day_bound(day + timedelta(days=1))


@dataclass(frozen=True)
class DayPartition:
    day: date
    tables: tuple[str, ...]  # which of TABLES have this day's partition

    @property
    def start(self) -> datetime:
        return datetime(self.day.year, self.day.month, self.day.day, tzinfo=UTC)

    @property
    def end(self) -> datetime:
        return self.start + timedelta(days=1)


def day_partitions(s: Session) -> list[DayPartition]:
    """The day partitions that exist, oldest first (legacy and default are not day partitions)."""
    found: dict[date, list[str]] = {}
    for (name,) in s.execute(text(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "JOIN pg_class p ON p.oid = i.inhparent WHERE p.relname = ANY(:tables) AND p.relkind = 'p'"
    ), {"tables": list(TABLES)}):
        if m := _DAY.match(name):
            found.setdefault(datetime.strptime(m.group(2), "%Y%m%d").date(), []).append(m.group(1))
    return [DayPartition(d, tuple(sorted(found[d]))) for d in sorted(found)]


def is_partitioned(s: Session) -> bool:
    return bool(s.scalar(text("SELECT count(*) FROM pg_class WHERE relname = 'steps' AND relkind = 'p'")))


def ensure(s: Session, *, today: date | None = None, ahead: int = AHEAD_DAYS) -> list[str]:
    """Create the day partitions from `today` to `today + ahead` that are missing, and those of the
    days the default partition holds sessions of (no proxy ran for a week, or none could make the
    day): their rows move into the new partition (`_adopt`), so retention drops that day whole like
    any other. Returns the names created. A day that cannot be made (a lock not granted within 5 s)
    is logged and left for the next run; its sessions stay readable in the default partition."""
    if not is_partitioned(s):
        return []
    today = today or datetime.now(UTC).date()
    last = today + timedelta(days=ahead)
    s.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _LOCK})
    have = {(tbl, p.day) for p in day_partitions(s) for tbl in p.tables}
    legacy_end = _legacy_ends(s)
    stranded = {table: {d for d in _default_days(s, table) if d <= last} for table in TABLES}
    days = sorted({today + timedelta(days=i) for i in range(ahead + 1)}.union(*stranded.values()))
    created = []
    for day in days:
        lo, hi = id_range(day)
        for table in TABLES:
            if (table, day) in have or lo < legacy_end.get(table, ""):
                continue
            name = name_of(table, day)
            try:
                with s.begin_nested():
                    if day in stranded[table]:
                        moved = _adopt(s, table, day)
                        log.warning("moved %d rows of the sessions begun %s out of %s_default into %s",
                                    moved, day, table, name)
                    else:
                        s.execute(text(f'CREATE TABLE "{name}" PARTITION OF {table} '
                                       f"FOR VALUES FROM ('{lo}') TO ('{hi}')"))
                created.append(name)
            except DBAPIError as e:
                log.warning("partition %s not created (%s); its sessions stay in %s_default for now", name,
                            type(e.orig).__name__, table)
    if created:
        log.info("created partitions %s", ", ".join(created))
    return created


def _default_days(s: Session, table: str) -> set[date]:
    """The UTC days whose sessions have rows in `<table>_default` (empty in a healthy store: a cheap scan)."""
    if s.scalar(text("SELECT to_regclass(:t)"), {"t": f"{table}_default"}) is None:
        return set()
    out = set()
    for (stamp,) in s.execute(text(f"SELECT DISTINCT substr(session_id, 1, 8) || substr(session_id, 10, 4) "
                                   f'FROM "{table}_default"')):
        try:
            out.add(datetime.fromtimestamp(int(stamp, 16) / 1000, UTC).date())
        except (ValueError, OverflowError, OSError):
            continue  # not a UUIDv7 text: stays where it is
    return out


def _adopt(s: Session, table: str, day: date) -> int:
    """Make `day`'s partition of `table` from the rows the default partition holds for it: a new table
    takes them and is attached (PostgreSQL refuses to create a partition whose range the default
    holds rows of). The default partition is locked for the move (at most 5 s wait for writers)."""
    lo, hi = id_range(day)
    name = name_of(table, day)
    s.execute(text("SET LOCAL lock_timeout = '5s'"))
    s.execute(text(f'LOCK TABLE "{table}_default" IN ACCESS EXCLUSIVE MODE'))
    s.execute(text(f'CREATE TABLE "{name}" (LIKE {table} INCLUDING DEFAULTS INCLUDING CONSTRAINTS '
                   "INCLUDING STORAGE INCLUDING COMPRESSION)"))
    moved = s.execute(text(
        f'WITH moved AS (DELETE FROM "{table}_default" WHERE session_id >= :lo AND session_id < :hi RETURNING *) '
        f'INSERT INTO "{name}" SELECT * FROM moved'), {"lo": lo, "hi": hi}).rowcount
    s.execute(text(f"ALTER TABLE {table} ATTACH PARTITION \"{name}\" FOR VALUES FROM ('{lo}') TO ('{hi}')"))
    s.execute(text("SET LOCAL lock_timeout TO DEFAULT"))
    return moved


def _legacy_ends(s: Session) -> dict[str, str]:
    """table -> the upper bound of its legacy partition (the days before it are not day partitions)."""
    out = {}
    for table, bound in s.execute(text(
        "SELECT p.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
        "JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent "
        "WHERE p.relname = ANY(:tables) AND c.relname = p.relname || '_legacy'"), {"tables": list(TABLES)}):
        if m := re.search(r"TO \('([^']*)'\)", bound or ""):
            out[table] = m.group(1)
    return out


def drop(s: Session, part: DayPartition) -> None:
    """Drop a day's partitions. Waits at most 5 s for the tables' locks (a long reader keeps the
    day for the next run rather than stalling the writers queued behind the drop)."""
    s.execute(text("SET LOCAL lock_timeout = '5s'"))
    for table in part.tables:
        s.execute(text(f'DROP TABLE "{name_of(table, part.day)}"'))
    s.execute(text("SET LOCAL lock_timeout TO DEFAULT"))


_PART = re.compile(r"^(steps|tool_calls)_(p\d{8}|legacy|default)$")


def is_partition(name: str | None) -> bool:
    """A partition's table: not in the ORM's metadata, which describes the partitioned parents
    (Alembic's comparisons leave partitions out)."""
    return bool(name and _PART.match(name))


def include_object(obj, name, type_, reflected, compare_to) -> bool:
    """Alembic's `include_object` hook: partitions are not schema objects of their own."""
    return not (type_ == "table" and is_partition(name))
