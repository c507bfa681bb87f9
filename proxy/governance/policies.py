"""Tenants' governance policies as stored: the database row over the config file over the defaults."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy.orm import Session

from proxy import tables as t
from proxy.governance import TenantPolicy, load_policies
from proxy.store import ensure_tenant

_file_policies: dict[str, TenantPolicy] = {}


def configure(policy_file: Path | None, *, demo: bool = False, production: bool = False) -> None:
    """Load the operator's policy file (sections per tenant, plus [default])."""
    global _file_policies
    _file_policies = load_policies(policy_file) if policy_file else {}
    if "default" not in _file_policies:
        # Consent defaults off in production mode, on for local/demo use.
        _file_policies["default"] = TenantPolicy(training_consent=demo or not production)


def base_policy(tenant: str) -> TenantPolicy:
    if not _file_policies:
        configure(None)
    return _file_policies.get(tenant) or _file_policies["default"]


def policy_for(s: Session, tenant: str) -> TenantPolicy:
    row = s.get(t.Tenant, tenant)
    base = base_policy(tenant)
    if row is None or not row.policy:
        return base
    return TenantPolicy.from_dict({**base.to_dict(), **row.policy})


def set_policy(s: Session, tenant: str, changes: dict, *, actor: str) -> TenantPolicy:
    """Apply (validated) policy changes for a tenant and audit them."""
    ensure_tenant(s, tenant)
    row = s.get(t.Tenant, tenant, with_for_update=True)
    merged = TenantPolicy.from_dict({**policy_for(s, tenant).to_dict(), **changes})
    row.policy = {**(row.policy or {}), **changes}
    row.policy_updated_at = datetime.now(UTC)
    s.add(t.AuditEvent(actor=actor, tenant_id=tenant, action="policy.update", target=tenant, details={"changes": changes}))
    return merged
