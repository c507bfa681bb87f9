"""Cheap decisions taken before a scan. Each only skips work whose result is already known: what the
scan finds is the same with or without them (tests/unit/test_scan_gates.py)."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping

from proxy.governance.secrets import (
    _AUTH_KEY,
    _AUTH_VALUE,
    _PHONE_KEY,
    _SECRET_KEY,
    _is_reference,
    looks_secret,
)


class LiteralGate:
    """Whether any secret family's literal occurs in a text: one regex search per case instead of a
    substring test per literal (about fifty). Most texts hold none; when one does, the families are
    still checked one by one."""

    def __init__(self, gates: Mapping[str, tuple[tuple[str, ...], bool]]) -> None:
        self._raw = _alternation(lit for lits, lowered in gates.values() if not lowered for lit in lits)
        self._lowered = _alternation(lit for lits, lowered in gates.values() if lowered for lit in lits)

    def may_match(self, text: str, lowered: str) -> bool:
        return ((self._raw is not None and self._raw.search(text) is not None)
                or (self._lowered is not None and self._lowered.search(lowered) is not None))


def _alternation(literals: Iterable[str]) -> re.Pattern[str] | None:
    unique = sorted(set(literals), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, unique))) if unique else None


@functools.lru_cache(maxsize=4096)
def key_matters(key: str) -> bool:
    """Whether the JSON key a text sits under can change what its scan finds: a phone word (context
    for a digit run), an auth header or a secret's name (the value alone is then a credential). Under
    any other key a text is scanned as if it had none, so equal texts share one scan."""
    return bool(_PHONE_KEY.search(key) or _AUTH_KEY.search(key) or _SECRET_KEY.search(key))


def key_says_secret(key: str, value: str) -> bool:
    """Whether a value is a credential by the key it sits under (`{"api_key": "..."}`,
    `{"Authorization": "Bearer ..."}`), when the value alone showed nothing."""
    if _AUTH_KEY.search(key):
        m = _AUTH_VALUE.match(value)
        return bool(m) and not _is_reference(m.group("s")) and len(m.group("s")) >= 8
    if _SECRET_KEY.search(key):
        return looks_secret(value, key, quoted=True)
    return False
