"""Version 1 of the webhook commands' wire types (`pool.cmd.<tenant>.webhook.<verb>`): add,
list, delete and test an endpoint, and read its deliveries' state."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct

from schemas.v1 import SchemaVersion, SubjectToken

WebhookUrl = Annotated[str, Meta(min_length=8, max_length=2048)]
WebhookEvent = Annotated[str, Meta(pattern=r"^[a-z_]{1,32}(?!\n)$", max_length=32)]


class WebhookAdd(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Register an endpoint for the tenant's lease-feed records of `events` (lease states, or
    `ended`: any final one). The reply carries its signing secret, this once."""

    schema_version: SchemaVersion = 1
    url: WebhookUrl
    events: Annotated[list[WebhookEvent], Meta(min_length=1, max_length=16)]


class WebhookList(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The tenant's endpoints (never their secrets)."""

    schema_version: SchemaVersion = 1


class WebhookDelete(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Delete an endpoint; its pending deliveries are dropped."""

    schema_version: SchemaVersion = 1
    endpoint_id: SubjectToken


class WebhookTest(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """POST a signed test message to an endpoint now and answer with its status."""

    schema_version: SchemaVersion = 1
    endpoint_id: SubjectToken


class WebhookDeliveries(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The latest deliveries' state (one endpoint, or all of the tenant's)."""

    schema_version: SchemaVersion = 1
    endpoint_id: SubjectToken | None = None
    limit: Annotated[int, Meta(ge=1, le=1000)] = 100


PUBLIC_STRUCTS: tuple[type[Struct], ...] = (WebhookAdd, WebhookList, WebhookDelete, WebhookTest,
                                            WebhookDeliveries)
