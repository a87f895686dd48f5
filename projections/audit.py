"""`pool audit credits`: replays the credit events from the JetStream log, never the views.
What it recomputes and checks: docs/architecture.md#the-credit-audit.
"""

from __future__ import annotations

import contextlib
import gc
import re
from collections.abc import Iterator, Sequence
from typing import Any
from uuid import UUID

import msgspec
import psycopg
from eventsourcing.persistence import Notification
from eventsourcing.utils import resolve_topic

from bus.recorders import log_recorder
from bus.transcoder import EventDecoder
from domain.lease import Lease
from domain.node import Node
from domain.pool import Pool
from projections.audit_report import (
    AuditReport,
    Discrepancy,
    LeaseSpend,
    TenantCredits,
)
from projections.views import (
    DEFAULT_SCHEMA,
    Folder,
    gc_paused,
    positions,
)

# non-credit notifications held for folding on demand; past this many, all are folded
_PENDING_LIMIT = 200_000

# -- credit events, decoded straight from the stored JSON ------------------------------------
#
# The audit needs a few fields of each credit event. Decoding those with msgspec into small
# structs costs a fraction of the mapper's way (transcoder walk, topic resolution, a domain
# event object). It reads the same stored JSON, so it gives the same values; whatever it cannot
# take as is (another class version to upcast, a cipher or compressor, a field of another type)
# goes through the application's mapper as before.


class _Opened(msgspec.Struct):
    tenant_id: str
    class_version: int = 1


class _Granted(msgspec.Struct):
    amount: int
    class_version: int = 1


class _Held(msgspec.Struct):
    lease_id: str
    amount: int
    class_version: int = 1


class _Settled(msgspec.Struct):
    lease_id: str
    charged: int
    released: int
    shortfall: int
    at: float
    class_version: int = 1


class _HeldBatch(msgspec.Struct):
    holds: list[tuple[str, str, int]]  # (transfer id, lease id, amount) each
    class_version: int = 1


_Released = _Held  # HoldReleased carries what CreditsHeld carries: the lease and an amount


_CREDIT_STRUCTS: dict[str, type[msgspec.Struct]] = {
    "AccountOpened": _Opened, "CreditsGranted": _Granted, "CreditsHeld": _Held,
    "CreditsSettled": _Settled, "HoldReleased": _Released, "CreditsHeldBatch": _HeldBatch,
}


_OPENED, _GRANTED, _HELD, _SETTLED, _RELEASED, _HELD_BATCH = range(6)
_CODES = {"AccountOpened": _OPENED, "CreditsGranted": _GRANTED, "CreditsHeld": _HELD,
          "CreditsSettled": _SETTLED, "HoldReleased": _RELEASED, "CreditsHeldBatch": _HELD_BATCH}
CANONICAL_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
# a log record (bus.jetstream.LogRecord): seq, originator id text, uuid?, version, topic, state
Record = tuple[int, str, bool, int, str, bytes]


