"""compose.yaml, the clustered deployment: the compose CLI accepts it, and it keeps its promises.

Owns checking the file without running it (no images are pulled): `config` where a compose CLI
is installed (the docker plugin or docker-compose), plain text checks everywhere.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
NATS_CONF = ROOT / "deploy" / "nats" / "nats.conf"
SERVICES = {"nats-1", "nats-2", "nats-3", "postgres", "init", "commands-1", "commands-2",
            "scheduler-1", "scheduler-2", "reconciler", "projector", "agent-1", "agent-2"}


def _compose_cli() -> list[str] | None:
    if shutil.which("docker"):
        r = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False,
                           timeout=30)
        if r.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def _config(cli: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*cli, "-f", str(COMPOSE), "config", *args], cwd=ROOT,
                          capture_output=True, text=True, check=False, timeout=120)


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
    assert len(re.findall(r"nats-route://nats-\d:6222", conf)) == 3
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
    assert text.count("privileged: true") == 2  # the agents: bubblewrap needs user namespaces
