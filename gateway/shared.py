"""What the gateway's handlers share: the token store, the NATS clients, the views' reader,
and the refusal a handler raises to be answered with a problem."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.tokens import Principal, TokenStore
from gateway.upstream import Upstream


@dataclass
class Gateway:
    """What every handler shares: the token store, the NATS clients and the views' reader."""

    tokens: TokenStore
    upstream: Upstream
    database_url: str = ""
    views_schema: str = ""
    in_flight: dict[Principal, int] = field(default_factory=dict)

    def views(self, view: str, **kw: Any) -> dict[str, Any]:
        """A page of any view, every tenant: the admin's and the dashboard's fleet."""
        from projections.queries import query_url
        from projections.views import DEFAULT_SCHEMA

        return query_url(self.database_url, view, schema=self.views_schema or DEFAULT_SCHEMA,
                         **kw)


class Refused(Exception):
    """A request the gateway answers itself with a problem."""

    def __init__(self, code: str, detail: str, reasons: dict[str, Any] | None = None) -> None:
        super().__init__(detail)
        self.code, self.detail, self.reasons = code, detail, reasons


