"""Bulk writes with PostgreSQL's COPY, inside the caller's SQLAlchemy transaction.

The writer's hot path: one COPY per table per batch instead of SQLAlchemy compiling a many-row
INSERT (most of the writer's CPU went there and into psycopg's per-element array dumping). Arrays
are sent as their text literals, built here with `str.join` (C speed), and JSON through orjson.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import orjson
import psycopg
from psycopg.types.json import Jsonb
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session


def json_text(value: Any) -> str:
    """JSON text, for a `CAST(... AS jsonb)` or a `jsonb` parameter; None is JSON null."""
    # orjson writes NaN and infinity as null (JSONB has neither), as the old path's pg_safe did.
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()


def jsonb(value: Any) -> Jsonb:
    """A JSONB parameter; None is JSON null, as SQLAlchemy's JSONB stores it (`contents.body` is NOT NULL)."""
    return Jsonb(value, dumps=json_text)


def int_array(values: Iterable[int] | None) -> str | None:
    """An `integer[]` literal: '{1,2,3}'."""
    return None if values is None else "{" + ",".join(map(str, values)) + "}"


_REAL = "{:.9g}".format  # 9 significant digits name every float32 exactly (FLT_DECIMAL_DIG)


def real_array(values: Iterable[float]) -> str:
    """A `real[]` literal. The logprobs are float32 values (the engine's, kept as `array('f')`): 9
    significant digits read back (strtof) as the same float, in 40% fewer characters and a third of
    the time of `repr`'s 17. NaN and infinities are written nan, inf, -inf: PostgreSQL reads those."""
    return "{" + ",".join(map(_REAL, values)) + "}"


def text_array(values: Sequence[str]) -> str:
    """A `text[]` literal, every element quoted and escaped, so any text without NUL is safe."""
    return "{" + ",".join('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values) + "}"


@contextmanager
def _as_sqlalchemy_errors(statement: str) -> Iterator[None]:
    """psycopg's errors as SQLAlchemy's (DataError, IntegrityError, ...), as `Session.execute` raises
    them: the recorder splits a batch the database refuses for its content and sets the bad record
    aside, and tells that apart from a lost connection by these classes."""
    try:
        yield
    except psycopg.Error as e:
        raise DBAPIError.instance(statement, None, e, psycopg.Error) from e


def copy_rows(s: Session, table: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """COPY `rows` into `table` in the session's transaction (text format, psycopg's escaping)."""
    raw = s.connection().connection.driver_connection
    statement = f"COPY {table} ({', '.join(columns)}) FROM STDIN"
    with _as_sqlalchemy_errors(statement), raw.cursor() as cur, cur.copy(statement) as cp:
        for row in rows:
            cp.write_row(row)
