"""Webhooks: tenants' endpoints (domain/webhook.py) fed the matching records of their lease
feed, signed as Standard Webhooks says; the command side (desk) and the deliverer (worker)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.application import PoolApp
    from workers.webhooks.desk import WebhookDesk
    from workers.webhooks.settings import WebhookSettings
    from workers.webhooks.worker import Deliverer


def desk_for(app: PoolApp, url: str, settings: WebhookSettings,
             feed_last: Callable[[], Any]) -> WebhookDesk:
    """The command service's webhook desk on `url` (deliveries read from its KV bucket)."""
    from bus.webhooks import WebhookBus
    from workers.webhooks.desk import WebhookDesk

    return WebhookDesk(app, settings, bus=WebhookBus(url), feed_last=lambda: int(feed_last()))


def deliverer_for(app: PoolApp, url: str, settings: WebhookSettings, *, holder: str,
                  leader_ttl_seconds: float) -> Deliverer | None:
    """The deliverer of a plane that runs the reconciler role: None without a key to open the
    endpoints' secrets. One delivers at a time (a leader lease `webhooks`), so each endpoint
    gets its records in feed order."""
    if settings.key is None:
        return None
    from bus.leader import LeaderElection
    from bus.local.auth import speaks_as_role
    from bus.webhooks import WebhookBus
    from workers.webhooks.worker import Deliverer

    bus = WebhookBus(url)
    if not speaks_as_role(url):
        bus.ensure()  # a role's user may not: the operator made them
    election = LeaderElection(url, name="webhooks", holder_id=holder,
                              ttl_seconds=leader_ttl_seconds)
    return Deliverer(app, bus, settings, election=election)
