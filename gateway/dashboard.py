"""The web dashboard at `/`: a login form, the live fleet page and a lease's page.
Server-rendered shells that gateway/static/dashboard.js fills (docs/api-http.md#the-dashboard).
"""

from __future__ import annotations

import asyncio
import html
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

import msgspec
from litestar import Request, Response
from litestar.datastructures import Cookie
from litestar.handlers import HTTPRouteHandler
from litestar.response import Redirect, ServerSentEventMessage

from gateway import fleet, sse
from gateway.problems import problem
from gateway.shared import COOKIE, Gateway, Refused, checked_token, principal_of, refusal_headers
from gateway.tokens import Principal

SNAPSHOT_SECONDS = 0.5  # how often a dashboard stream looks again
KEEPALIVE_SECONDS = 15.0
HTML = "text/html; charset=utf-8"

_HEAD = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="stylesheet" href="/static/dashboard.css">
<link rel="icon" href="data:,">
</head><body>
<header><a href="/" class="brand">computepool</a> <span id="who">{who}</span>
<span id="live" class="dot" title="live"></span>
<form method="post" action="/logout" class="right"><button>sign out</button></form>
<a class="right" href="/docs">API</a></header>
"""

_LOGIN = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>computepool — sign in</title>
<link rel="stylesheet" href="/static/dashboard.css"><link rel="icon" href="data:,"></head>
<body><main class="login"><h1>computepool</h1>
<form method="post" action="/login">
<label>Token <input type="password" name="token" id="token" size="50" autocomplete="off"
 autofocus></label> <button id="signin">Sign in</button></form>
<p class="muted">A tenant's token (<code>pool admin tenant token TENANT</code>) shows its own
leases, queue and credits and the fleet's capacity; the admin token shows everything.</p>
{error}</main></body></html>"""

_FLEET = """<main>
<section id="time-box"><label for="time-slider">Time</label>
<input type="range" id="time-slider" min="-86400" max="0" step="1" value="0"
 aria-label="seconds back: the fleet and queue as they were">
<span id="time-label" class="muted">now, live</span></section>
<section><h2>Fleet</h2><div id="fleet" class="cards"></div>
<div class="cols"><div><h3>By zone</h3><table id="zones"></table></div>
<div><h3>GPUs by model</h3><table id="gpus"></table></div></div>
<details id="nodes-box"><summary>Nodes</summary><table id="nodes"></table></details></section>
<section><h2>Queue</h2><table id="queue"></table></section>
<section><h2>Leases</h2><table id="leases"></table></section>
<div class="cols"><section><h2>Fair shares</h2><svg id="shares-chart" width="460" height="140"
 role="img" aria-label="dominant share over weight, per tenant, over time"></svg>
<table id="shares"></table></section>
<section><h2>Credits</h2><table id="credits"></table></section></div>
</main>
<script src="/static/common.js"></script><script src="/static/dashboard.js"></script></body></html>"""

_LEASE = """<main data-lease="{lease_id}">
<section><h2>Lease <code>{lease_id}</code> <span id="state"></span></h2>
<ol id="timeline" class="timeline" aria-label="the lease's life"></ol>
<table id="lease"></table></section>
<section id="attempts-box" hidden><h2>Attempts</h2><p class="muted">Each attempt of the
lease and how it ended: the retried ones, then the one it is on.</p>
<table id="attempts"></table></section>
<section id="why-box"><h2>Why it waits</h2><p id="why" class="muted"></p>
<table id="why-filters"></table></section>
<section><h2>Flight recorder</h2><p class="muted">Every event of this lease in the log.</p>
<table id="history"></table></section>
<section><h2>Live changes</h2><table id="changes"></table></section>
</main>
<script src="/static/common.js"></script><script src="/static/lease.js"></script></body></html>"""


def _who(who: Principal) -> str:
    return "admin" if who.is_admin else f"tenant {html.escape(who.tenant)}"


