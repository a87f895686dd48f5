"""The route include `pool cluster auth` writes (deploy/nats/cluster.conf) keeps a server that
lacks its password out of the cluster, on real nats-servers on loopback."""

from __future__ import annotations

import json
import stat
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bus.local.server import free_port, nats_server_binary
from local.compose_secrets import route_include


class _Server:
    """One nats-server on loopback whose cluster block includes `routes_conf` as
    deploy/nats/nats.conf includes cluster.conf."""

    def __init__(self, base: Path, name: str, routes_conf: str,
                 cluster_port: int | None = None, cluster: str = "pool") -> None:
        self.name = name
        self.cluster_port, self.http_port = cluster_port or free_port(), free_port()
        folder = base / name
        folder.mkdir()
        (folder / "cluster.conf").write_text(routes_conf)
        (folder / "nats.conf").write_text(
            f"server_name: {name}\nlisten: 127.0.0.1:{free_port()}\n"
            f"http: 127.0.0.1:{self.http_port}\n"
            f"cluster {{\n  name: {cluster}\n  listen: 127.0.0.1:{self.cluster_port}\n"
            '  include "cluster.conf"\n}\n')
        self.log = folder / "log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([nats_server_binary(), "-c", str(folder / "nats.conf")],
                                         stdout=out, stderr=subprocess.STDOUT)

    def monitor(self, path: str) -> dict[str, Any]:
        deadline = time.monotonic() + 10
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/{path}",
                                            timeout=2) as r:
                    data: dict[str, Any] = json.loads(r.read())
                    return data
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def peers(self) -> set[str]:
        return {r.get("remote_name") or r["remote_id"] for r in self.monitor("routez")["routes"]}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture()
def servers(tmp_path: Path) -> Iterator[list[_Server]]:
    made: list[_Server] = []
    yield made
    for s in made:
        s.stop()


def _wait(check: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_a_server_without_the_route_password_is_kept_out_of_the_cluster(
    tmp_path: Path, servers: list[_Server],
) -> None:
    ports = [free_port(), free_port()]  # the two members' routes name each other
    members = [f"127.0.0.1:{p}" for p in ports]
    conf = route_include("the-route-password", members)
    servers += [_Server(tmp_path, "a", conf, ports[0]), _Server(tmp_path, "b", conf, ports[1])]
    a, b = servers
    assert _wait(lambda: "b" in a.peers() and "a" in b.peers(), 15), a.log.read_text()[-2000:]

    def refused() -> int:
        return sum(s.log.read_text().lower().count("router connection closed: authentication "
                                                   "failure") for s in (a, b))

    # one that dials them with the routes' user but not its password, and one with no user
    for name, creds in (("wrong", "pool-route:guessed@"), ("none", "")):
        before = refused()
        intruder = _Server(tmp_path, name, "routes: [\n" + "".join(
            f'  "nats-route://{creds}{m}"\n' for m in members) + "]\n")
        servers.append(intruder)
        time.sleep(3)  # several dial attempts (nats-server retries a route every second)
        assert name not in a.peers() and name not in b.peers()
        assert intruder.peers() == set()
        assert refused() >= before + 2  # each member turned it away


@pytest.mark.timeout(120)
def test_pool_cluster_ups_servers_route_only_with_their_password(
    tmp_path: Path, servers: list[_Server],
) -> None:
    from bus.local import auth as bus_auth
    from bus.local.cluster import NatsCluster

    auth = bus_auth.load_or_create(tmp_path / "auth.json")
    with NatsCluster(tmp_path / "cluster", nodes=3, auth=auth, cluster_name="routes") as c:
        secret = (tmp_path / "cluster" / "route.password").read_text().strip()
        assert stat.S_IMODE((tmp_path / "cluster" / "route.password").stat().st_mode) == 0o600
        for s in c.servers:  # the configuration holds the password: owner-only
            assert stat.S_IMODE(s.config_path.stat().st_mode) == 0o600
            assert secret in s.config_path.read_text()
        member = c.servers[0]
        before = member.log_path.read_text().lower().count("authentication failure")
        intruder = _Server(tmp_path, "intruder",
                           f'routes: ["nats-route://{member.host}:{member.cluster_port}"]\n',
                           cluster="routes")
        servers.append(intruder)
        time.sleep(3)
        assert intruder.peers() == set()
        assert member.log_path.read_text().lower().count("authentication failure") > before
        # the members still route to each other after one restarts with the same password
        c.restart(1)
        assert c.meta_leader() is not None
