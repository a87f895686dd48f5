"""`pool secret`: a tenant's secrets (set from stdin or a file, list, delete), and the `lease
run` flags that hand them to a job by name (`--secret-env`, `--secret-file`)."""

from __future__ import annotations

import argparse
import base64
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cli.connect import client_opts, pool_client, tenant_of
from cli.output import Subparsers, UsageError, print_envelope, table, when

MAX_SECRET_BYTES = 64 * 1024  # schemas/secret.py: the plane refuses more


def _call(args: argparse.Namespace, verb: str, body: dict[str, Any]) -> dict[str, Any]:
    tenant = tenant_of(args)
    with pool_client(args, tenant) as c:  # over NATS or a context's HTTP API alike
        reply: dict[str, Any] = c.secret(verb, body)
        return reply


def _value(args: argparse.Namespace) -> bytes:
    if args.from_file:
        try:
            data = Path(args.from_file).read_bytes()
        except OSError as e:
            raise UsageError(f"--from-file {args.from_file}: {e.strerror}") from None
    elif sys.stdin.isatty():  # typed: not echoed, one line
        import getpass

        data = getpass.getpass(f"value of {args.name}: ").encode()
    else:
        data = sys.stdin.buffer.read()
        # `echo token | pool secret set` means the token, not the token and a newline
        if data.endswith(b"\n") and not args.keep_newline:
            data = data[:-2] if data.endswith(b"\r\n") else data[:-1]
    if len(data) > MAX_SECRET_BYTES:
        raise UsageError(f"{'--from-file' if args.from_file else 'stdin'}: {len(data)} bytes, "
                         f"over a secret's most of {MAX_SECRET_BYTES}")
    return data


def cmd_set(args: argparse.Namespace) -> int:
    value = _value(args)
    reply = _call(args, "set", {"name": args.name, "value": base64.b64encode(value).decode()})
    if args.json or not reply.get("ok"):
        return print_envelope(reply, args.json)
    s = reply["result"]["secret"]
    print(f"secret {s['name']} version {s['version']} set ({s['size_bytes']} bytes)")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    reply = _call(args, "list", {})
    if args.json or not reply.get("ok"):
        return print_envelope(reply, args.json)
    rows = [{**s, "updated_at": when(s["updated_at"])} for s in reply["result"]["secrets"]]
    print(table(rows, ("name", "version", "size_bytes", "updated_at")) if rows
          else "no secrets")
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    return print_envelope(_call(args, "delete", {"name": args.name}), args.json)


def register(sub: Subparsers) -> None:
    """Add `secret`."""
    sc = sub.add_parser("secret", help="your secrets: kept sealed, handed to jobs by name",
                        description="Secrets of your tenant, sealed by the plane outside the "
                        "event log; a job gets them as variables (--secret-env) or files "
                        "(--secret-file) and the log records only their names and versions. "
                        "A job's --env is public: it is in the log.")
    verbs = sc.add_subparsers(dest="verb", metavar="VERB", required=True)
    st = verbs.add_parser("set", help="store a new version (value from stdin or --from-file)")
    st.add_argument("name", help="1-63 of a-z 0-9 _ -")
    st.add_argument("--from-file", metavar="PATH", help="the value is this file's bytes")
    st.add_argument("--keep-newline", action="store_true",
                    help="keep stdin's last newline (dropped by default)")
    client_opts(st, tenant=True)
    st.set_defaults(func=cmd_set)
    ls = verbs.add_parser("list", help="your secrets: names, versions, sizes (never values)")
    client_opts(ls, tenant=True)
    ls.set_defaults(func=cmd_list)
    rm = verbs.add_parser("delete", help="delete a secret and every kept version of it")
    rm.add_argument("name")
    client_opts(rm, tenant=True)
    rm.set_defaults(func=cmd_delete)


def register_admin(adm: Any, cmd_admin: Callable[[argparse.Namespace], int]) -> None:
    """Add `admin secrets reseal`, answered by `pool admin`'s own `cmd_admin`."""
    sec = adm.add_parser("secrets", help="tenants' sealed secrets").add_subparsers(
        dest="verb", metavar="VERB")
    sec.required = True
    rs = sec.add_parser("reseal", help="seal every tenant's newest secret versions again under "
                        "the active key (POOL_SECRET_KEYS' first), so an older key can go")
    client_opts(rs)
    rs.set_defaults(func=cmd_admin, build=lambda a: ("secrets.reseal", {}))


# -- `pool lease run` ----------------------------------------------------------------------


def add_run_flags(run: argparse.ArgumentParser) -> None:
    run.add_argument("--secret-env", action="append", metavar="VAR=NAME",
                     help="the job's variable VAR holds your secret NAME (repeatable)")
    run.add_argument("--secret-file", action="append", metavar="NAME[:PATH]",
                     help="your secret NAME as a file, in memory, at PATH (default "
                     "/run/secrets/NAME; repeatable)")
    run.add_argument("--registry-secret", metavar="NAME",
                     help="your secret NAME, `user:password`, is what the docker runtime "
                     "pulls the job's image with (a private registry)")


def with_secrets(args: argparse.Namespace, job: dict[str, Any]) -> dict[str, Any]:
    """`job` with the flags' secrets added to a job file's (the flags win)."""
    env = dict(job.get("secret_env") or {})
    for item in getattr(args, "secret_env", None) or []:
        var, sep, name = item.partition("=")
        if not sep or not var or not name:
            raise UsageError(f"--secret-env wants VAR=NAME, not {item!r}")
        env[var] = name
    files = dict(job.get("secret_files") or {})
    for item in getattr(args, "secret_file", None) or []:
        name, _sep, path = item.partition(":")
        if not name:
            raise UsageError(f"--secret-file wants NAME[:PATH], not {item!r}")
        path = path or f"/run/secrets/{name}"
        if not path.startswith("/run/secrets/"):
            raise UsageError(f"--secret-file {item}: the path is under /run/secrets/")
        files[name] = path
    out = dict(job)
    if env:
        out["secret_env"] = env
    if files:
        out["secret_files"] = files
    if getattr(args, "registry_secret", None):
        out["registry_secret"] = args.registry_secret
    return out
