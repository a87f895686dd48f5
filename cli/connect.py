"""Where the `pool` command finds its servers and speaks as whom: URLs, clients, common flags."""

from __future__ import annotations

import argparse
from typing import Any

from cli.output import UsageError


def nats_url_of(args: argparse.Namespace) -> str:
    from local import embedded

    # the service user's URL of a local `pool up` (admin commands need it), or POOL_NATS_URL
    # as given
    url = getattr(args, "nats_url", None) or embedded.service_url()
    if not url:
        raise UsageError("no NATS server: run `pool up` first, or set POOL_NATS_URL / --nats-url")
    return str(url)


def pool_client(args: argparse.Namespace, tenant: str = "") -> Any:
    from bus.local.auth import inbox_prefix
    from client.api import PoolClient
    from local import embedded

    if not tenant:  # the admin CLI: its own user on a local `pool up`
        url = getattr(args, "nats_url", None) or embedded.admin_url()
        return PoolClient(url or nats_url_of(args), tenant, timeout=args.timeout)
    # a tenant speaks as its own user, so the server itself pins it to pool.cmd.<tenant>.> and
    # its replies to _INBOX.t.<tenant>.>; an explicit --nats-url / POOL_NATS_URL is used as given
    options: dict[str, Any] = {"inbox_prefix": inbox_prefix(tenant).encode()}
    url = getattr(args, "nats_url", None)
    auth = None if url else embedded.local_auth()
    if auth is None:
        return PoolClient(url or nats_url_of(args), tenant, timeout=args.timeout, **options)
    creds = embedded.tenant_credentials(tenant)
    if creds is None:
        raise UsageError(f"no credentials for tenant {tenant!r} in this pool: run "
                         f"`pool admin tenant creds {tenant}` (or `pool admin tenant set`) first")
    plain = embedded.endpoints()[0]
    if not plain:
        raise UsageError("no NATS server: run `pool up` first, or set POOL_NATS_URL / --nats-url")
    return PoolClient(plain, tenant, timeout=args.timeout, user=creds.user,
                      password=creds.password, **options)


def tenant_connection(args: argparse.Namespace, tenant: str) -> tuple[str, dict[str, Any]]:
    """The URL and connect options (user, password, inbox prefix) to speak as `tenant`'s own
    user, for the commands that hold a connection of their own (followers)."""
    from bus.local.auth import inbox_prefix
    from local import embedded

    options: dict[str, Any] = {"inbox_prefix": inbox_prefix(tenant)}
    url = getattr(args, "nats_url", None)
    if not url and embedded.local_auth() is not None:
        creds = embedded.tenant_credentials(tenant)
        if creds is None:
            raise UsageError(f"no credentials for tenant {tenant!r} in this pool: run "
                             f"`pool admin tenant creds {tenant}` first")
        url = embedded.endpoints()[0]
        options.update(user=creds.user, password=creds.password)
    return url or nats_url_of(args), options


def tenant_of(args: argparse.Namespace) -> str:
    import os

    t = args.tenant or os.environ.get("POOL_TENANT", "")
    if not t:
        raise UsageError("no tenant: pass --tenant or set POOL_TENANT")
    return str(t)


def database_url_of(args: argparse.Namespace) -> str:
    from local import embedded

    url = getattr(args, "database_url", None) or embedded.endpoints()[1]
    if not url:
        raise UsageError("no database: run `pool up` first, or set POOL_DATABASE_URL / "
                         "--database-url")
    return str(url)


def views_schema_of(args: argparse.Namespace) -> str:
    import os

    from projections.views import DEFAULT_SCHEMA

    return str(getattr(args, "schema", None) or os.environ.get("POOL_VIEWS_SCHEMA")
               or DEFAULT_SCHEMA)


def log_app(args: argparse.Namespace) -> Any:
    from control.application import PoolApp
    from control.bootstrap import app_env

    return PoolApp(env=app_env(nats_url_of(args)))


def close_app(app: Any, args: argparse.Namespace) -> None:
    app.close()  # the shared NATS connection closes at exit (bus.runtime's atexit hook)


def client_opts(sp: argparse.ArgumentParser, tenant: bool = False) -> None:
    """The flags of every command that speaks to the control plane over NATS."""
    sp.add_argument("--nats-url", help="NATS server (default: POOL_NATS_URL or `pool up`)")
    sp.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for a reply")
    sp.add_argument("--json", action="store_true", help="print the reply envelope as JSON")
    if tenant:
        sp.add_argument("--tenant", help="tenant to act as (default: $POOL_TENANT)")


def db_opts(sp: argparse.ArgumentParser, nats: bool = True) -> None:
    """The flags of every command that reads the PostgreSQL views (and the log, with nats)."""
    if nats:
        sp.add_argument("--nats-url", help="default: $POOL_NATS_URL or the `pool up` endpoints")
    sp.add_argument("--database-url",
                    help="default: $POOL_DATABASE_URL or the `pool up` endpoints")
    sp.add_argument("--schema", help="the views' schema (default $POOL_VIEWS_SCHEMA or "
                    "pool_views)")
    sp.add_argument("--json", action="store_true")
