"""Bulk writes with PostgreSQL's COPY, inside the caller's SQLAlchemy transaction.

The writer's hot path: one COPY per table per batch instead of SQLAlchemy compiling a many-row
INSERT (most of the writer's CPU went there and into psycopg's per-element array dumping). Text
arrays go as binary parameters (`text_array`), other arrays as text literals built with `str.join`
(C speed), and JSON through orjson;
`steps`, whose token arrays are most of a batch, goes in binary: an `integer[]` or `real[]` of n
values is n (length, value) pairs of 4-byte words, built by slicing machine arrays (`binary_int4s`,
`binary_float4s`: a few microseconds where the text literal of a 200-id prompt took 25).
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
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


# PostgreSQL's binary array: ndim, has-nulls flag, element type; then per dimension its length and
# lower bound (1); then each element as a 4-byte length and its bytes (big-endian, network order).
_ARRAY_HEAD = struct.Struct(">iiIii")
_EMPTY_ARRAY = struct.Struct(">iiI")  # ndim 0: '{}'
INT4_OID, FLOAT4_OID, VARCHAR_OID, TEXT_OID, TEXT_ARRAY_OID = 23, 700, 1043, 25, 1009
_NULL = (-1).to_bytes(4, "big", signed=True)
_SWAP = sys.byteorder == "little"


def _binary_words(words: array, oid: int) -> bytes:
    """A one-dimensional array of 4-byte elements whose values are `words` (typecode "i")."""
    n = len(words)
    if not n:
        return _EMPTY_ARRAY.pack(0, 0, oid)
    out = array("i", bytes(8 * n))
    out[0::2] = array("i", (4,)) * n  # every element's length
    out[1::2] = words
    if _SWAP:
        out.byteswap()
    return _ARRAY_HEAD.pack(1, 0, oid, n, 1) + out.tobytes()


def refused(e: Exception) -> psycopg.DataError:
    """A value a binary column cannot hold, refused as PostgreSQL refuses it in text (the same class
    and SQLSTATE, so dead letters read the same): the recorder sets that record aside."""
    if isinstance(e, (OverflowError, struct.error)):
        return psycopg.errors.NumericValueOutOfRange(f"out of range: {e}")
    return psycopg.errors.InvalidTextRepresentation(f"not of the column's type: {e}")


def binary_int4s(values: Sequence[int]) -> bytes:
    """An `integer[]` in COPY's binary format."""
    if type(values) is not array or values.typecode != "i":
        try:
            values = array("i", values)
        except (OverflowError, TypeError) as e:
            raise refused(e) from None
    return _binary_words(values, INT4_OID)


def binary_float4s(values: Sequence[float]) -> bytes:
    """A `real[]` in COPY's binary format (float32 bits as they are: NaN and infinities included)."""
    floats = values
    if type(values) is not array or values.typecode != "f":
        try:
            floats = array("f", values)
        except (OverflowError, TypeError) as e:
            raise refused(e) from None
    return _binary_words(array("i", floats.tobytes()), FLOAT4_OID)


def binary_texts(values: Sequence[str | None], oid: int = VARCHAR_OID) -> bytes:
    """A `varchar[]` (or `text[]`) in PostgreSQL's binary format (COPY's, and a binary parameter's);
    None is NULL."""
    if not values:
        return _EMPTY_ARRAY.pack(0, 0, oid)
    parts = [_NULL if v is None else len(b := v.encode()).to_bytes(4, "big") + b for v in values]
    return _ARRAY_HEAD.pack(1, None in values, oid, len(parts), 1) + b"".join(parts)


class TextArray(tuple[str | None, ...]):
    """A `text[]` query parameter, sent in binary (`_TextArrayDumper`): each element its length and its
    UTF-8 bytes. A text literal had every element quoted and escaped here (two passes over each JSON
    body) and parsed back by the server; any text without NUL is safe either way; None is NULL."""


class _TextArrayDumper(psycopg.adapt.Dumper):
    format = psycopg.pq.Format.BINARY
    oid = TEXT_ARRAY_OID

    def dump(self, obj: TextArray) -> bytes:
        return binary_texts(obj, TEXT_OID)


psycopg.adapters.register_dumper(TextArray, _TextArrayDumper)


def text_array(values: Iterable[str | None]) -> TextArray:
    """A `text[]` parameter of `values` (for `CAST(:p AS text[])` and `= ANY(...)`)."""
    return TextArray(values)


def timestamp_array(values: Sequence[datetime]) -> str:
    """A `timestamptz[]` literal in ISO 8601 (an aware datetime keeps its offset, as psycopg sends it)."""
    return "{" + ",".join('"' + v.isoformat() + '"' for v in values) + "}"


def bool_array(values: Iterable[object]) -> str:
    """A `boolean[]` literal of the values' truth."""
    return "{" + ",".join("t" if v else "f" for v in values) + "}"


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


_COLUMN_TYPES: dict[tuple[str, tuple[str, ...]], list[int]] = {}


def _column_types(cur: psycopg.Cursor, table: str, columns: Sequence[str]) -> list[int]:
    """The columns' type oids, as the database has them (binary COPY applies no casts). Asked once per
    process, and again after a failed COPY: the tables use built-in types only, whose oids are the
    same in every database."""
    key = (table, tuple(columns))
    if key not in _COLUMN_TYPES:
        cur.execute("SELECT attname, atttypid::int FROM pg_attribute WHERE attrelid = %s::regclass "
                    "AND attnum > 0 AND NOT attisdropped", (table,))
        oid_of = dict(cur.fetchall())
        _COLUMN_TYPES[key] = [oid_of[c] for c in columns]
    return _COLUMN_TYPES[key]


_BYTEA_OID = 17


def copy_rows_binary(s: Session, table: str, columns: Sequence[str], rows: Iterable[Sequence[Any]],
                     prebuilt: frozenset[str] = frozenset()) -> None:
    """COPY `rows` into `table` in binary format. Columns in `prebuilt` hold bytes already in the
    column's binary format (`binary_int4s`, ...): sent as they are, as psycopg sends a `bytea`."""
    raw = s.connection().connection.driver_connection
    statement = f"COPY {table} ({', '.join(columns)}) FROM STDIN (FORMAT BINARY)"
    with _as_sqlalchemy_errors(statement), raw.cursor() as cur:
        types = [_BYTEA_OID if c in prebuilt else oid for c, oid in zip(columns, _column_types(cur, table, columns),
                                                                          strict=True)]
        try:
            with cur.copy(statement) as cp:
                cp.set_types(types)
                try:
                    for row in rows:
                        cp.write_row(row)
                except (TypeError, ValueError, OverflowError, struct.error) as e:
                    raise refused(e) from None
        except psycopg.Error:
            # Ask for the types again next time: a migration may have changed one under a running
            # writer, and the recorder retries a refused batch in halves.
            _COLUMN_TYPES.pop((table, tuple(columns)), None)
            raise
