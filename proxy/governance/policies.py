"""Tenants' governance policies as they apply: the database row over the operator's file over the
defaults. One `Policies` per process, built from its settings and passed down (no module state), so
the proxy, its writer, the trainer and the CLI all read `ATDP_POLICY_FILE` and `ATDP_PRODUCTION`."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import orjson
from sqlalchemy import select
from sqlalchemy.orm import Session

from proxy.config import Settings
from proxy.governance.policy import TenantPolicy, load_policies
from proxy.store import tables as t
from proxy.store.notes import NOTIFY
from proxy.store.write import ensure_tenant


class Policies:
    def __init__(self, file_policies: dict[str, TenantPolicy] | None = None, *, production: bool = False,
                 demo: bool = False) -> None:
        self._file = dict(file_policies or {})
        if "default" not in self._file:
            # Consent defaults off in production mode, on for local/demo use.
            self._file["default"] = TenantPolicy(training_consent=demo or not production)

    @classmethod
    def load(cls, policy_file: Path | None, *, production: bool = False, demo: bool = False) -> Policies:
        """The operator's policy file (sections per tenant, plus [default]); none: the defaults."""
        return cls(load_policies(policy_file) if policy_file else None, production=production, demo=demo)

    @classmethod
    def from_settings(cls, settings: Settings) -> Policies:
        return cls.load(settings.policy_file, production=settings.production)

    def base(self, tenant: str) -> TenantPolicy:
        """The file's (or default) policy of a tenant, without the database's changes."""
        return self._file.get(tenant) or self._file["default"]

    def policy_for(self, s: Session, tenant: str) -> TenantPolicy:
        row = s.get(t.Tenant, tenant)
        base = self.base(tenant)
        if row is None or not row.policy:
            return base
        return TenantPolicy.from_dict({**base.to_dict(), **row.policy})

    def holdout_shares(self, s: Session) -> tuple[dict[str, float], float]:
        """({tenant: eval_holdout} for tenants with their own policy, the default share)."""
        tenants = set(self._file) - {"default"}
        tenants |= set(s.scalars(select(t.Tenant.id).where(t.Tenant.policy_updated_at.is_not(None))))
        return {x: self.policy_for(s, x).eval_holdout for x in sorted(tenants)}, self._file["default"].eval_holdout

    def set_policy(self, s: Session, tenant: str, changes: dict, *, actor: str) -> TenantPolicy:
        """Apply (validated) policy changes for a tenant and audit them."""
        ensure_tenant(s, tenant)
        row = s.get(t.Tenant, tenant, with_for_update=True)
        merged = TenantPolicy.from_dict({**self.policy_for(s, tenant).to_dict(), **changes})
        row.policy = {**(row.policy or {}), **changes}
        row.policy_updated_at = datetime.now(UTC)
        s.add(t.AuditEvent(actor=actor, tenant_id=tenant, action="policy.update", target=tenant,
                           details={"changes": changes}))
        # Every proxy's writer caches a tenant's policy for 10 s: told at commit, each reads it again now.
        s.execute(NOTIFY, {"payload": orjson.dumps({"op": "policy", "from": "", "tenant": tenant}).decode()})
        return merged
