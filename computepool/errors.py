"""The SDK's one error: every refusal of the plane and every transport failure, as a
`PoolError` carrying the stable error code (docs/sdk.md)."""

from __future__ import annotations

from typing import Any


class PoolError(Exception):
    """The control plane refused a call, or could not be asked: `code` is the stable error code
    (`lease_not_found`, `bus_unavailable`, …), `reasons` its reason counts or details."""

    def __init__(self, code: str, message: str, reasons: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reasons: dict[str, Any] = dict(reasons or {})

    @classmethod
    def from_envelope(cls, reply: dict[str, Any]) -> PoolError:
        """The error of a reply envelope that is not ok."""
        err = reply.get("error") or {}
        reasons = err.get("reasons")
        return cls(str(err.get("code") or "error"), str(err.get("message") or "refused"),
                   reasons if isinstance(reasons, dict) else {})

    def __repr__(self) -> str:
        return f"PoolError({self.code!r}, {self.message!r}, {self.reasons!r})"