class CreditAudit:
    def __init__(self, app: Any, *, tenant: str | None = None) -> None:
        self.app = app
        # the log as the audit reads it: bulk records (bus.jetstream), or notifications made
        # into records (bus.recorders' plain path)
        self.recorder = log_recorder(app.recorder)
        self.tenant = tenant
        self.folder = Folder(app)
        self.decode_event = EventDecoder(app.mapper)
        self.report = AuditReport()
        # the part of the log read: from `start` (after a checkpoint) to `stop` (None: the
        # log's end when the run starts)
        self.start = 1
        self.stop: int | None = None
        self.holds: dict[str, dict[str, tuple[int, Any]]] = {}  # tenant → lease → hold
        self.last_node: dict[str, str] = {}
        self._snapshot: dict[str, dict[str, int]] | None = None
        # account id (text) → (its tenant's credits, that tenant's holds), or () for an
        # account of a tenant this audit leaves out; from AccountOpened
        self._accounts: dict[str, tuple[Any, ...]] = {}
        # other aggregates' records, folded only when a settlement needs the aggregate (its
        # lease, pool, node): each aggregate's fold is its own events in log order, so folding
        # later gives the same state as folding as they come, for far less work. Keyed by the
        # id's text, as is what they fold into
        self._pending: dict[str, list[Record]] = {}
        self._pending_count = 0
        self._folded: dict[str, Any] = {}
        self._ids: dict[tuple[str, str], str] = {}  # pool / node id → aggregate id (a uuid5) text
        # topic → (code, decoder, class version) for credit events; None for the others
        self._topics: dict[str, tuple[int, Any, int] | None] = {}
        mapper = app.mapper
        self._fast = not getattr(mapper, "cipher", None) and not getattr(
            mapper, "compressor", None)

    def run(self, *, view_position: int | None = None) -> AuditReport:
        with _gc_paused_and_aged():
            return self._run(view_position)

    def _run(self, view_position: int | None) -> AuditReport:
        top = self.stop if self.stop is not None else (
            self.recorder.max_notification_id() or 0)
        self.report.position = top
        self.report.view_position = view_position
        # the next page is read while this one is folded
        pages = self.recorder.read_records(self.start, top) if top >= self.start else ()
        for page in pages:
            if (view_position is not None and self._snapshot is None
                    and page[-1][0] > view_position):
                # the figures as of the view's position, then the rest of the page
                k = 0
                while page[k][0] <= view_position:
                    k += 1
                self._fold_records(page[:k])
                self._snapshot = self._figures()
                self._fold_records(page[k:])
            else:
                self._fold_records(page)
        if self._snapshot is None:
            self._snapshot = self._figures()
        from bus.jetstream.strays import strays

        self.report.strays = sorted(x for x in strays().seen if self.start <= x[0] <= top)
        return self.report

    def _fold_records(self, records: Sequence[Record]) -> None:
        """Fold a run of the log: credit events into the report as they come, the others kept
        for on-demand folding. One loop with everything it touches in locals: this runs once
        per event of the whole log."""
        topics = self._topics
        pending = self._pending
        accounts = self._accounts
        leases = self.report.leases
        fast = self._fast
        limit = _PENDING_LIMIT
        count = self._pending_count
        new = object.__new__
        for rec in records:
            seq, oid, _u, _v, topic, data = rec
            kind = topics.get(topic, UNSEEN)
            if kind is UNSEEN:
                kind = topics[topic] = self._credit_kind(topic)
            if kind is None:
                got = pending.get(oid)
                if got is None:
                    pending[oid] = [rec]
                else:
                    got.append(rec)
                count += 1
                if count > limit:
                    self._fold_all()
                    count = 0
                continue
            code, decode, version = kind
            ev: Any = None
            if fast:
                try:
                    ev = decode(data)
                except msgspec.ValidationError:
                    ev = None
                if ev is not None and ev.class_version != version:
                    ev = None  # an older version: the mapper upcasts it
            if ev is None:
                ev = _as_struct(code, self.app.mapper.to_domain_event(
                    _notification(rec, UUID(rec[1]) if rec[2] else rec[1])))
            if code == _OPENED:
                accounts[oid] = self._account(ev.tenant_id)
                continue
            acct = accounts.get(oid)
            if acct is None:
                acct = accounts[oid] = self._account("?")
            if not acct:
                continue  # another tenant's
            c, holds, tenant, seqs_append = acct
            seqs_append(seq)
            if code == _GRANTED:
                c.granted += ev.amount
                continue
            if code == _HELD_BATCH:
                self._held_batch(ev, seq, c, holds, tenant)
                continue
            lid = ev.lease_id
            spend = leases.get(lid)
            if spend is None:
                # LeaseSpend(tenant) with this event's seq, built in one step (once per lease)
                spend = leases[lid] = new(LeaseSpend)
                spend.__dict__ = {"tenant": tenant, "held": 0, "charged": 0, "released": 0,
                                  "shortfall": 0, "expected": 0, "price_list_versions": [],
                                  "seqs": [seq]}
            else:
                spend.seqs.append(seq)
            if code == _HELD:
                amount = ev.amount
                held = holds.get(lid)
                if held is None:
                    holds[lid] = (amount, seq)
                else:
                    holds[lid] = (held[0] + amount, [*seq_list(held[1]), seq])
                c.held += amount
                spend.held += amount
                continue
            held = holds.pop(lid, None)
            if held is None:
                self.report.discrepancies.append(Discrepancy(
                    "unknown_hold", tenant, "a hold", "none", [seq], lid,
                    f"{_NAMES[code]} without a hold"))
                continue
            hold = held[0]
            c.held -= hold
            if code == _RELEASED:
                amount = ev.amount
                spend.released += amount
                if amount != hold:
                    self.report.discrepancies.append(Discrepancy(
                        "release_split", tenant, hold, amount, [*seq_list(held[1]), seq], lid))
                continue
            self._pending_count = count  # folding on demand takes from what is pending
            self._settled(ev, seq, lid, c, spend, tenant, held)
            count = self._pending_count
        self._pending_count = count

    def _settled(self, ev: Any, seq: int, lid: str, c: TenantCredits, spend: LeaseSpend,
                 tenant: str, held: tuple[int, Any]) -> None:
        """A lease's hold settled (charged, released, short): the tenant's and the lease's sums,
        and what the lease's own events say it should have cost. Once per lease, so out of the
        fold's loop; it may fold pending leases (`_pending_count` says how many remain)."""
        hold = held[0]
        charged, released, shortfall = ev.charged, ev.released, ev.shortfall
        c.spent += charged
        c.shortfall += shortfall
        spend.charged += charged
        spend.released += released
        spend.shortfall += shortfall
        if charged + released != hold:
            self.report.discrepancies.append(Discrepancy(
                "settle_split", tenant, hold, charged + released,
                [*seq_list(held[1]), seq], lid, "charged + released must equal the hold"))
        if lid in self._pending or lid in self._folded:
            lease = self._fold(lid)
        elif CANONICAL_UUID.fullmatch(lid):
            lease = None  # no event of this lease so far
        else:  # another spelling of a UUID: the lease's own
            lease = self._fold(uuid_text(lid))
        why: str | tuple[Any, ...] = "no lease in the log"
        expected = 0
        if isinstance(lease, Lease):
            expected, plv, why = self._expected_charge(lease, lid, ev.at)
            spend.expected += expected
            if plv is not None:
                spend.price_list_versions.append(plv)
        if charged + shortfall != expected:
            self.report.discrepancies.append(Discrepancy(
                "charge", tenant, expected, charged + shortfall,
                [*seq_list(held[1]), seq], lid,
                why if isinstance(why, str) else _why(*why)))

    def _held_batch(self, ev: Any, seq: int, c: TenantCredits,
                    holds: dict[str, tuple[int, Any]], tenant: str) -> None:
        """A CreditsHeldBatch: each of its holds as a CreditsHeld at the same sequence. The
        lines below repeat the CreditsHeld branch of `_fold_records` on purpose: that one stays
        inline in the loop that runs once per event of the log; change both together."""
        leases = self.report.leases
        for _transfer_id, lid, amount in ev.holds:
            spend = leases.get(lid)
            if spend is None:
                spend = leases[lid] = LeaseSpend(tenant, seqs=[seq])
            elif not spend.seqs or spend.seqs[-1] != seq:
                spend.seqs.append(seq)
            held = holds.get(lid)
            if held is None:
                holds[lid] = (amount, seq)
            else:
                holds[lid] = (held[0] + amount, [*seq_list(held[1]), seq])
            c.held += amount
            spend.held += amount

    def _account(self, tenant: str) -> tuple[Any, ...]:
        """What an account's credit events fold into: its tenant's credits and holds."""
        if self.tenant is not None and tenant != self.tenant:
            return ()
        c = self.report.tenants.get(tenant)
        if c is None:
            c = self.report.tenants[tenant] = TenantCredits()
        holds = self.holds.get(tenant)
        if holds is None:
            holds = self.holds[tenant] = {}
        return c, holds, tenant, c.seqs.append

    def _credit_kind(self, topic: str) -> tuple[int, Any, int] | None:
        cls = resolve_topic(topic)
        name = cls.__name__
        struct = _CREDIT_STRUCTS.get(name)
        if struct is None or not cls.__qualname__.startswith("Account."):
            return None
        return (_CODES[name], msgspec.json.Decoder(struct).decode,
                int(getattr(cls, "class_version", 1)))

    def _fold(self, key: str) -> Any:
        """The aggregate whose id's text is `key` as the log stands at the current point of the
        replay; None if the log has none so far."""
        waiting = self._pending.pop(key, None)
        if waiting:
            self._pending_count = max(0, self._pending_count - len(waiting))
            decode, apply = self.decode_event, self.folder.apply
            agg = None
            uid = None  # one aggregate: one UUID for all its events
            for rec in waiting:
                if rec[2]:
                    if uid is None:
                        uid = UUID(rec[1])
                    oid: Any = uid
                else:
                    oid = rec[1]
                agg = apply(decode(_notification(rec, oid)))
                if isinstance(agg, Lease) and agg.node_id is not None:
                    self.last_node[key] = agg.node_id
            self._folded[key] = agg
            return agg
        return self._folded.get(key)

    def _fold_all(self) -> None:
        for oid in list(self._pending):
            self._fold(oid)
        self._pending_count = 0

    def _figures(self) -> dict[str, dict[str, int]]:
        return {t: c.figures() for t, c in self.report.tenants.items()}

    def _expected_charge(
        self, lease: Lease, lease_id: str, at: float
    ) -> tuple[int, int | None, str | tuple[Any, ...]]:
        """(expected charge, price list version, why): `why` is text, or the figures that
        _why words, for a discrepancy only (most settlements have none)."""
        pool_id = self._ids.get(("pool", lease.pool_id))
        if pool_id is None:
            pool_id = self._ids[("pool", lease.pool_id)] = str(Pool.create_id(lease.pool_id))
        pool = self._fold(pool_id)
        if not isinstance(pool, Pool):
            return 0, None, f"no pool {lease.pool_id}"
        node_id = lease.node_id or self.last_node.get(lease_id)
        model = None
        if node_id is not None:
            node_key = self._ids.get(("node", node_id))
            if node_key is None:
                node_key = self._ids[("node", node_id)] = str(Node.create_id(node_id))
            node = self._fold(node_key)
            if isinstance(node, Node):
                model = node.capabilities.gpu_model
        seconds = lease.runtime_seconds(at)
        expected = pool.charge_for(lease.shape, seconds, gpu_model=model) if seconds else 0
        end = lease.run_ended_at if lease.run_ended_at is not None else at
        return expected, pool.price_list_version, (
            pool.price_list_version, lease.started_at, end, seconds)


