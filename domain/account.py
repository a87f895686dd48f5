"""A tenant's credits: grants in, holds against leases, settlements out, in micro-credits.
Idempotent transfers and the balance rule: docs/architecture.md#pools-prices-and-credits.
"""

from __future__ import annotations

import functools
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import Any
from uuid import UUID

from eventsourcing.domain import Aggregate, event

from domain.errors import InsufficientCredits, InvalidAmount, TransferConflict, UnknownHold
from domain.fold import trigger
from domain.resources import LeaseId, TenantId
from domain.snapshots import StateSnapshot

_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "urn:computepool:account")
# the lease movements (holds, settlements, releases) whose transfer ids an account remembers:
# its latest ones, in log order; grants are remembered for good (docs/architecture.md)
TRANSFER_WINDOW = 10_000


class TransferWindow:
    """The latest lease movements' transfer ids, oldest first, at most TRANSFER_WINDOW of them.
    A copy shares the ids with its original until either records one (copy on write), so
    reading a cached account does not copy the whole window."""

    __slots__ = ("_ids", "_shared")

    def __init__(self, ids: Iterable[str] = ()) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict.fromkeys(ids)
        self._shared = False

    def copy(self) -> TransferWindow:
        other = TransferWindow.__new__(TransferWindow)
        other._ids = self._ids
        other._shared = self._shared = True
        return other

    def __copy__(self) -> TransferWindow:
        return self.copy()

    def __deepcopy__(self, memo: dict[int, Any]) -> TransferWindow:
        return self.copy()

    def add(self, transfer_id: str) -> None:
        """`transfer_id` in as the newest, the oldest out once more than TRANSFER_WINDOW."""
        if self._shared:
            self._ids = OrderedDict(self._ids)
            self._shared = False
        ids = self._ids
        ids[transfer_id] = None
        if len(ids) > TRANSFER_WINDOW:
            ids.popitem(last=False)

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self._ids

    def __iter__(self) -> Iterator[str]:
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TransferWindow):
            return NotImplemented
        return list(self._ids) == list(other._ids)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TransferWindow({list(self._ids)!r})"

    def __getstate__(self) -> list[str]:
        return list(self._ids)

    def __setstate__(self, state: list[str]) -> None:
        self._ids = OrderedDict.fromkeys(state)
        self._shared = False


