"""The gateway's /metrics: the views read at scrape time (projections.metrics) and the log's
sequence, in the Prometheus text format, for the admin token only (tenants' names and credits).
"""

from __future__ import annotations

import asyncio
from typing import Any

from litestar import Request, Response
from litestar.handlers import HTTPRouteHandler
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from gateway.problems import problem
from gateway.shared import Gateway, Refused, principal_of, refusal_headers


def registry_for(gw: Gateway) -> CollectorRegistry:
    """What the gateway serves: the views, when it has a database, with the log's head from
    the flight recorder's reader (the service user) for the lag; else the log's head alone."""
    from projections.metrics import views_or_head

    history = gw.history()
    head = history.log_head if history is not None else None
    registry = CollectorRegistry(auto_describe=False)
    collector = views_or_head(gw.database_url or None, gw.views_schema, log_head=head)
    if collector is not None:
        registry.register(collector)
    return registry


def handler(gw: Gateway) -> HTTPRouteHandler:
    registry = registry_for(gw)

    async def metrics(request: Request[Any, Any, Any]) -> Response[Any]:
        try:
            if not principal_of(gw, request).is_admin:
                raise Refused("forbidden", "/metrics needs the admin token")
        except Refused as e:
            return problem(e.code, e.detail, e.reasons, instance=request.url.path,
                           headers=refusal_headers(e))
        body = await asyncio.to_thread(generate_latest, registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return HTTPRouteHandler(path="/metrics", http_method=["GET"])(metrics)
