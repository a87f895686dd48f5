"""Version 1's lenient bodies: telemetry samples and the Envelope every reply comes in;
readers ignore the fields a newer writer adds.
"""

# msgspec gives each instance its own copy of a mutable default; ruff sees that only when
# msgspec.Struct is a base in the same file, not through the imported bases.
# ruff: noqa: RUF012

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta, Struct

from schemas.v1_resources import Utilization
from schemas.v1_vocabulary import Count, LenientBase, TelemetryKind, UnixSeconds

AttrName = Annotated[str, Meta(min_length=1, max_length=128)]
AttrValue = (
    Annotated[str, Meta(max_length=1024)]
    | Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
    | float
    | bool
)


class TelemetryEvent(LenientBase, frozen=True, kw_only=True):
    """One queue, startup, execution, utilization or failure sample for a lease on a node."""

    kind: TelemetryKind
    at: UnixSeconds
    seq: Count = 0
    utilization: Utilization | None = None
    attrs: Annotated[dict[AttrName, AttrValue], Meta(max_length=64)] = {}


class ErrorBody(Struct, frozen=True, kw_only=True):
    """A refusal: a stable code, a one-line message, and reason counts or details."""

    code: Annotated[str, Meta(max_length=128)]
    message: Annotated[str, Meta(max_length=4096)]
    reasons: dict[str, int | str] = {}


class Envelope(LenientBase, frozen=True, kw_only=True):
    """Every reply: ok with a lease or result, or not ok with an error."""

    ok: bool
    lease: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    error: ErrorBody | None = None

    @classmethod
    def success(
        cls, *, lease: dict[str, Any] | None = None, result: dict[str, Any] | None = None
    ) -> Envelope:
        return cls(ok=True, lease=lease, result=result)

    @classmethod
    def failure(
        cls, code: str, message: str, reasons: dict[str, int | str] | None = None
    ) -> Envelope:
        return cls(ok=False, error=ErrorBody(code=code, message=message, reasons=reasons or {}))


