"""Tenants' job secrets: sealed under the plane's key ring into a KV bucket (never the log),
named in a job by name and version, and opened only for the node that runs that job."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.application import PoolApp
    from workers.secrets.desk import SecretDesk
    from workers.secrets.settings import SecretSettings


def desk_for(app: PoolApp, url: str, settings: SecretSettings) -> SecretDesk:
    """The command service's secret desk on `url` (the command role's connection)."""
    from bus.secrets import SecretStore
    from workers.secrets.desk import SecretDesk

    return SecretDesk(app, settings, store=SecretStore(url))
