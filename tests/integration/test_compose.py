"""compose.yaml, the clustered deployment: the compose CLI accepts it, and it keeps its promises.

Owns checking the file without running it (no images are pulled): `config` where a compose CLI
is installed (the docker plugin or docker-compose), plain text checks everywhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
NATS_CONF = ROOT / "deploy" / "nats" / "nats.conf"
SERVICES = {"nats-1", "nats-2", "nats-3", "postgres", "init", "commands-1", "commands-2",
            "scheduler-1", "scheduler-2", "reconciler", "projector", "guard", "agent-1", "agent-2"}


def _compose_cli() -> list[str] | None:
    if shutil.which("docker"):
        r = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False,
                           timeout=30)
        if r.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def _passwords() -> dict[str, str]:
    """Every password compose.yaml requires, as `pool cluster auth`'s .env would hold them."""
    return {name: "x" for name in re.findall(r"\$\{(POOL_\w+_PASSWORD):\?", COMPOSE.read_text())}


def _config(cli: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*cli, "-f", str(COMPOSE), "config", *args], cwd=ROOT,
                          capture_output=True, text=True, check=False, timeout=120,
                          env={**os.environ, **_passwords()})


def test_the_compose_cli_accepts_compose_yaml_with_every_service() -> None:
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no compose CLI (docker compose plugin or docker-compose): "
                    "compose.yaml not validated")
    r = _config(cli, "-q")
    assert r.returncode == 0, r.stderr
    services = set(_config(cli, "--services").stdout.split())
    assert SERVICES <= services, SERVICES - services
    resolved = _config(cli).stdout
    # every control-plane service and agent names all three servers
    urls = re.findall(r"POOL_NATS_URL: (\S+)", resolved)
    assert len(urls) >= 10
    assert set(urls) == {"nats://nats-1:4222,nats://nats-2:4222,nats://nats-3:4222"}


def test_the_nats_servers_are_recent_enough_and_fsync_every_write() -> None:
    text = COMPOSE.read_text()
    versions = re.findall(r"image: nats:(\d+)\.(\d+)", text)
    assert versions and all((int(a), int(b)) >= (2, 12) for a, b in versions)
    conf = NATS_CONF.read_text()
    assert "sync_interval: always" in conf
    assert 'include "cluster.conf"' in conf  # the routes, with their password
    for i in (1, 2, 3):
        assert f'"--name", "nats-{i}"' in text  # a JetStream cluster needs unique server names


def test_the_streams_are_created_at_three_replicas_and_the_image_can_sandbox() -> None:
    text = COMPOSE.read_text()
    assert '["cluster", "init", "--replicas", "3"' in text
    for role in ("commands", "scheduler", "reconciler", "projector"):
        assert f'["serve", "--role", "{role}"]' in text
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "FROM python:3.11-slim" in dockerfile and "bubblewrap" in dockerfile
    assert 'ENTRYPOINT ["pool"]' in dockerfile
    assert "privileged: true" not in text  # tests/unit/test_compose_hardening.py


def test_every_service_speaks_as_its_own_user_from_pool_cluster_auth(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "cli.main", "cluster", "auth", "--dir",
                        str(tmp_path), "--env-file", str(tmp_path / ".env"), "--json"],
                       cwd=ROOT, capture_output=True, text=True, check=False, timeout=60)
    assert r.returncode == 0, r.stderr
    users = json.loads(r.stdout)["result"]["users"]
    env = dict(line.split("=", 1) for line in (tmp_path / ".env").read_text().splitlines())
    # what compose.yaml requires is exactly what the command wrote, and nothing is plain
    assert set(_passwords()) <= set(env), set(_passwords()) - set(env)
    conf = (tmp_path / "auth.conf").read_text()
    assert all(password not in conf for password in env.values())
    assert conf.count('"$2b$') == len(users)
    assert 'include "auth.conf"' in NATS_CONF.read_text()
    text = COMPOSE.read_text()
    assert text.count("./deploy/nats/auth.conf:/etc/nats/auth.conf:ro") == 3
    for role in ("commands", "scheduler", "reconciler", "projector"):
        assert f"POOL_{role.upper()}_PASSWORD: ${{POOL_{role.upper()}_PASSWORD:?" in text
    for user in ("pool-service", "pool-admin", "pool-guard", "node-agent-1", "node-agent-2"):
        assert f"POOL_NATS_USER: {user}" in text


def test_the_image_holds_every_package_the_project_installs() -> None:
    """The Dockerfile copies folders one by one: one left out installs without error and
    fails only when a service imports it (gateway/ and sim/ were missing)."""
    include = re.search(r"include = \[([^\]]*)\]", (ROOT / "pyproject.toml").read_text(), re.DOTALL)
    assert include is not None
    packages = {p.strip().strip('"').rstrip("*") for p in include.group(1).split(",") if p.strip()}
    copied = set(re.findall(r"^COPY (\w+) \./\1$", (ROOT / "Dockerfile").read_text(), re.MULTILINE))
    assert packages - copied == set()
