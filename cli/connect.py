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


def context_of(args: argparse.Namespace, *, flag: str = "nats_url",
               env: str = "POOL_NATS_URL") -> Any:
    """The saved HTTP context (client.contexts.Context) a tenant command speaks through, or
    None for NATS. First of: --NATS-URL (NATS), --context, $POOL_NATS_URL (NATS),
    $POOL_CONTEXT, the current context (`pool login`, `pool context use`); `flag` and `env`
    name the server a command would otherwise reach (the views' --database-url)."""
    import os

    from client import contexts

    named = getattr(args, "context", None)
    if getattr(args, flag, None) and not named:
        return None
    if not named and os.environ.get(env):
        return None
    named = named or os.environ.get("POOL_CONTEXT") or None
    try:
        return contexts.load().pick(named)
    except contexts.ContextError as e:
        raise UsageError(f"{'--context' if getattr(args, 'context', None) else 'POOL_CONTEXT'}"
                         f": {e}" if named else str(e)) from None


def http_client(ctx: Any, timeout: float = 10.0) -> Any:
    """The tenant's client over the gateway's HTTP API, as its context says."""
    from client.http import HttpClient

    return HttpClient(ctx.url, ctx.token, tenant=ctx.tenant, timeout=timeout)


def default_pool(args: argparse.Namespace) -> str | None:
    """A request's pool when --pool is not given: $POOL_POOL, else the context's."""
    import os

    if os.environ.get("POOL_POOL"):
        return os.environ["POOL_POOL"]
    ctx = context_of(args)
    return (ctx.pool or None) if ctx is not None else None


def admin_context(args: argparse.Namespace) -> Any:
    """The admin token's HTTP context the operator's commands speak through, or None for NATS
    (a tenant's token cannot administer: with one, they stay on NATS)."""
    ctx = context_of(args)
    return ctx if ctx is not None and not ctx.tenant else None


def pool_client(args: argparse.Namespace, tenant: str = "") -> Any:
    """The client a command speaks through: over HTTP with a context (a tenant's for tenant
    commands, the admin token's for the operator's), else over NATS; both answer the same
    calls with the same envelopes."""
    ctx = context_of(args) if tenant else admin_context(args)
    if ctx is not None:
        return http_client(ctx, args.timeout)
    if not tenant:
        return admin_nats_client(args)
    from bus.local.auth import inbox_prefix
    from client.api import PoolClient
    from local import embedded

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


def admin_nats_client(args: argparse.Namespace) -> Any:
    """The operator's client over NATS: its own user on a local `pool up`, or --nats-url."""
    from client.api import PoolClient
    from local import embedded

    url = getattr(args, "nats_url", None) or embedded.admin_url()
    return PoolClient(url or nats_url_of(args), timeout=args.timeout)


def sdk_client(args: argparse.Namespace, tenant: str) -> Any:
    """The SDK's client (computepool.Client) on the transport `pool_client` picks: the CLI's
    commands and a tenant's programs speak through the same one."""
    from computepool.client import Client

    return Client(transport=pool_client(args, tenant), tenant=tenant)


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

    ctx = context_of(args)
    if ctx is not None:  # the token decides: a gateway acts only for its tenant
        if not ctx.tenant:
            raise UsageError(f"context {ctx.name!r} holds the admin token, which acts for no "
                             "tenant: `pool login URL` with a tenant's token")
        if getattr(args, "tenant", None) and args.tenant != ctx.tenant:
            raise UsageError(f"--tenant {args.tenant}: context {ctx.name!r} speaks for "
                             f"{ctx.tenant!r} (its token decides)")
        return str(ctx.tenant)
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
    """The application over the log an operator's command reads (the composition root's LOG
    role)."""
    from workers.bootstrap import PlaneConfig, Role, build

    return build(PlaneConfig(nats_url_of(args)), {Role.LOG}).log


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