UNSEEN: Any = object()
_NAMES = {code: name for name, code in _CODES.items()}


def seq_list(seqs: int | list[int]) -> list[int]:
    return [seqs] if type(seqs) is int else seqs  # type: ignore[return-value]


def uuid_text(text: str) -> str:
    try:
        return str(UUID(text))
    except ValueError:
        return text


def _notification(rec: Record, oid: Any) -> Notification:
    """The Notification a frozen dataclass's __init__ makes, built in one step, with the
    originator id `oid` given (one UUID per aggregate folded, not one parse per event)."""
    n = _new(Notification)
    _setattr(n, "__dict__", {"originator_id": oid, "originator_version": rec[3],
                             "topic": rec[4], "state": rec[5], "id": rec[0]})
    return n


_new, _setattr = object.__new__, object.__setattr__


@contextlib.contextmanager
def _gc_paused_and_aged() -> Iterator[None]:
    """views.gc_paused, and at its end the fold's survivors (the report, the folded
    aggregates) put in the oldest generation without a scan: with the collector back on, the
    first allocation would otherwise start a collection of the youngest generation that walks
    every one of them (figures: docs/performance-log.md), and a later one of the middle generation
    walks them again.

    freeze() then unfreeze() moves every tracked object to the oldest generation in O(1); the
    oldest generation's full collections still walk them, as any long-lived object. Where
    the process has frozen objects of its own (a projector's state), unfreezing would hand
    those back to the collector, so the fold's objects are only frozen with them (the fold
    makes no reference cycles; frozen objects are still freed when no longer referenced)."""
    enabled = gc.isenabled()  # (a caller's own pause: its end is its business)
    with gc_paused():
        try:
            yield
        finally:
            if enabled:
                frozen = gc.get_freeze_count()
                gc.freeze()
                if not frozen:
                    gc.unfreeze()


