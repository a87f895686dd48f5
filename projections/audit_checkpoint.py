"""Checkpoints of the credit audit: the balances, open holds and a running hash of every credit
event up to a log position, so that the next audit reads only the events after it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from uuid import UUID

from domain.node import Node
from domain.pool import Pool
from projections.audit import (
    CANONICAL_UUID,
    UNSEEN,
    CreditAudit,
    Record,
    seq_list,
    uuid_text,
)
from projections.audit_report import TenantCredits
from projections.errors import CheckpointInvalid, CheckpointMismatch

FORMAT = 1
GENESIS = bytes(32)  # the running hash before the first credit event
_BASE_TOPICS = ("domain.pool:", "domain.node:")  # aggregates a charge check may need


def chain_step(previous: bytes, seq: int, oid: str, topic: str, data: bytes) -> bytes:
    """The running hash after one more credit event: over the previous hash, the event's
    sequence, aggregate, topic and stored bytes (so a changed, moved or missing event, or a
    different order, gives a different hash from then on)."""
    h = hashlib.sha256(previous)
    h.update(f"{seq}\n{oid}\n{topic}\n{len(data)}\n".encode())
    h.update(data)
    return h.digest()


@dataclass
class Checkpoint:
    """What an audit up to `position` found, enough to continue from there."""

    position: int
    chain: str  # hex of the running hash over every credit event ≤ position
    credit_events: int
    tenants: dict[str, dict[str, int]]  # granted, held, spent, shortfall
    holds: dict[str, dict[str, list[int]]]  # tenant → lease → [amount, seq, seq, …]
    accounts: dict[str, str]  # account id → tenant
    # pools, nodes and leases holding credits: their version at `position`, for the charge
    # checks of settlements after it
    versions: dict[str, int] = field(default_factory=dict)
    last_node: dict[str, str] = field(default_factory=dict)
    format: int = FORMAT

    def body(self) -> dict[str, Any]:
        return asdict(self)

    def digest(self) -> str:
        return hashlib.sha256(_canonical(self.body())).hexdigest()

    def to_json(self) -> str:
        return json.dumps({**self.body(), "digest": self.digest()}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Checkpoint:
        """The checkpoint in `text`, its digest checked: CheckpointInvalid if it does not hold."""
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise TypeError("not an object")
            digest = data.pop("digest")
            if data.get("format") != FORMAT:
                raise CheckpointInvalid(f"checkpoint format {data.get('format')!r}, "
                                        f"expected {FORMAT}")
            cp = cls(**data)
        except CheckpointInvalid:
            raise
        except (ValueError, TypeError, KeyError) as e:
            raise CheckpointInvalid(f"unreadable audit checkpoint: {e}") from e
        if not isinstance(digest, str) or digest != cp.digest():
            raise CheckpointInvalid("the audit checkpoint does not match its own digest: "
                                    "it was changed after it was written")
        return cp


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


class ChainedAudit(CreditAudit):
    """The credit audit with a running hash over the credit events it reads; started from a
    checkpoint, it reads only the log after the checkpoint's position."""

    def __init__(self, app: Any, *, tenant: str | None = None,
                 checkpoint: Checkpoint | None = None, stop: int | None = None) -> None:
        super().__init__(app, tenant=tenant)
        self.chain = GENESIS
        self.credit_events = 0
        self.stop = stop
        self._base: dict[str, int] = {}  # aggregate → its version at the checkpoint, unread
        if checkpoint is not None:
            if tenant is not None:
                raise CheckpointInvalid("a checkpoint covers every tenant: audit from it "
                                        "without --tenant")
            self._seed(checkpoint)

    def _seed(self, cp: Checkpoint) -> None:
        self.start = cp.position + 1
        self.chain = bytes.fromhex(cp.chain)
        self.credit_events = cp.credit_events
        for tenant, figures in cp.tenants.items():
            self.report.tenants[tenant] = TenantCredits(
                granted=figures["granted"], held=figures["held"], spent=figures["spent"],
                shortfall=figures["shortfall"])
        for tenant, holds in cp.holds.items():
            self.holds[tenant] = {lid: (h[0], h[1] if len(h) == 2 else list(h[1:]))
                                  for lid, h in holds.items()}
        for oid, tenant in cp.accounts.items():
            self._accounts[oid] = self._account(tenant)
        self._base = dict(cp.versions)
        self.last_node.update(cp.last_node)
        for holds in cp.holds.values():
            for lid in holds:
                # held before the checkpoint: its settlement folds it from its version there
                self._folded.setdefault(uuid_text(lid), None)

    def _fold_records(self, records: Sequence[Record]) -> None:
        topics = self._topics
        chain = self.chain
        n = 0
        for seq, oid, _u, _v, topic, data in records:
            kind = topics.get(topic, UNSEEN)
            if kind is UNSEEN:
                kind = topics[topic] = self._credit_kind(topic)
            if kind is not None:
                chain = chain_step(chain, seq, oid, topic, data)
                n += 1
        self.chain = chain
        self.credit_events += n
        super()._fold_records(records)

    def _fold(self, key: str) -> Any:
        version = self._base.pop(key, None)
        if version is not None and self._folded.get(key) is None:
            oid: Any = UUID(key) if CANONICAL_UUID.fullmatch(key) else key
            agg = self.app.repository.get(oid, version=version)
            self.folder.aggregates[agg.id] = agg  # events after the checkpoint fold onto it
            self._folded[key] = agg
        return super()._fold(key)

    def checkpoint(self) -> Checkpoint:
        """This audit's findings as a checkpoint at the position it read to."""
        versions: dict[str, int] = {}
        for key, recs in self._pending.items():
            if recs[-1][4].startswith(_BASE_TOPICS):
                versions[key] = int(recs[-1][3])
        for key, agg in self._folded.items():
            if key not in versions and isinstance(agg, (Pool, Node)):
                versions[key] = int(agg.version)
        for key, version in self._base.items():  # from the last checkpoint, not needed since
            versions.setdefault(key, version)
        holds: dict[str, dict[str, list[int]]] = {}
        last_node: dict[str, str] = {}
        for tenant, open_holds in self.holds.items():
            if not open_holds:
                continue
            holds[tenant] = {lid: [amount, *seq_list(seqs)]
                             for lid, (amount, seqs) in open_holds.items()}
            for lid in open_holds:
                key = uuid_text(lid)
                waiting = self._pending.get(key)
                agg = self._folded.get(key)
                if waiting:
                    versions[key] = int(waiting[-1][3])
                elif agg is not None:
                    versions[key] = int(agg.version)
                elif key in self._base:
                    versions[key] = self._base[key]
                if key in self.last_node:
                    last_node[key] = self.last_node[key]
        return Checkpoint(
            position=self.report.position, chain=self.chain.hex(),
            credit_events=self.credit_events,
            tenants={t: {k: v for k, v in c.figures().items() if k != "available"}
                     for t, c in self.report.tenants.items()},
            holds=holds,
            accounts={oid: acct[2] for oid, acct in self._accounts.items() if acct},
            versions=versions, last_node=last_node)