def _page(body: str) -> Response[bytes]:
    return Response(body.encode(), media_type=HTML,
                    headers={"Content-Security-Policy": "default-src 'self'; img-src 'self' data:",
                             "X-Frame-Options": "DENY", "Cache-Control": "no-store"})


def _refused(e: Refused) -> Response[bytes]:
    return problem(e.code, e.detail, e.reasons, headers=refusal_headers(e))


def handlers(gw: Gateway) -> list[Any]:
    def signed_in(request: Request[Any, Any, Any]) -> Principal | None:
        try:
            return principal_of(gw, request)
        except Refused:
            return None

    async def index(request: Request[Any, Any, Any]) -> Response[bytes]:
        who = signed_in(request)
        if who is None:
            return _page(_LOGIN.format(error=""))
        return _page(_HEAD.format(title="computepool", who=_who(who)) + _FLEET)

    async def login(request: Request[Any, Any, Any]) -> Response[Any]:
        form = await request.form()
        token = str(form.get("token") or "").strip()
        try:
            valid = checked_token(gw, request, token) if token else None
        except Refused as e:
            return _refused(e)
        if valid is None:
            page = _page(_LOGIN.format(error='<p class="error" id="error">That token is not '
                                       'valid here.</p>'))
            page.status_code = 401
            return page
        return Redirect("/", status_code=303, cookies=[Cookie(
            key=COOKIE, value=token, httponly=True, samesite="strict", path="/",
            secure=request.url.scheme == "https")])

    async def logout() -> Response[Any]:
        return Redirect("/", status_code=303,
                        cookies=[Cookie(key=COOKIE, value="", max_age=0, path="/")])

    async def lease_page(request: Request[Any, Any, Any]) -> Response[Any]:
        lease_id = str(request.path_params.get("lease_id", ""))
        who = signed_in(request)
        if who is None:
            return Redirect("/", status_code=303)
        return _page(_HEAD.format(title=f"lease {html.escape(lease_id[:64])}", who=_who(who))
                     + _LEASE.format(lease_id=html.escape(lease_id[:128])))

    async def lease_story(request: Request[Any, Any, Any]) -> Response[Any]:
        from gateway.lease_page import story

        try:
            who = principal_of(gw, request)
            found = await story(gw, who, str(request.path_params.get("lease_id", "")))
        except Refused as e:
            return _refused(e)
        return Response(msgspec.json.encode(found), media_type="application/json",
                        headers={"Cache-Control": "no-store"})

    async def state(request: Request[Any, Any, Any]) -> Response[Any]:
        try:
            who = principal_of(gw, request)
        except Refused as e:
            return _refused(e)
        return Response(msgspec.json.encode(await fleet.snapshot(gw, who)),
                        media_type="application/json")

    async def stream(request: Request[Any, Any, Any]) -> Response[Any]:
        try:
            who = principal_of(gw, request)
            sse.check_room(gw, who)  # the API's streams and these share the token's cap
        except Refused as e:
            return _refused(e)

        async def events() -> AsyncIterator[ServerSentEventMessage]:
            last, quiet = b"", time.monotonic()
            while True:
                data = msgspec.json.encode(await fleet.snapshot(gw, who))
                if data != last:
                    last, quiet = data, time.monotonic()
                    yield ServerSentEventMessage(data=data.decode(), event="snapshot")
                elif time.monotonic() - quiet > KEEPALIVE_SECONDS:
                    quiet = time.monotonic()
                    yield ServerSentEventMessage(comment="keepalive")
                await asyncio.sleep(SNAPSHOT_SECONDS)

        return sse.counted_stream(gw, who, events())

    def route(path: str, method: Literal["GET", "POST"], fn: Any) -> Any:
        return HTTPRouteHandler(path=path, http_method=[method], include_in_schema=False)(fn)

    return [route("/", "GET", index), route("/login", "POST", login),
            route("/logout", "POST", logout),
            route("/leases/{lease_id:str}", "GET", lease_page),
            route("/dashboard/leases/{lease_id:str}", "GET", lease_story),
            route("/dashboard/state", "GET", state), route("/dashboard/stream", "GET", stream)]