def _as_struct(code: int, ev: Any) -> Any:
    """A domain credit event (from the mapper) as the struct the fast path decodes."""
    if code == _OPENED:
        return _Opened(tenant_id=str(ev.tenant_id))
    if code == _GRANTED:
        return _Granted(amount=int(ev.amount))
    if code == _HELD:
        return _Held(lease_id=str(ev.lease_id), amount=int(ev.amount))
    if code == _RELEASED:
        return _Released(lease_id=str(ev.lease_id), amount=int(ev.amount))
    if code == _HELD_BATCH:
        return _HeldBatch(holds=[(str(t), str(lid), int(a)) for t, lid, a in ev.holds])
    return _Settled(lease_id=str(ev.lease_id), charged=int(ev.charged),
                    released=int(ev.released), shortfall=int(ev.shortfall), at=float(ev.at))


def _why(version: int, started_at: float | None, end: float, seconds: float) -> str:
    return f"price list v{version}, started {started_at}, ended {end}, {seconds:g} s"


def audit_credits(app: Any, *, tenant: str | None = None, database_url: str | None = None,
                  schema: str = DEFAULT_SCHEMA, audit: CreditAudit | None = None) -> AuditReport:
    """Replay and check; `audit` (e.g. one that starts from a checkpoint) replaces the plain
    replay from sequence 1. A balance view behind where that audit starts is not compared."""
    audit = audit or CreditAudit(app, tenant=tenant)
    view_rows: dict[str, dict[str, int]] | None = None
    view_position = None
    if database_url:
        with psycopg.connect(database_url) as conn:
            # one snapshot for the position and the rows: under READ COMMITTED a projector
            # commit between the two reads would pair rows with an older position
            conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            pos = positions(conn, schema)
            if "balance" in pos:
                view_position = pos["balance"][0]
                view_rows = {}
                for row in conn.execute(
                    f'SELECT tenant, granted, held, spent, available, shortfall, last_seq '
                    f'FROM "{schema}".balance'
                ).fetchall():
                    view_rows[row[0]] = {"granted": row[1], "held": row[2], "spent": row[3],
                                         "available": row[4], "shortfall": row[5],
                                         "last_seq": row[6]}
    behind = view_position is not None and view_position < audit.start - 1
    if behind:
        view_position, view_rows = None, None  # its figures there are not in this audit
    report = audit.run(view_position=view_position)
    if database_url and view_rows is None and not behind:
        report.discrepancies.append(Discrepancy("view_missing", tenant or "*", "a balance view",
                                                "none", [], detail=f"schema {schema}"))
    if view_rows is not None:
        expected_rows = audit._snapshot or {}
        tenants = set(expected_rows) | set(view_rows)
        if tenant is not None:
            tenants &= {tenant}
        for t in sorted(tenants):
            exp = expected_rows.get(t)
            got = view_rows.get(t)
            seqs = [s for s in report.tenants.get(t, TenantCredits()).seqs
                    if view_position is None or s <= view_position]
            if exp is None or got is None:
                if exp is not None and not any(exp.values()):
                    continue  # an account opened with nothing moved yet
                report.discrepancies.append(Discrepancy(
                    "balance_view", t, exp, None if got is None else
                    {k: v for k, v in got.items() if k != "last_seq"}, seqs))
                continue
            for k in ("granted", "held", "spent", "available", "shortfall"):
                if int(got[k]) != exp[k]:
                    report.discrepancies.append(Discrepancy(
                        "balance_view", t, exp[k], int(got[k]), seqs, detail=f"column {k}"))
    return report