class Account(Aggregate):
    """Credit ledger for one tenant; integer micro-credits throughout, never floats."""

    Snapshot = StateSnapshot
    SNAPSHOT_SCHEMA = 1

    @staticmethod
    @functools.lru_cache(maxsize=1 << 12)  # every placement and settlement asks
    def create_id(tenant_id: str) -> UUID:
        """One account per tenant, found without a lookup table."""
        return uuid.uuid5(_NAMESPACE, str(tenant_id))

    @classmethod
    def open(cls, *, tenant_id: TenantId, now: float) -> Account:
        return cls(tenant_id=str(tenant_id), opened_at=float(now))

    @event("AccountOpened")
    def __init__(self, tenant_id: str, opened_at: float) -> None:
        self.tenant_id = TenantId(tenant_id)
        self.opened_at = opened_at
        self.granted = 0
        self.held = 0
        self.spent = 0
        self.shortfall = 0  # charged usage that no hold covered (see settle)
        self.holds: dict[LeaseId, int] = {}
        self.grant_amounts: dict[str, int] = {}  # transfer id → amount, to tell retries apart
        # the latest TRANSFER_WINDOW lease movements' ids, oldest first
        self.recent_transfers = TransferWindow()

    def snapshot_state(self) -> dict[str, Any]:
        """The account as plain values (domain.snapshots): the transfer window as a list, in
        its order."""
        return {"tenant_id": str(self.tenant_id), "opened_at": self.opened_at,
                "granted": self.granted, "held": self.held, "spent": self.spent,
                "shortfall": self.shortfall, "holds": dict(self.holds),
                "grant_amounts": dict(self.grant_amounts),
                "recent_transfers": list(self.recent_transfers)}

    @staticmethod
    def restore_state(state: dict[str, Any]) -> dict[str, Any]:
        return {"tenant_id": TenantId(state["tenant_id"]), "opened_at": state["opened_at"],
                "granted": state["granted"], "held": state["held"], "spent": state["spent"],
                "shortfall": state["shortfall"],
                "holds": {LeaseId(k): v for k, v in state["holds"].items()},
                "grant_amounts": dict(state["grant_amounts"]),
                "recent_transfers": TransferWindow(state["recent_transfers"])}

    # Queries ----------------------------------------------------------------------------------

    @property
    def available(self) -> int:
        return self.granted - self.held - self.spent

    @property
    def balance(self) -> int:
        """Credits not yet spent (available plus held)."""
        return self.granted - self.spent

    def hold_for(self, lease_id: LeaseId) -> int:
        """The amount currently held for a lease (0 when none)."""
        return self.holds.get(lease_id, 0)

    def has_hold(self, lease_id: LeaseId) -> bool:
        return lease_id in self.holds

    def has_seen(self, transfer_id: str) -> bool:
        """Whether `transfer_id` is a grant of this account or one of its latest
        TRANSFER_WINDOW lease movements."""
        return transfer_id in self.grant_amounts or transfer_id in self.recent_transfers

    @property
    def transfer_ids(self) -> set[str]:
        """Every transfer id the account remembers (has_seen's)."""
        return {*self.grant_amounts, *self.recent_transfers}

    # Movements: each returns True when recorded, False for a repeated transfer id -------------

    def grant(self, transfer_id: str, amount: int, now: float, reason: str = "") -> bool:
        """Add credits (a purchase, a top-up, a refund). A transfer id seen before is a retry
        when it granted the same amount (nothing recorded), else a TransferConflict."""
        if self.has_seen(transfer_id):
            if self.grant_amounts.get(transfer_id) != amount:
                raise TransferConflict(
                    f"transfer id {transfer_id!r} was used for another movement on this account",
                    reasons=("transfer_id_reused",))
            return False
        _require_amount(amount, positive=True)
        self._granted(transfer_id=transfer_id, amount=amount, at=float(now), reason=reason)
        return True

    def hold(self, transfer_id: str, lease_id: LeaseId, amount: int, now: float) -> bool:
        """Set credits aside for a lease; a second hold for the same lease adds to it.
        Raises InsufficientCredits when `available < amount`."""
        if self.has_seen(transfer_id):
            return False
        _require_amount(amount, positive=False)
        if amount > self.available:
            raise InsufficientCredits(available=self.available, requested=amount)
        trigger(self, "_held", transfer_id=transfer_id, lease_id=str(lease_id), amount=amount,
                at=float(now))  # one per placement in a priced pool: the lean trigger
        return True

    def hold_many(self, holds: Sequence[tuple[str, LeaseId, int]], now: float) -> int:
        """Several holds as ONE event (`CreditsHeldBatch`), each taken as `hold` takes it, all or
        nothing: a transfer id seen before (or twice here) is skipped, the rest must fit what is
        available together (else InsufficientCredits, and nothing is recorded). A scheduler that
        places many of a tenant's leases in one cycle records one event for their holds, not one
        per lease. A single fresh hold is recorded as `CreditsHeld`. Returns how many holds were
        recorded."""
        fresh: list[list[Any]] = []
        seen: set[str] = set()
        total = 0
        for transfer_id, lease_id, amount in holds:
            if self.has_seen(transfer_id) or transfer_id in seen:
                continue
            _require_amount(amount, positive=False)
            seen.add(transfer_id)
            fresh.append([transfer_id, str(lease_id), amount])
            total += amount
        if not fresh:
            return 0
        if total > self.available:
            raise InsufficientCredits(available=self.available, requested=total)
        if len(fresh) == 1:
            transfer_id, lease_id, amount = fresh[0]
            self.hold(transfer_id, LeaseId(lease_id), amount, now)
            return 1
        trigger(self, "_held_batch", holds=fresh, at=float(now))
        return len(fresh)

    def settle(self, transfer_id: str, lease_id: LeaseId, amount_charged: int, now: float) -> bool:
        """Charge a lease's actual cost and release the rest of its hold, in one event.

        Clamp, don't raise: the charge is `min(amount_charged, hold)` and the uncovered part is
        recorded as `shortfall` (event field and running total) for the operator to reconcile;
        failing here would leave the hold stuck after the work was already done."""
        if self.has_seen(transfer_id):
            return False
        _require_amount(amount_charged, positive=False)
        held = self._require_hold(lease_id)
        charged = min(amount_charged, held)
        self._settled(
            transfer_id=transfer_id,
            lease_id=str(lease_id),
            charged=charged,
            released=held - charged,
            shortfall=amount_charged - charged,
            at=float(now),
        )
        return True

    def release_hold(self, transfer_id: str, lease_id: LeaseId, now: float) -> bool:
        """Return a lease's whole hold uncharged (voided reservation, cancel before running)."""
        if self.has_seen(transfer_id):
            return False
        held = self._require_hold(lease_id)
        self._hold_released(transfer_id=transfer_id, lease_id=str(lease_id), amount=held,
                            at=float(now))
        return True

    def _require_hold(self, lease_id: LeaseId) -> int:
        try:
            return self.holds[lease_id]
        except KeyError:
            raise UnknownHold(
                f"no credits are held for lease {lease_id}", reasons=(str(lease_id),)
            ) from None

    def _remember(self, transfer_id: str) -> None:
        """A lease movement's id into the window, the oldest out once it is full: a fold of the
        same events keeps the same ids, so every replica of the account agrees."""
        self.recent_transfers.add(transfer_id)

    # Events -----------------------------------------------------------------------------------

    @event("CreditsGranted")
    def _granted(self, transfer_id: str, amount: int, at: float, reason: str) -> None:
        self.grant_amounts[transfer_id] = amount
        self.granted += amount

    @event("CreditsHeld")
    def _held(self, transfer_id: str, lease_id: str, amount: int, at: float) -> None:
        self._remember(transfer_id)
        key = LeaseId(lease_id)
        self.holds[key] = self.holds.get(key, 0) + amount
        self.held += amount

    @event("CreditsHeldBatch")
    def _held_batch(self, holds: list[list[Any]], at: float) -> None:
        """`holds`: [transfer id, lease id, amount] each, applied as CreditsHeld applies one."""
        for transfer_id, lease_id, amount in holds:
            self._remember(transfer_id)
            key = LeaseId(lease_id)
            self.holds[key] = self.holds.get(key, 0) + amount
            self.held += amount

    @event("CreditsSettled")
    def _settled(
        self,
        transfer_id: str,
        lease_id: str,
        charged: int,
        released: int,
        shortfall: int,
        at: float,
    ) -> None:
        self._remember(transfer_id)
        held = self.holds.pop(LeaseId(lease_id))
        self.held -= held
        self.spent += charged
        self.shortfall += shortfall

    @event("HoldReleased")
    def _hold_released(self, transfer_id: str, lease_id: str, amount: int, at: float) -> None:
        self._remember(transfer_id)
        self.held -= self.holds.pop(LeaseId(lease_id))


def _require_amount(amount: object, *, positive: bool) -> None:
    if not isinstance(amount, int) or isinstance(amount, bool):
        raise InvalidAmount(f"amounts are integer micro-credits, got {amount!r}")
    if amount < 0 or (positive and amount == 0):
        kind = "positive" if positive else "non-negative"
        raise InvalidAmount(f"amount must be {kind}, got {amount}")
