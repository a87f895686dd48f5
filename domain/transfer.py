"""A credit grant's transfer id, claimed once across every account, so a reuse of it for another
tenant or amount is told from a retry."""

from __future__ import annotations

import uuid
from uuid import UUID

from eventsourcing.domain import Aggregate, event

from domain.errors import TransferConflict

_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "urn:computepool:transfer")


class CreditTransfer(Aggregate):
    """One grant's transfer id: which tenant it credited and how much."""

    @staticmethod
    def create_id(transfer_id: str) -> UUID:
        return uuid.uuid5(_NAMESPACE, str(transfer_id))

    @classmethod
    def claim(cls, *, transfer_id: str, tenant_id: str, amount: int, now: float) -> CreditTransfer:
        return cls(transfer_id=transfer_id, tenant_id=tenant_id, amount=amount, at=float(now))

    @event("TransferClaimed")
    def __init__(self, transfer_id: str, tenant_id: str, amount: int, at: float) -> None:
        self.transfer_id = transfer_id
        self.tenant_id = tenant_id
        self.amount = amount

    def check(self, tenant_id: str, amount: int) -> None:
        """Nothing when (tenant, amount) repeats the claim; else TransferConflict naming what
        differs."""
        reasons = [name for name, same in (("tenant", tenant_id == self.tenant_id),
                                           ("amount", amount == self.amount)) if not same]
        if reasons:
            raise TransferConflict(
                f"transfer id {self.transfer_id!r} was used for another grant "
                f"({', '.join(reasons)} differ)", reasons=reasons)
