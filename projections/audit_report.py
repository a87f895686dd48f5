"""The credit audit's report: per-tenant credits, per-lease spend, discrepancies and strays."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


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
                f"{self.found} (events {seqs_text(self.seqs)}{extra})")


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
    # messages on the log without event headers (not the recorder's): skipped, named here
    strays: list[tuple[int, str]] = field(default_factory=list)

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
            "strays": [{"seq": seq, "subject": subject} for seq, subject in self.strays],
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
                       f"events {seqs_text(s.seqs)}")
        out += [d.line() for d in self.discrepancies]
        out += [f"stray message (no event headers) at sequence {seq} on {subject!r}: skipped"
                for seq, subject in self.strays]
        out.append("audit ok" if self.ok else f"audit FAILED: {len(self.discrepancies)} "
                   "discrepancies")
        return out


def seqs_text(seqs: list[int]) -> str:
    if len(seqs) <= 24:
        return ",".join(map(str, seqs)) or "-"
    return ",".join(map(str, seqs[:10])) + f",…({len(seqs) - 20} more)…," + ",".join(
        map(str, seqs[-10:]))
