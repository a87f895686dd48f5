"""The clustered deployment's generated secrets beyond the NATS users: PostgreSQL's, Grafana's
and the NATS routes' passwords in compose's .env, and the servers' route include; each made
once and kept by every later run, since a volume initialised with one must keep meeting it.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path

POSTGRES = "POOL_POSTGRES_PASSWORD"  # the `pool` superuser of compose's PostgreSQL
GRAFANA = "POOL_GRAFANA_PASSWORD"  # Grafana's `admin`
ROUTE = "POOL_ROUTE_PASSWORD"  # what one nats-server proves to another on the cluster port
NAMES = (POSTGRES, GRAFANA, ROUTE)
ROUTE_USER = "pool-route"
# compose.yaml's servers, as each names the others on the cluster port
SERVERS = ("nats-1:6222", "nats-2:6222", "nats-3:6222")


def read_env(path: Path) -> dict[str, str]:
    """`NAME=value` lines of an .env file ({} when there is none)."""
    if not path.exists():
        return {}
    pairs = (line.split("=", 1) for line in path.read_text().splitlines()
             if "=" in line and not line.lstrip().startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


def kept_or_made(previous: Mapping[str, str]) -> dict[str, str]:
    """Each of NAMES: its value in `previous` (the .env written before), else a new one.
    URL-safe characters only: the PostgreSQL password goes into a URL as it is."""
    return {name: previous.get(name) or secrets.token_urlsafe(32) for name in NAMES}


def env_lines(values: Mapping[str, str]) -> str:
    return "".join(f"{name}={values[name]}\n" for name in NAMES)


def route_include(password: str, servers: Sequence[str] = SERVERS) -> str:
    """deploy/nats/cluster.conf: the routes every server dials, each with the routes' user and
    password, and the authorization every route dialling in must pass. Included inside the
    `cluster` block of deploy/nats/nats.conf; a server ignores the route to itself."""
    routes = "".join(f'  "nats-route://{ROUTE_USER}:{password}@{s}"\n' for s in servers)
    return ("# Written by `pool cluster auth` (mode 0600): a server that cannot prove this "
            "password\n# is not let into the cluster (it could otherwise join, take replicas "
            "and read the log).\n"
            f'authorization {{\n  user: "{ROUTE_USER}"\n  password: "{password}"\n'
            "  timeout: 2\n}\n"
            f"routes: [\n{routes}]\n")
