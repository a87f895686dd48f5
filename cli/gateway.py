"""`pool gateway` (the HTTP API and dashboard), `pool admin tenant token` and `pool admin token`,
and the gateway `pool up --http` starts beside the control plane."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from cli.output import EXIT_OK, Subparsers, UsageError

DEFAULT_LISTEN = "127.0.0.1:8080"


def _home(args: argparse.Namespace) -> Path:
    from local import embedded

    home = getattr(args, "home", None)
    return Path(home).resolve() if home else embedded.pool_home()


def _store(home: Path) -> Any:
    from gateway.tokens import TOKENS_FILE, TokenStore

    return TokenStore(home / TOKENS_FILE)


def listen_of(text: str | None) -> tuple[str, int] | None:
    """`--http` (or $POOL_HTTP): where to listen, or None for off."""
    from gateway.server import parse_listen

    value = text if text is not None else os.environ.get("POOL_HTTP", DEFAULT_LISTEN)
    try:
        return parse_listen(value)
    except ValueError as e:
        raise UsageError(f"--http: {e}") from None


def build_app(*, nats_url: str, service_url: str, auth_path: Path | None, database_url: str,
              views_schema: str, home: Path) -> Any:
    """The gateway's ASGI application, from the composition root's gateway role."""
    from workers.bootstrap import GatewayConfig, PlaneConfig, Role, build

    raw = os.environ.get("POOL_MAX_UPLOAD_BYTES", "")
    if raw and not (raw.isascii() and raw.isdigit()):
        raise UsageError(f"POOL_MAX_UPLOAD_BYTES={raw!r}: a whole number of bytes")
    gateway = GatewayConfig(nats_url, home, service_url=service_url, auth_path=auth_path,
                            database_url=database_url, views_schema=views_schema,
                            # the largest work directory a tenant sends over HTTP
                            max_upload_bytes=int(raw) if raw else None)
    return build(PlaneConfig(nats_url, gateway=gateway), {Role.GATEWAY}).gateway


def first_admin_token(home: Path) -> str | None:
    """A new admin token when the deployment has none yet (shown once), else None."""
    store = _store(home)
    if store.has_admin():
        return None
    from gateway.tokens import TokenExists

    try:
        token: str = store.issue_admin()
    except TokenExists:  # another process made it first
        return None
    return token


def start_beside(emb: Any, listen: tuple[str, int], home: Path) -> tuple[Any, list[str]]:
    """`pool up`'s gateway on a thread: (the server or None, lines to print)."""
    from gateway.server import ServerThread
    from local import embedded
    from projections.views import DEFAULT_SCHEMA

    auth_path = home / embedded.AUTH_FILE if emb.secured else None
    app = build_app(nats_url=emb.nats_url, service_url=emb.service_url or emb.nats_url,
                    auth_path=auth_path, database_url=emb.database_url,
                    views_schema=os.environ.get("POOL_VIEWS_SCHEMA") or DEFAULT_SCHEMA,
                    home=home)
    try:
        server = ServerThread(app, *listen).start()
    except RuntimeError as e:
        return None, [(f"http: not started on {listen[0]}:{listen[1]} ({e}); --http "
                       "HOST:PORT picks another, --http off none")]
    notes = [f"http: {server.url} (API /v1, OpenAPI /openapi.json, docs /docs, dashboard /)"]
    token = first_admin_token(home)
    if token:
        notes.append(f"http: admin token {token} (shown once; `pool admin token --rotate` "
                     "makes a new one)")
    return server, notes


