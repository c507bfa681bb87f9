"""Content addressing: one canonical form and one keyed hash for every stored piece of content.

The key is an HMAC of the *raw* content under the deployment secret, so a repeated system prompt or
history message is recognised (and redacted) once, while the stored key cannot be used to confirm a
guessed plaintext by anyone without the secret.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import orjson


def canonical(value: Any) -> bytes:
    """Canonical JSON bytes: sorted keys, no whitespace, UTF-8."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def content_hash(secret: bytes, value: Any) -> str:
    return keyed(secret, value)[0]


def keyed(secret: bytes, value: Any) -> tuple[str, int]:
    """(content hash, bytes of the canonical JSON): a row's key and its `size` from one serialisation."""
    raw = canonical(value)
    return hmac.new(secret, raw, hashlib.sha256).hexdigest(), len(raw)


def chain_hash(prev: str, item_hash: str) -> str:
    """Rolling hash of a sequence of content hashes (used to find a conversation's prefix)."""
    return hashlib.sha256(f"{prev}:{item_hash}".encode()).hexdigest()
