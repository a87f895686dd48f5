"""`pool audit credits`: replays the credit events from the JetStream log, never the views.

From the first event it recomputes every tenant's granted / held / spent / shortfall from the
events' own fields, follows each lease's holds and settlements (with the stream sequence of
every event behind them), and checks each settlement's charge against what the lease's
recorded run (started_at → run end, or the settlement's time) costs at the price list in
force in the pool at that point of the log (Pool.charge_for: per started second, rounded up).
Then it cross-checks the balance view, as of the view's own tracked position.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any
from uuid import UUID

import msgspec
import psycopg
from eventsourcing.utils import resolve_topic

from domain.lease import Lease
from domain.node import Node
from domain.pool import Pool
from projections.views import DEFAULT_SCHEMA, Folder, gc_paused, positions, read_pages

BATCH = 1000
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


_Released = _Held  # HoldReleased carries what CreditsHeld carries: the lease and an amount


_CREDIT_STRUCTS: dict[str, type[msgspec.Struct]] = {
    "AccountOpened": _Opened, "CreditsGranted": _Granted, "CreditsHeld": _Held,
    "CreditsSettled": _Settled, "HoldReleased": _Released,
}


@dataclass
class Discrepancy:
    kind: str  # charge | settle_split | unknown_hold | balance_view | view_missing
    tenant: str
    expected: Any
    found: Any
    seqs: list[int]
    lease_id: str | None = None
    detail: str = ""

    def line(self) -> str:
        where = f"tenant {self.tenant}" + (f" lease {self.lease_id}" if self.lease_id else "")
        extra = f"; {self.detail}" if self.detail else ""
        return (f"DISCREPANCY {self.kind}: {where}: expected {self.expected}, found "
                f"{self.found} (events {_seqs(self.seqs)}{extra})")


@dataclass
class TenantCredits:
    granted: int = 0
    held: int = 0
    spent: int = 0
    shortfall: int = 0
    seqs: list[int] = field(default_factory=list)

    @property
    def available(self) -> int:
        return self.granted - self.held - self.spent

    def figures(self) -> dict[str, int]:
        return {"granted": self.granted, "held": self.held, "spent": self.spent,
                "available": self.available, "shortfall": self.shortfall}


@dataclass
class LeaseSpend:
    tenant: str
    held: int = 0
    charged: int = 0
    released: int = 0
    shortfall: int = 0
    expected: int = 0
    price_list_versions: list[int] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)


@dataclass
class AuditReport:
    position: int = 0
    view_position: int | None = None
    tenants: dict[str, TenantCredits] = field(default_factory=dict)
    leases: dict[str, LeaseSpend] = field(default_factory=dict)
    discrepancies: list[Discrepancy] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.discrepancies

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "position": self.position,
            "view_position": self.view_position,
            "tenants": {t: {**c.figures(), "seqs": c.seqs} for t, c in self.tenants.items()},
            "leases": {lid: asdict(s) for lid, s in self.leases.items()},
            "discrepancies": [asdict(d) for d in self.discrepancies],
        }

    def lines(self) -> list[str]:
        out = [f"log position {self.position}"
               + ("" if self.view_position is None else f", balance view at {self.view_position}")]
        for t, c in sorted(self.tenants.items()):
            f = c.figures()
            out.append(f"tenant {t}: " + " ".join(f"{k} {v}" for k, v in f.items()))
        for lid, s in sorted(self.leases.items(), key=lambda kv: (kv[1].tenant, kv[0])):
            out.append(f"  lease {lid} ({s.tenant}): held {s.held} charged {s.charged} "
                       f"released {s.released} shortfall {s.shortfall} expected {s.expected} "
                       f"price lists {','.join(map(str, s.price_list_versions)) or '-'} "
                       f"events {_seqs(s.seqs)}")
        out += [d.line() for d in self.discrepancies]
        out.append("audit ok" if self.ok else f"audit FAILED: {len(self.discrepancies)} "
                   "discrepancies")
        return out


def _seqs(seqs: list[int]) -> str:
    if len(seqs) <= 24:
        return ",".join(map(str, seqs)) or "-"
    return ",".join(map(str, seqs[:10])) + f",…({len(seqs) - 20} more)…," + ",".join(
        map(str, seqs[-10:]))


class CreditAudit:
    def __init__(self, app: Any, *, tenant: str | None = None) -> None:
        self.app = app
        self.tenant = tenant
        self.folder = Folder(app)
        self.report = AuditReport()
        self.holds: dict[str, dict[str, tuple[int, list[int]]]] = {}  # tenant → lease → hold
        self.last_node: dict[str, str] = {}
        self._snapshot: dict[str, dict[str, int]] | None = None
        self._accounts: dict[UUID, str] = {}  # account id → tenant, from AccountOpened
        # other aggregates' notifications, folded only when a settlement needs the aggregate
        # (its lease, pool, node): each aggregate's fold is its own events in log order, so
        # folding later gives the same state as folding as they come, for far less work
        self._pending: dict[UUID | str, list[Any]] = {}
        self._pending_count = 0
        self._ids: dict[tuple[str, str], UUID] = {}  # pool / node id → aggregate id (a uuid5)
        # topic → (event name, decoder, class version) for credit events; None for the others
        self._topics: dict[str, tuple[str, msgspec.json.Decoder[Any], int] | None] = {}
        mapper = app.mapper
        self._fast = not getattr(mapper, "cipher", None) and not getattr(
            mapper, "compressor", None)

    def run(self, *, view_position: int | None = None) -> AuditReport:
        with gc_paused():
            return self._run(view_position)

    def _run(self, view_position: int | None) -> AuditReport:
        top = self.app.recorder.max_notification_id() or 0
        self.report.position = top
        self.report.view_position = view_position
        to_domain_event = self.app.mapper.to_domain_event
        topics = self._topics
        pending = self._pending
        # the next page is read while this one is folded
        for batch in read_pages(self.app.recorder, 1, BATCH, stop=top) if top else ():
            for n in batch:
                if view_position is not None and self._snapshot is None and n.id > view_position:
                    self._snapshot = self._figures()
                topic = n.topic
                if topic in topics:
                    kind = topics[topic]
                else:
                    kind = topics[topic] = self._credit_kind(topic)
                if kind is None:
                    got = pending.get(n.originator_id)
                    if got is None:
                        pending[n.originator_id] = [n]
                    else:
                        got.append(n)
                    self._pending_count += 1
                    if self._pending_count > _PENDING_LIMIT:
                        self._fold_all()
                    continue
                name, decoder, version = kind
                ev: Any = None
                if self._fast:
                    try:
                        ev = decoder.decode(n.state)
                    except msgspec.ValidationError:
                        ev = None
                    if ev is not None and ev.class_version != version:
                        ev = None  # an older version: the mapper upcasts it
                if ev is None:
                    ev = to_domain_event(n)
                if name == "AccountOpened":
                    self._accounts[n.originator_id] = ev.tenant_id
                tenant = self._accounts.get(n.originator_id, "?")
                self._credit(n.id, name, ev, tenant)
        if self._snapshot is None:
            self._snapshot = self._figures()
        return self.report

    def _credit_kind(self, topic: str) -> tuple[str, msgspec.json.Decoder[Any], int] | None:
        cls = resolve_topic(topic)
        name = cls.__name__
        struct = _CREDIT_STRUCTS.get(name)
        if struct is None or not cls.__qualname__.startswith("Account."):
            return None
        return name, msgspec.json.Decoder(struct), int(getattr(cls, "class_version", 1))

    def _fold(self, oid: UUID | str) -> Any:
        """The aggregate `oid` as the log stands at the current point of the replay."""
        waiting = self._pending.pop(oid, None)
        if waiting:
            self._pending_count -= len(waiting)
            to_domain_event = self.app.mapper.to_domain_event
            for n in waiting:
                agg = self.folder.apply(to_domain_event(n))
                if isinstance(agg, Lease) and agg.node_id is not None:
                    self.last_node[str(agg.id)] = agg.node_id
        return self.folder.aggregates.get(oid)  # type: ignore[arg-type]

    def _fold_all(self) -> None:
        for oid in list(self._pending):
            self._fold(oid)

    def _figures(self) -> dict[str, dict[str, int]]:
        return {t: c.figures() for t, c in self.report.tenants.items()}

    def _credit(self, seq: int, name: str, ev: Any, tenant: str) -> None:
        # get, then create only when missing: a setdefault would build its default every time
        r = self.report
        if self.tenant is not None and tenant != self.tenant:
            return
        c = r.tenants.get(tenant)
        if c is None:
            c = r.tenants[tenant] = TenantCredits()
        if name == "AccountOpened":
            return
        c.seqs.append(seq)
        holds = self.holds.get(tenant)
        if holds is None:
            holds = self.holds[tenant] = {}
        if name == "CreditsGranted":
            c.granted += int(ev.amount)
            return
        lid = str(ev.lease_id)
        spend = r.leases.get(lid)
        if spend is None:
            spend = r.leases[lid] = LeaseSpend(tenant=tenant)
        spend.seqs.append(seq)
        if name == "CreditsHeld":
            amount = int(ev.amount)
            held = holds.get(lid)
            holds[lid] = (amount, [seq]) if held is None else (held[0] + amount, [*held[1], seq])
            c.held += amount
            spend.held += amount
            return
        if lid not in holds:
            r.discrepancies.append(Discrepancy("unknown_hold", tenant, "a hold", "none", [seq],
                                               lid, f"{name} without a hold"))
            return
        hold, hold_seqs = holds.pop(lid)
        c.held -= hold
        if name == "HoldReleased":
            spend.released += int(ev.amount)
            if int(ev.amount) != hold:
                r.discrepancies.append(Discrepancy("release_split", tenant, hold,
                                                   int(ev.amount), [*hold_seqs, seq], lid))
            return
        charged, released, shortfall = int(ev.charged), int(ev.released), int(ev.shortfall)
        c.spent += charged
        c.shortfall += shortfall
        spend.charged += charged
        spend.released += released
        spend.shortfall += shortfall
        if charged + released != hold:
            r.discrepancies.append(Discrepancy(
                "settle_split", tenant, hold, charged + released, [*hold_seqs, seq], lid,
                "charged + released must equal the hold"))
        expected, version, why = self._expected_charge(lid, float(ev.at))
        spend.expected += expected
        if version is not None:
            spend.price_list_versions.append(version)
        if charged + shortfall != expected:
            r.discrepancies.append(Discrepancy(
                "charge", tenant, expected, charged + shortfall, [*hold_seqs, seq], lid,
                why if isinstance(why, str) else _why(*why)))

    def _expected_charge(
        self, lease_id: str, at: float
    ) -> tuple[int, int | None, str | tuple[Any, ...]]:
        """(expected charge, price list version, why): `why` is text, or the figures that
        _why words, for a discrepancy only (most settlements have none)."""
        lease = self._fold(UUID(lease_id))
        if not isinstance(lease, Lease):
            return 0, None, "no lease in the log"
        pool_id = self._ids.get(("pool", lease.pool_id))
        if pool_id is None:
            pool_id = self._ids[("pool", lease.pool_id)] = Pool.create_id(lease.pool_id)
        pool = self._fold(pool_id)
        if not isinstance(pool, Pool):
            return 0, None, f"no pool {lease.pool_id}"
        node_id = lease.node_id or self.last_node.get(lease_id)
        model = None
        if node_id is not None:
            node_uuid = self._ids.get(("node", node_id))
            if node_uuid is None:
                node_uuid = self._ids[("node", node_id)] = Node.create_id(node_id)
            node = self._fold(node_uuid)
            if isinstance(node, Node):
                model = node.capabilities.gpu_model
        seconds = lease.runtime_seconds(at)
        expected = pool.charge_for(lease.shape, seconds, gpu_model=model) if seconds else 0
        end = lease.run_ended_at if lease.run_ended_at is not None else at
        return expected, pool.price_list_version, (
            pool.price_list_version, lease.started_at, end, seconds)


def _why(version: int, started_at: float | None, end: float, seconds: float) -> str:
    return f"price list v{version}, started {started_at}, ended {end}, {seconds:g} s"


def audit_credits(app: Any, *, tenant: str | None = None, database_url: str | None = None,
                  schema: str = DEFAULT_SCHEMA) -> AuditReport:
    audit = CreditAudit(app, tenant=tenant)
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
    report = audit.run(view_position=view_position)
    if database_url and view_rows is None:
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
