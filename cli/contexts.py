"""`pool login`, `pool context list|use|delete` and `pool whoami`: a gateway's URL and a token,
saved under a name (client/contexts.py), so tenant commands need nothing else."""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from cli.output import EXIT_OK, Subparsers, UsageError, print_result, table


class LoginRefused(Exception):
    """The URL or the token given to `pool login` does not work; the message names which."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _token(args: argparse.Namespace) -> tuple[str, str]:
    """The token and the flag it came by."""
    if args.token and args.token_stdin:
        raise UsageError("--token or --token-stdin, not both")
    if args.token_stdin:
        token = sys.stdin.readline().strip()
        if not token:
            raise UsageError("--token-stdin: nothing on standard input")
        return token, "--token-stdin"
    if not args.token:
        raise UsageError("no token: pass --token T or --token-stdin (the tenant's token, from "
                         "`pool admin tenant token TENANT`)")
    return str(args.token), "--token"


def _check_url(url: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise LoginRefused("bad_url", f"URL {url!r}: not an http:// or https:// address of "
                           "a gateway (`pool gateway serve`, `pool up --http`)")
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        raise LoginRefused("bad_url", f"URL {url!r}: the port is not a number") from None
    return url.rstrip("/")


def _default_name(url: str, tenant: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    where = parts.hostname or "gateway"
    if parts.port:
        where += f"-{parts.port}"
    return re.sub(r"[^A-Za-z0-9_.-]", "-", f"{tenant or 'admin'}-{where}")[:64]


def whoami_at(url: str, token: str, flag: str, timeout: float) -> dict[str, Any]:
    """What the gateway at `url` says `token` is; a refusal names the flag at fault."""
    from client.http import HttpClient, HttpTransportError

    try:
        with HttpClient(url, token, timeout=timeout) as c:
            reply = c.whoami()
    except HttpTransportError as e:
        raise LoginRefused("gateway_unreachable", f"URL {url}: no answer ({e})") from None
    if reply.get("ok"):
        who: dict[str, Any] = reply["result"]
        return who
    err = reply.get("error") or {}
    if err.get("code") == "unauthenticated":
        raise LoginRefused("unauthenticated", f"{flag}: the gateway at {url} does not know "
                           "this token (a tenant's comes from `pool admin tenant token`)")
    raise LoginRefused(str(err.get("code") or "bad_url"),
                       f"URL {url}: no computepool HTTP API there ({err.get('message')})")


def cmd_login(args: argparse.Namespace) -> int:
    from client import contexts

    token, flag = _token(args)
    url = _check_url(args.url)
    who = whoami_at(url, token, flag, args.timeout)
    tenant = str(who.get("tenant") or "") if who.get("kind") == "tenant" else ""
    name = args.name or _default_name(url, tenant)
    if not contexts.NAME.match(name):
        raise UsageError(f"--name {name!r}: letters, digits, '.', '_' and '-', at most 64")
    ctx = contexts.Context(name=name, url=url, token=token, tenant=tenant, pool=args.pool or "")
    try:
        config = contexts.load()
    except contexts.ContextError as e:
        raise LoginRefused(e.code, str(e)) from None
    path = contexts.save(config.with_context(ctx))
    who_text = f"tenant {tenant}" if tenant else "the admin"
    return print_result({"context": name, "url": url, "kind": who.get("kind"),
                         "tenant": tenant or None, "pool": ctx.pool or None,
                         "config": str(path)}, args.json,
                        f"logged in to {url} as {who_text}; context {name!r} is current "
                        f"({path})")


def _config() -> Any:
    from client import contexts

    try:
        return contexts.load()
    except contexts.ContextError as e:
        raise LoginRefused(e.code, str(e)) from None


def cmd_context_list(args: argparse.Namespace) -> int:
    config = _config()
    rows = [{"current": "*" if name == config.current else "", "name": name, "url": c.url,
             "tenant": c.tenant or "(admin)", "pool": c.pool or "-"}
            for name, c in sorted(config.contexts.items())]  # never the tokens
    if args.json:
        print(json.dumps({"ok": True, "result": {"current": config.current or None,
                                                 "contexts": rows}}))
    elif not rows:
        print("no contexts: `pool login URL --token-stdin` saves one", file=sys.stderr)
    else:
        print(table(rows, ("current", "name", "url", "tenant", "pool")))
    return EXIT_OK


def cmd_context_use(args: argparse.Namespace) -> int:
    from client import contexts

    config = _config()
    ctx = config.pick(args.name) if args.name in config.contexts else None
    if ctx is None:
        raise UsageError(f"no context named {args.name!r} (`pool context list`)")
    contexts.save(config.with_context(ctx))
    return print_result({"current": args.name}, args.json, f"context {args.name!r} is current")


def cmd_context_delete(args: argparse.Namespace) -> int:
    from client import contexts

    config = _config()
    if args.name not in config.contexts:
        raise UsageError(f"no context named {args.name!r} (`pool context list`)")
    contexts.save(config.without(args.name))
    return print_result({"deleted": args.name}, args.json, f"context {args.name!r} deleted")


def cmd_whoami(args: argparse.Namespace) -> int:
    import os

    from cli.connect import context_of

    ctx = context_of(args)
    if ctx is None:
        tenant = os.environ.get("POOL_TENANT", "")
        text = (f"tenant {tenant} over NATS ($POOL_TENANT)" if tenant else
                "no context and no $POOL_TENANT: `pool login URL --token-stdin`")
        return print_result({"transport": "nats", "tenant": tenant or None}, args.json, text)
    who = whoami_at(ctx.url, ctx.token, f"context {ctx.name!r}'s token", args.timeout)
    named = who.get("tenant")
    return print_result({"transport": "http", "context": ctx.name, "url": ctx.url, **who},
                        args.json, f"{'tenant ' + str(named) if named else 'the admin'} at "
                        f"{ctx.url} (context {ctx.name!r})")


def register(sub: Subparsers) -> None:
    """Add `login`, `context` and `whoami`."""
    lg = sub.add_parser(
        "login", help="check a token against a gateway and save it as the current context",
        description="Asks the gateway at URL who the token is (GET /v1/whoami), then saves "
        "the URL, the token and a default pool as a context in "
        "$XDG_CONFIG_HOME/computepool/config.toml (mode 0600) and makes it current: tenant "
        "commands then speak the HTTP API, with no NATS or database URL.",
        epilog="example: pool admin tenant token acme | pool login http://127.0.0.1:8080 "
        "--token-stdin")
    lg.add_argument("url", metavar="URL", help="the gateway, e.g. http://127.0.0.1:8080")
    lg.add_argument("--token", help="the bearer token (visible to `ps`: prefer --token-stdin)")
    lg.add_argument("--token-stdin", action="store_true",
                    help="read the token from the first line of standard input")
    lg.add_argument("--name", help="the context's name (default: TENANT-HOST-PORT)")
    lg.add_argument("--pool", help="the pool requests go to when they name none")
    lg.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the gateway")
    lg.add_argument("--json", action="store_true")
    lg.set_defaults(func=cmd_login)
    ctx = sub.add_parser("context", help="saved contexts: list, use, delete").add_subparsers(
        dest="verb", metavar="VERB", required=True)
    ls = ctx.add_parser("list", help="every saved context (* the current one); never tokens")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_context_list)
    for verb, help_text, func in (("use", "make a context the current one", cmd_context_use),
                                  ("delete", "forget a context and its token",
                                   cmd_context_delete)):
        vp = ctx.add_parser(verb, help=help_text)
        vp.add_argument("name", metavar="NAME")
        vp.add_argument("--json", action="store_true")
        vp.set_defaults(func=func)
    wh = sub.add_parser("whoami", help="who tenant commands speak as, asked of the gateway")
    wh.add_argument("--timeout", type=float, default=10.0)
    wh.add_argument("--json", action="store_true")
    wh.set_defaults(func=cmd_whoami)