def cmd_gateway(args: argparse.Namespace) -> int:
    from gateway.server import serve
    from local import embedded
    from projections.views import DEFAULT_SCHEMA

    listen = listen_of(args.http)
    if listen is None:
        raise UsageError("--http off: `pool gateway` has nothing else to do")
    home = _home(args)
    explicit = args.nats_url or os.environ.get("POOL_NATS_URL", "")
    if explicit:
        nats_url, service_url, auth_path = explicit, explicit, None
    else:
        nats_url = embedded.endpoints(home)[0]
        service_url = embedded.service_url(home)
        path = home / embedded.AUTH_FILE
        auth_path = path if path.exists() else None
    if not nats_url:
        raise UsageError("no NATS server: run `pool up` first, or set POOL_NATS_URL / "
                         "--nats-url")
    database_url = args.database_url or embedded.endpoints(home)[1]
    app = build_app(nats_url=nats_url, service_url=service_url, auth_path=auth_path,
                    database_url=database_url,
                    views_schema=args.schema or os.environ.get("POOL_VIEWS_SCHEMA")
                    or DEFAULT_SCHEMA, home=home)
    url = f"http://{listen[0]}:{listen[1]}"
    token = first_admin_token(home)
    if args.json:
        print(json.dumps({"http_url": url, "admin_token": token}), flush=True)
    else:
        print(f"http: {url} (API /v1, OpenAPI /openapi.json, docs /docs, dashboard /)")
        if token:
            print(f"http: admin token {token} (shown once; `pool admin token --rotate` makes "
                  "a new one)")
        print("ready: Ctrl-C to stop", flush=True)
    serve(app, *listen)
    return EXIT_OK


def cmd_token(args: argparse.Namespace) -> int:
    from gateway.tokens import BadTenant, TokenExists

    home = _home(args)
    store = _store(home)
    tenant = getattr(args, "tenant_id", None)
    try:
        token = (store.issue_tenant(tenant, rotate=args.rotate) if tenant
                 else store.issue_admin(rotate=args.rotate))
    except (TokenExists, BadTenant) as e:
        raise UsageError(str(e)) from None
    if tenant:
        from local import embedded

        if embedded.local_auth(home) is not None:
            # the gateway acts as the tenant's NATS user: make sure it has one
            embedded.add_tenant(tenant, home)
    if args.json:
        print(json.dumps({"tenant": tenant, "token": token} if tenant else {"token": token}))
    else:
        print(token)
    return EXIT_OK


def register(sub: Subparsers) -> None:
    """Add `gateway`."""
    gw = sub.add_parser(
        "gateway", help="serve the HTTP API, its OpenAPI document and the web dashboard",
        description="The HTTP API on the command subjects (a tenant's token acts as that "
        "tenant's NATS user), /openapi.json, /docs and the dashboard at /.")
    gw.add_argument("--http", metavar="HOST:PORT",
                    help=f"where to listen (default $POOL_HTTP or {DEFAULT_LISTEN})")
    gw.add_argument("--home", help="data directory (default: $POOL_HOME or ./.pool)")
    gw.add_argument("--nats-url", help="NATS server (default: POOL_NATS_URL or `pool up`)")
    gw.add_argument("--database-url", help="the views (default: POOL_DATABASE_URL or "
                    "`pool up`)")
    gw.add_argument("--schema", help="the views' schema (default $POOL_VIEWS_SCHEMA)")
    gw.add_argument("--json", action="store_true", help="print the URL (and a first admin "
                    "token) as JSON")
    gw.set_defaults(func=cmd_gateway)


def register_tokens(adm: Subparsers, aten: Subparsers) -> None:
    """Add `admin tenant token` and `admin token`."""
    tt = aten.add_parser("token", help="the tenant's bearer token for the HTTP API (shown "
                         "once, stored hashed)")
    tt.add_argument("tenant_id")
    tt.add_argument("--rotate", action="store_true", help="replace the token (the old one "
                    "stops working)")
    tt.add_argument("--home", help="data directory (default: $POOL_HOME or ./.pool)")
    tt.add_argument("--json", action="store_true")
    tt.set_defaults(func=cmd_token)
    at = adm.add_parser("token", help="the admin's bearer token for the HTTP API")
    at.add_argument("--rotate", action="store_true", help="replace the token")
    at.add_argument("--home", help="data directory (default: $POOL_HOME or ./.pool)")
    at.add_argument("--json", action="store_true")
    at.set_defaults(func=cmd_token, tenant_id=None)
