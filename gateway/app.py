"""The Litestar application: one handler per route-table row, bearer auth, problem+json.
Every request is checked here before a subject is built from the token's tenant alone.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
from litestar import Litestar, Request, Response
from litestar.exceptions import HTTPException
from litestar.handlers import HTTPRouteHandler
from litestar.static_files import create_static_files_router

from bus.subjects import command_subject, is_token
from gateway import problems, sse
from gateway.openapi import document
from gateway.problems import problem
from gateway.routes import NOT_FOUND_CODE, ROUTES, HttpRoute
from gateway.shared import (
    Gateway,
    Refused,
    plain_uint,
    principal_of,
    refusal_headers,
)
from gateway.tokens import Principal, TokenStore
from gateway.upstream import NotEnrolled, Settings, Upstream
from gateway.wire import Whoami
from schemas.codec import MAX_PAYLOAD_BYTES, SchemaError, decode

log = logging.getLogger(__name__)

JSON = "application/json"
STATIC = Path(__file__).parent / "static"
# requests one token may have in flight at once; more is 429, not an unbounded queue
MAX_IN_FLIGHT = 256


def _path_ids(route: HttpRoute, request: Request[Any, Any, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name in route.path_params:
        value = str(request.path_params.get(name, ""))
        if not is_token(value):
            raise Refused(NOT_FOUND_CODE.get(name, "not_found"), f"no {name} {value[:64]!r}")
        out[name] = value
    return out


def _query_args(route: HttpRoute, request: Request[Any, Any, Any]) -> dict[str, Any]:
    q = request.query_params
    filters: dict[str, str] = {}
    for name in route.query:
        # a repeated label (`?label=a=1&label=b=2`): the leases holding every pair
        value = ",".join(q.getall(name)) if name == "label" and name in q else q.get(name)
        if value is not None:
            if len(value) > 256 or not value.isprintable():
                raise Refused("invalid_field", f"query parameter {name!r} is not valid",
                              {"path": name})
            filters[name] = value
    args: dict[str, Any] = {"filters": filters}
    limit = q.get("limit")
    if limit is not None:
        n = plain_uint(limit, 1000)
        if n is None or n < 1:
            raise Refused("invalid_field", "limit must be an integer from 1 to 1000",
                          {"path": "limit"})
        args["limit"] = n
    cursor = q.get("cursor")
    if cursor is not None:
        if len(cursor) > 256 or not cursor.isprintable():
            raise Refused("invalid_field", "cursor is not valid", {"path": "cursor"})
        args["cursor"] = cursor
    args.update(_numbers(route, request))  # ?at=: the view as it was then
    return args


async def _body(route: HttpRoute, request: Request[Any, Any, Any],
                ids: dict[str, str]) -> bytes:
    """The validated command body, as bytes for the subject."""
    assert route.body is not None
    if route.method == "GET":
        raw = msgspec.json.encode(_numbers(route, request))
    else:
        raw = await request.body()
        if len(raw) > MAX_PAYLOAD_BYTES:
            raise Refused("payload_too_large",
                          f"the body is {len(raw)} bytes; the limit is {MAX_PAYLOAD_BYTES}")
    fields = set(route.body.__struct_fields__)
    fill = {k: v for k, v in ids.items() if k in fields}
    create = route.operation_id == "createComputeLease"
    if fill or create:
        raw = _merged(raw, fill, request.headers.get("idempotency-key"), create=create)
    try:
        cmd = decode(route.body, raw)
    except SchemaError as e:
        raise Refused(e.code, e.message, {"path": e.path} if e.path else None) from None
    return msgspec.json.encode(cmd)


def _numbers(route: HttpRoute, request: Request[Any, Any, Any]) -> dict[str, float]:
    """The GET's numeric query parameters that are body fields (`?at=`); the body's schema
    checks their range."""
    out: dict[str, float] = {}
    for name in route.numbers:
        value = request.query_params.get(name)
        if value is None:
            continue
        try:
            out[name] = float(value)
        except ValueError:
            out[name] = math.nan
        if not math.isfinite(out[name]):
            raise Refused("invalid_field", f"query parameter {name!r} is not a number",
                          {"path": name}) from None
    return out


def _merged(raw: bytes, fill: dict[str, str], key: str | None, *, create: bool) -> bytes:
    """The body with path ids (and the Idempotency-Key header) in it; a body that names them
    otherwise is refused rather than silently overruled."""
    try:
        obj = msgspec.json.decode(raw or b"{}")
    except (msgspec.DecodeError, RecursionError):
        raise Refused("malformed_json", "the body is not valid JSON") from None
    except UnicodeDecodeError:
        raise Refused("invalid_utf8", "the body is not valid UTF-8") from None
    if not isinstance(obj, dict):
        raise Refused("invalid_field", "Expected `object` - at `$`", {"path": "$"})
    for name, value in fill.items():
        if name in obj and obj[name] != value:
            raise Refused("invalid_field", f"{name} in the body differs from the path",
                          {"path": f"$.{name}"})
        obj[name] = value
    if not create:
        return msgspec.json.encode(obj)
    if key is not None:
        if "idempotency_key" in obj and obj["idempotency_key"] != key:
            raise Refused("invalid_field", "idempotency_key in the body differs from the "
                          "Idempotency-Key header", {"path": "$.idempotency_key"})
        obj["idempotency_key"] = key
    elif "idempotency_key" not in obj or obj["idempotency_key"] is None:
        # no key anywhere: a fresh one, so this request is simply not retry-safe
        obj["idempotency_key"] = "http-" + uuid.uuid4().hex
    return msgspec.json.encode(obj)


def _subject(route: HttpRoute, who: Principal, ids: dict[str, str]) -> str:
    return route.subject(who.tenant, ids)


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response[bytes]:
    return Response(msgspec.json.encode(data), status_code=status, media_type=JSON,
                    headers=headers)


async def _history(gw: Gateway, who: Principal, lease_id: str,
                   request: Request[Any, Any, Any]) -> Response[Any]:
    if not who.is_admin:
        # the tenant's right to the lease is its own user's `get`, decided by the server
        owned = await gw.upstream.call(who, command_subject(who.tenant, "lease", lease_id, "get"))
        if not owned.get("ok"):
            return problems.from_error(owned.get("error"), instance=request.url.path)
    history = gw.history()
    if history is None:
        raise Refused("views_unavailable", "this gateway cannot read the log")
    try:
        events = await asyncio.to_thread(history.events, lease_id)
    except Exception as e:  # noqa: BLE001 - the log's failures stay behind the gateway
        log.warning("history of %s unreadable: %r", lease_id, e)
        raise Refused("bus_unavailable", "the log could not be read") from None
    if not events:
        raise Refused("lease_not_found", f"no lease {lease_id!r}")
    return _json({"lease_id": lease_id, "events": events})


async def _admin_lease(gw: Gateway, lease_id: str) -> Response[Any]:
    if not gw.database_url:
        raise Refused("views_unavailable", "this gateway has no database for the views")
    try:
        page = await asyncio.to_thread(gw.views, "leases", tenant=None,
                                       filters={"lease_id": lease_id}, limit=1)
    except Exception:  # noqa: BLE001 - the driver's errors stay behind the gateway
        raise Refused("views_unavailable", "the views could not be read") from None
    rows = page.get("rows") or []
    if not rows:
        raise Refused("lease_not_found", f"no lease {lease_id!r} in the views")
    return _json(rows[0])


def _page(result: dict[str, Any]) -> dict[str, Any]:
    page = {"items": result.get("rows") or [], "next_cursor": result.get("next_cursor")}
    if "as_of_seq" in result:  # a view as it was: the time asked, the last event by then
        page["at"], page["as_of_seq"] = result["at"], result["as_of_seq"]
    return page


async def _answer(gw: Gateway, route: HttpRoute, request: Request[Any, Any, Any],
                  who: Principal) -> Response[Any]:
    ids = _path_ids(route, request)
    if route.reply == "stream":
        return await sse.open_stream(gw, route, request, who, ids)
    if route.operation_id == "readView":
        return await _read_view(gw, route, request, ids)
    if route.operation_id in ("getComputeLeaseHistory", "adminGetComputeLeaseHistory"):
        return await _history(gw, who, ids["lease_id"], request)
    if route.operation_id == "getUsage":
        from gateway.usage import usage

        got = await usage(gw, who, _query_args(route, request)["filters"])
        if "error" in got:
            return problems.from_error(got["error"], instance=request.url.path)
        return _json(got)
    if route.operation_id == "adminGetComputeLease":
        return await _admin_lease(gw, ids["lease_id"])
    if route.reply in ("page", "row"):
        args = _query_args(route, request)
        body = msgspec.json.encode(args)
    elif route.body is not None:
        body = await _body(route, request, ids)
    else:
        body = b"{}"
    reply = await gw.upstream.call(who, _subject(route, who, ids), body)
    if not reply.get("ok"):
        return problems.from_error(reply.get("error"), instance=request.url.path)
    if route.reply == "lease":
        lease = reply.get("lease") or {}
        headers = ({"Location": f"/v1/compute-leases/{lease.get('lease_id', '')}"}
                   if route.status == 201 else None)
        return _json(lease, route.status, headers)
    result = reply.get("result") or {}
    if route.reply == "page":
        return _json(_page(result))
    if route.reply == "row":
        rows = result.get("rows") or []
        return _json(rows[0] if rows else {"tenant": who.tenant, "granted": 0, "held": 0,
                                           "spent": 0, "available": 0})
    return _json(result, route.status)


async def _read_view(gw: Gateway, route: HttpRoute, request: Request[Any, Any, Any],
                     ids: dict[str, str]) -> Response[Any]:
    from projections.errors import BadQuery, ViewsUnavailable
    from projections.views import VIEWS

    view = ids["view"]
    if view not in VIEWS:
        raise Refused("not_found", f"no view {view!r}; there are {', '.join(VIEWS)}")
    if not gw.database_url:
        raise Refused("views_unavailable", "this gateway has no database for the views")
    args = _query_args(route, request)
    filters: dict[str, str] = args.pop("filters")
    tenant = filters.pop("tenant", None)
    try:
        page = await asyncio.to_thread(gw.views, view, tenant=tenant, filters=filters, **args)
    except BadQuery as e:
        raise Refused(e.code, str(e)) from None
    except (ViewsUnavailable, OSError) as e:
        raise Refused("views_unavailable", "the views could not be read") from e
    except Exception as e:  # noqa: BLE001 - the driver's errors stay behind the gateway
        log.warning("view %s could not be read: %r", view, e)
        raise Refused("views_unavailable", "the views could not be read") from None
    return _json(_page(page))



Handler = Callable[[Request[Any, Any, Any]], Awaitable[Response[Any]]]


def _handler(gw: Gateway, route: HttpRoute) -> Handler:
    async def handle(request: Request[Any, Any, Any]) -> Response[Any]:
        try:
            who = principal_of(gw, request)
            if route.reply == "principal":  # any valid token may ask who it is
                return _json(Whoami(kind=who.kind, tenant=who.tenant or None))
            if route.admin and not who.is_admin:
                raise Refused("forbidden", "this operation needs the admin token")
            if not route.admin and who.is_admin:
                raise Refused("forbidden", "the admin token acts for no tenant; use a tenant's "
                              "token, or /v1/admin/views/… to read every tenant")
            n = gw.in_flight.get(who, 0)
            if n >= MAX_IN_FLIGHT:
                return problem("too_many_requests", f"{n} requests of this token are in "
                               "flight; retry later", headers={"Retry-After": "1"})
            gw.in_flight[who] = n + 1
            try:
                return await _answer(gw, route, request, who)
            finally:
                gw.in_flight[who] -= 1
        except Refused as e:
            return problem(e.code, e.detail, e.reasons, instance=request.url.path,
                           headers=refusal_headers(e))
        except NotEnrolled as e:
            return problem(e.code, str(e), instance=request.url.path)

    handle.__name__ = route.operation_id
    return handle


def _http_error(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    """Litestar's own refusals (no route, wrong method, a body too large) as problems; anything
    else is a bug of the gateway: logged here, never a traceback to the client."""
    if isinstance(exc, HTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large",
                401: "unauthenticated", 429: "too_many_requests"}.get(exc.status_code,
                                                                     "bad_request")
        status = exc.status_code if exc.status_code < 500 else 503
        return problem(code, str(exc.detail), status=status, instance=request.url.path)
    log.exception("gateway failure on %s", request.url.path)
    return problem("internal_error", "the gateway failed; the error is in its log", status=500,
                   instance=request.url.path)


def create_app(settings: Settings, tokens: TokenStore, *, database_url: str = "",
               views_schema: str = "", dashboard: bool = True,
               open_log: Callable[[str], Any] | None = None) -> Litestar:
    """The ASGI application; its NATS clients close with its lifespan. The product's is made
    by the composition root (workers/bootstrap.py), which passes `open_log` (an application
    over the log at a URL, for the flight recorder and the log's head; None: neither)."""
    upstream = Upstream(settings)
    gw = Gateway(tokens, upstream, database_url, views_schema,
                 service_url=upstream.service_url(), open_log=open_log)
    handlers: list[Any] = []
    for route in ROUTES:
        handlers.append(HTTPRouteHandler(path=_litestar_path(route.path),
                                         http_method=[route.method],
                                         status_code=route.status)(_handler(gw, route)))
    spec = msgspec.json.encode(document())

    async def openapi_json() -> Response[bytes]:
        return Response(spec, media_type="application/vnd.oai.openapi+json")

    handlers.append(HTTPRouteHandler(path="/openapi.json", http_method=["GET"])(openapi_json))
    from gateway import docs_page

    handlers.append(HTTPRouteHandler(path="/docs", http_method=["GET"])(docs_page.page))
    from gateway import metrics, sessions

    handlers.append(metrics.handler(gw))
    handlers.append(sessions.handler(gw))
    from gateway import files

    handlers.extend(files.handlers(gw))
    handlers.append(create_static_files_router(path="/static", directories=[STATIC],
                                               include_in_schema=False))
    if dashboard:
        from gateway import dashboard as dash

        handlers.extend(dash.handlers(gw))

    async def close_clients() -> None:
        await gw.upstream.close()
        await asyncio.to_thread(gw.close)

    return Litestar(route_handlers=handlers, openapi_config=None,
                    exception_handlers={Exception: _http_error},
                    on_shutdown=[close_clients], request_max_body_size=MAX_PAYLOAD_BYTES * 2,
                    debug=False, logging_config=None)


def _litestar_path(path: str) -> str:
    """Every path parameter typed as a string, as Litestar wants (`{x}` → `{x:str}`)."""
    return re.sub(r"\{(\w+)\}", r"{\1:str}", path)
