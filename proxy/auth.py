"""API keys and tenants: keys are random, shown once, and stored only as a SHA-256 digest."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from proxy.store import tables as t
from proxy.store.ids import new_id
from proxy.store.write import ensure_tenant

KEY_PREFIX = "atdp-"
# What a scoped key may be limited to. `versions:write`: register (POST) model versions and nothing
# else, the trainer's key (it never needs to read traffic or change policy).
SCOPES = frozenset({"versions:write"})


@dataclass(frozen=True)
class Principal:
    """Who is calling: a tenant, through one key (None in open mode), maybe an operator."""

    tenant: str
    key_id: str | None
    is_admin: bool = False
    scopes: frozenset[str] | None = None  # a scoped key: only these actions (None: a tenant's key)

    def may(self, scope: str | None) -> bool:
        """Whether a scoped key covers `scope` (a route that names none admits no scoped key)."""
        return self.scopes is None or (scope is not None and scope in self.scopes)

    @property
    def actor(self) -> str:
        return self.key_id or f"open:{self.tenant}"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(s: Session, tenant: str, *, admin: bool = False, name: str | None = None,
               scopes: list[str] | None = None) -> tuple[str, str]:
    """Create a key for `tenant`; returns (key id, the key). The key itself is not stored.
    `scopes`: a key that may do only these (SCOPES), never an admin key."""
    if scopes is not None:
        unknown = sorted(set(scopes) - SCOPES)
        if unknown or not scopes:
            raise ValueError(f"unknown scopes {unknown}; known: {sorted(SCOPES)}")
        if admin:
            raise ValueError("a scoped key cannot be an admin key")
    ensure_tenant(s, tenant)
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    key_id = new_id()
    s.add(t.ApiKey(id=key_id, tenant_id=tenant, key_hash=hash_key(key), prefix=key[:12], is_admin=admin, name=name,
                   scopes=sorted(set(scopes)) if scopes is not None else None))
    s.add(t.AuditEvent(actor="cli", tenant_id=tenant, action="key.create", target=key_id,
                       details={"admin": admin, "prefix": key[:12], "scopes": sorted(set(scopes or []))}))
    return key_id, key


def _principal(row: t.ApiKey) -> Principal:
    return Principal(tenant=row.tenant_id, key_id=row.id, is_admin=row.is_admin,
                     scopes=frozenset(row.scopes) if row.scopes is not None else None)


def lookup_key(s: Session, key: str) -> Principal | None:
    return lookup_key_hash(s, hash_key(key))


def lookup_key_hash(s: Session, key_hash: str) -> Principal | None:
    row = s.execute(
        select(t.ApiKey).where(t.ApiKey.key_hash == key_hash, t.ApiKey.revoked_at.is_(None))
    ).scalar_one_or_none()
    return None if row is None else _principal(row)


def active_keys(s: Session) -> list[tuple[str, Principal]]:
    """Every unrevoked key as (sha256 of the key, principal): the proxy's in-memory key cache."""
    rows = s.execute(select(t.ApiKey).where(t.ApiKey.revoked_at.is_(None))).scalars().all()
    return [(r.key_hash, _principal(r)) for r in rows]


def header_map(scope: MutableMapping[str, Any]) -> dict[str, str]:
    """The request's headers as a plain dict, built once per request and kept in its ASGI scope.
    A call reads about twenty headers, most of them absent; Starlette's `Headers.get` scans the list
    and raises and catches a KeyError for each miss. The first of repeated headers wins, as there.
    ASGI servers give header names lowercased."""
    headers = scope.get("atdp.headers")
    if headers is None:
        headers = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.decode("latin-1"), value.decode("latin-1"))
        scope["atdp.headers"] = headers
    return headers


def key_from_headers(headers: Mapping[str, str]) -> str | None:
    """`Authorization: Bearer KEY` (OpenAI, newer Anthropic SDKs) or `x-api-key: KEY` (Anthropic)."""
    auth = headers.get("authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    key = headers.get("x-api-key")
    return key.strip() if key else None
