"""compose.yaml as a deployment one may expose: generated secrets, authenticated routes, only
loopback ports, no privileged containers. Read as YAML, with deploy/nats/nats.conf beside it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from cli.main import main
from local import compose_secrets

ROOT = Path(__file__).resolve().parents[2]
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
NATS_CONF = (ROOT / "deploy" / "nats" / "nats.conf").read_text()
REQUIRED = re.compile(r"^\$\{(POOL_\w+_PASSWORD):\?[^}]*\}$")


def _environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def test_no_container_is_privileged_or_given_extra_powers() -> None:
    for name, service in SERVICES.items():
        assert not service.get("privileged"), name
        assert not service.get("cap_add"), name
        assert not service.get("devices"), name
        assert service.get("pid") != "host" and service.get("network_mode") != "host", name
    for agent in ("agent-1", "agent-2"):
        opts = SERVICES[agent]["security_opt"]
        # what bubblewrap needs (user namespaces, mounts inside them) and no way to gain more
        assert set(opts) == {"seccomp=unconfined", "apparmor=unconfined",
                             "no-new-privileges:true"}, opts


def test_every_published_port_is_on_loopback_and_monitoring_is_not_published() -> None:
    published = {name: s["ports"] for name, s in SERVICES.items() if s.get("ports")}
    assert published, "nothing published: the test reads the wrong file"
    for name, ports in published.items():
        for port in ports:
            assert str(port).startswith("127.0.0.1:"), (name, port)
            assert not str(port).endswith(":8222"), (name, port)
    for name in ("nats-1", "nats-2", "nats-3"):
        assert "8222" not in [str(p) for p in SERVICES[name].get("expose", [])], name
    assert re.search(r"^http: 127\.0\.0\.1:8222$", NATS_CONF, re.MULTILINE)


def test_no_password_has_a_default_value() -> None:
    text = (ROOT / "compose.yaml").read_text()
    assert "pool:pool@" not in text and "admin/admin" not in text
    seen = set()
    for name, service in SERVICES.items():
        for key, value in _environment(service).items():
            if "PASSWORD" in key:
                match = REQUIRED.match(value)
                assert match, (name, key, value)  # from .env, or compose refuses to start
                seen.add(match.group(1))
            if key == "POOL_DATABASE_URL":
                assert "${POOL_POSTGRES_PASSWORD:?" in value, (name, value)
    assert {compose_secrets.POSTGRES, compose_secrets.GRAFANA} <= seen
    assert _environment(SERVICES["grafana"])["GF_SECURITY_ADMIN_PASSWORD"]


def test_the_routes_need_the_generated_password() -> None:
    cluster = re.search(r"^cluster \{(.*?)^\}", NATS_CONF, re.MULTILINE | re.DOTALL)
    assert cluster is not None
    # no route of its own without credentials: all of them come from the generated include
    assert "nats-route://" not in NATS_CONF
    assert 'include "cluster.conf"' in cluster.group(1)
    for name in ("nats-1", "nats-2", "nats-3"):
        assert "./deploy/nats/cluster.conf:/etc/nats/cluster.conf:ro" in SERVICES[name]["volumes"]
    include = compose_secrets.route_include("s3cret-pw")
    assert re.search(r'authorization \{\s*user: "pool-route"\s*password: "s3cret-pw"', include)
    routes = re.findall(r"nats-route://(\S*?)@(nats-\d:6222)", include)
    assert routes == [("pool-route:s3cret-pw", f"nats-{i}:6222") for i in (1, 2, 3)]


def test_pool_cluster_auth_keeps_the_secrets_it_made(tmp_path: Path) -> None:
    env = tmp_path / ".env"
    args = ["cluster", "auth", "--dir", str(tmp_path), "--env-file", str(env), "--json"]
    assert main(args) == 0
    first = compose_secrets.read_env(env)
    assert all(len(first[n]) >= 32 for n in compose_secrets.NAMES)
    assert len({first[n] for n in compose_secrets.NAMES}) == 3
    assert (env.stat().st_mode & 0o777) == 0o600
    conf = tmp_path / "cluster.conf"
    assert (conf.stat().st_mode & 0o777) == 0o600
    assert f"password: \"{first[compose_secrets.ROUTE]}\"" in conf.read_text()
    # PostgreSQL's volume keeps the first password: a later run must not make another
    assert main(args) == 0
    assert compose_secrets.read_env(env) == first