def verify_checkpoint(app: Any, cp: Checkpoint) -> list[str]:
    """Replay the log from sequence 1 to the checkpoint's position and say where the
    checkpoint disagrees with it (nothing: it summarises that log exactly)."""
    audit = ChainedAudit(app, stop=cp.position)
    audit.run()
    fresh = audit.checkpoint()
    problems = []
    if fresh.chain != cp.chain or fresh.credit_events != cp.credit_events:
        problems.append(f"the credit events up to {cp.position} are not the ones the "
                        f"checkpoint hashed ({fresh.credit_events} events now, "
                        f"{cp.credit_events} then)")
    for name in ("tenants", "holds", "accounts"):
        if getattr(fresh, name) != getattr(cp, name):
            problems.append(f"the checkpoint's {name} differ from a replay of the log")
    return problems


def load(path: Path) -> Checkpoint | None:
    """The checkpoint stored at `path` (None if there is none yet), its digest checked."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointInvalid(f"cannot read the audit checkpoint {path}: {e}") from e
    return Checkpoint.from_json(text)


def store(path: Path, cp: Checkpoint) -> None:
    """Write `cp` to `path` atomically (a reader sees the old one or the new one whole)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(cp.to_json())
    os.replace(tmp, path)


def audit_from_checkpoint(app: Any, path: Path, **kw: Any) -> tuple[Any, Checkpoint | None]:
    """`pool audit credits --checkpoint PATH`: audit the log after the stored checkpoint (all
    of it when there is none yet) and, when the audit is clean, store the new checkpoint.
    Returns the report and the checkpoint it started from."""
    from projections.audit import audit_credits

    start = load(path)
    if start is not None and start.position > (app.recorder.max_notification_id() or 0):
        raise CheckpointMismatch(f"the checkpoint is at {start.position}, past the log's end: "
                                 "it belongs to another log")
    audit = ChainedAudit(app, checkpoint=start)
    report = audit_credits(app, audit=audit, **kw)
    if report.ok:
        store(path, audit.checkpoint())
    return report, start
