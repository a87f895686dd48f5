"""The clustered topology on one machine: N nats-servers from the wheel as one JetStream cluster.
Ports, store dirs, routes, users and readiness; loopback only (docs/operations.md).
"""

from __future__ import annotations

import json
import secrets
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Self

from bus.errors import BusUnavailable
from bus.local.auth import AuthConfig, url_with_credentials, write_private, write_server_include
from bus.local.server import NatsServer, free_port

DEFAULT_CLUSTER_NAME = "pool-cluster"
ROUTE_USER = "pool-route"
ROUTE_PASSWORD_FILE = "route.password"


def route_password(store_root: Path) -> str:
    """The routes' password of the cluster under `store_root`: made once into
    `route.password` (mode 0600) and kept, so restarted servers still route to each other."""
    path = store_root / ROUTE_PASSWORD_FILE
    if not path.exists():
        write_private(path, secrets.token_urlsafe(32) + "\n")
    return path.read_text().strip()


def _get_json(url: str, timeout: float = 1.0) -> tuple[int, dict[str, Any]]:
    """Status and JSON body of a monitoring endpoint (healthz answers 503 with a body)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # loopback monitoring only
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {}


class NatsCluster:
    """`nodes` nats-servers under `store_root/n<i>`, fixed loopback ports, `sync_interval: always`.

    Ports are chosen once, so a server restarted after `kill(i)` rejoins at the same addresses.
    """

    def __init__(self, store_root: Path, nodes: int = 3, *, host: str = "127.0.0.1",
                 cluster_name: str = DEFAULT_CLUSTER_NAME,
                 ports: list[int] | None = None, auth: AuthConfig | None = None) -> None:
        if nodes < 1:
            raise ValueError("a cluster needs at least one server")
        self.store_root = Path(store_root)
        self.cluster_name = cluster_name
        # with `auth`, every server requires its users (each server's own copy of auth.conf)
        self.auth = auth
        self._host, self._fixed_ports = host, ports
        self._extra = 'include "auth.conf"' if auth is not None else ""
        # with users, the routes too need a password: a local process dialling a cluster port
        # would otherwise join, take stream replicas and read the log
        self._route_password = route_password(self.store_root) if auth is not None else ""
        if ports is not None and len(ports) != nodes:
            raise ValueError("one client port per server")
        self.servers: list[NatsServer] = self._servers(nodes)

    def _servers(self, nodes: int) -> list[NatsServer]:
        """The servers at freshly chosen loopback ports (the client ports given, if any)."""
        host, cluster_name = self._host, self.cluster_name
        client_ports = self._fixed_ports or [free_port(host) for _ in range(nodes)]
        cluster_ports = [free_port(host) for _ in range(nodes)]
        creds = f"{ROUTE_USER}:{self._route_password}@" if self._route_password else ""
        routes = [f"nats-route://{creds}{host}:{p}" for p in cluster_ports]
        return [
            NatsServer(
                store_dir=self.store_root / f"n{i + 1}",
                port=client_ports[i],
                host=host,
                server_name=f"{cluster_name}-n{i + 1}",
                sync_always=True,
                cluster_name=cluster_name,
                cluster_port=cluster_ports[i],
                routes=[r for j, r in enumerate(routes) if j != i],
                route_user=ROUTE_USER if self._route_password else "",
                route_password=self._route_password,
                http_port=free_port(host),
                extra_config=self._extra,
            )
            for i in range(nodes)
        ]

    # -- addresses ---------------------------------------------------------------------------

    @property
    def urls(self) -> list[str]:
        """Every server's client URL, in server order."""
        return [s.url for s in self.servers]

    @property
    def url(self) -> str:
        """All client URLs as one comma-separated string (POOL_NATS_URL, NATS_URL)."""
        return ",".join(self.urls)

    @property
    def service_url(self) -> str:
        """`url` with the operator's credentials (just `url` without users)."""
        return self.url if self.auth is None else url_with_credentials(self.url, self.auth.service)

    def running(self) -> list[int]:
        """Indices of the servers whose process is alive."""
        return [i for i, s in enumerate(self.servers)
                if s.proc is not None and s.proc.poll() is None]

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float = 30.0, *, tries: int = 3) -> Self:
        """Start every server, then wait for a meta leader with all peers current. A port
        taken between its choice and the server's bind (another process's, on a busy machine)
        makes a server exit at start: the first start then tries again on new ports."""
        for attempt in range(tries):
            try:
                for s in self.servers:
                    if self.auth is not None:
                        write_server_include(self.auth, s.store_dir / "auth.conf")
                    s.start()
                self.wait_ready(timeout)
                if len(self.running()) < len(self.servers):
                    # the others are healthy without it: a quorum needs no third server
                    raise BusUnavailable("a server of the cluster exited as it started")
                return self
            except BusUnavailable:
                self.stop()
                if attempt + 1 == tries or not self._port_was_taken():
                    raise
                self.servers = self._servers(len(self.servers))
            except BaseException:
                self.stop()
                raise
        return self

    def _port_was_taken(self) -> bool:
        """Whether a server's log says one of its ports was already in use."""
        for s in self.servers:
            try:
                if b"address already in use" in s.log_path.read_bytes():
                    return True
            except OSError:
                continue
        return False

    def stop(self) -> None:
        for s in self.servers:
            s.stop()

    def kill(self, i: int) -> None:
        """SIGKILL server `i`: no clean shutdown, no flush (its acknowledged writes are on disk)."""
        self.servers[i].kill()

    def restart(self, i: int, *, wait: bool = True, timeout: float = 30.0) -> None:
        """Start server `i` again (after `kill` or `stop`) at the same addresses and store."""
        self.servers[i].stop()
        self.servers[i].start()
        if wait:
            self.wait_ready(timeout)

    # -- readiness ---------------------------------------------------------------------------

    def meta_leader(self) -> str | None:
        """The JetStream meta leader's server name as a running server sees it, or None."""
        for i in self.running():
            s = self.servers[i]
            try:
                _, jsz = _get_json(f"http://{s.host}:{s.http_port}/jsz")
            except (OSError, ValueError):
                continue
            leader = (jsz.get("meta_cluster") or {}).get("leader")
            if leader:
                return str(leader)
        return None

    def stream_leader(self, stream: str) -> int | None:
        """Index of the server leading `stream`'s replica group, or None while there is none."""
        names = [s.server_name for s in self.servers]
        for i in self.running():
            s = self.servers[i]
            try:
                _, jsz = _get_json(f"http://{s.host}:{s.http_port}/jsz?accounts=true&streams=true")
            except (OSError, ValueError):
                continue
            for account in jsz.get("account_details") or []:
                for detail in account.get("stream_detail") or []:
                    if detail.get("name") == stream:
                        leader = (detail.get("cluster") or {}).get("leader")
                        if leader in names:
                            return names.index(leader)
        return None

    def healthy(self) -> tuple[bool, str]:
        """Whether every running server is healthy and agrees on one meta leader, and that
        leader sees every running follower as current; why not, if not."""
        running = self.running()
        if not running:
            return False, "no server running"
        names = {self.servers[i].server_name for i in running}
        leaders: set[str] = set()
        views: dict[str, dict[str, Any]] = {}
        for i in running:
            s = self.servers[i]
            try:
                status, body = _get_json(f"http://{s.host}:{s.http_port}/healthz")
                if status != 200:
                    return False, f"{s.server_name}: {body.get('error') or status}"
                _, jsz = _get_json(f"http://{s.host}:{s.http_port}/jsz")
            except (OSError, ValueError) as e:
                return False, f"{s.server_name}: monitoring endpoint: {e}"
            meta = jsz.get("meta_cluster") or {}
            if not meta.get("leader"):
                return False, f"{s.server_name}: no meta leader yet"
            leaders.add(str(meta["leader"]))
            views[s.server_name] = meta
        if len(leaders) != 1:
            return False, f"servers disagree on the meta leader: {sorted(leaders)}"
        leader = leaders.pop()
        if leader not in views:
            return False, f"meta leader {leader} is not a running server"
        # only the leader's view of its followers is meaningful (a follower reports the others
        # as not current, whatever their state)
        peers = views[leader].get("replicas") or []
        for peer in peers:
            if peer.get("name") in names and not peer.get("current"):
                return False, f"{peer.get('name')} is not current with the meta leader"
        # a server the leader does not list yet is no peer for placement: an R3 stream created
        # then is refused ("no suitable peers for placement")
        missing = names - {leader} - {str(p.get("name")) for p in peers}
        if missing:
            return False, f"meta leader {leader} does not list {sorted(missing)} as peers yet"
        return True, f"meta leader {leader}"

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until `healthy()`; BusUnavailable with the last reason after `timeout`."""
        deadline = time.monotonic() + timeout
        why = "not checked"
        while time.monotonic() < deadline:
            ok, why = self.healthy()
            if ok:
                return
            time.sleep(0.25)  # each failed healthz is a warning in the server's log
        raise BusUnavailable(f"NATS cluster not ready within {timeout}s: {why}")

    # -- streams -----------------------------------------------------------------------------

    def ensure_streams(self, replicas: int = 3, timeout: float = 30.0) -> None:
        """Every stream the system uses (events, snapshots, agent work queue, schedules,
        telemetry) at `replicas`, retried while a new stream leader is being elected; returns
        once every replica is current (healthz checks streams and consumers too)."""
        from bus.admin import ensure_all_streams

        replicas = min(replicas, len(self.servers))
        deadline = time.monotonic() + timeout
        while True:
            try:
                ensure_all_streams(self.service_url, replicas=replicas)
                break
            except Exception as e:
                if time.monotonic() >= deadline:
                    _, why = self.healthy()
                    raise BusUnavailable(f"streams not created at R{replicas} within {timeout}s: "
                                         f"{e} (cluster: {why})") from e
                time.sleep(0.5)
        self.wait_ready(max(1.0, deadline - time.monotonic()))

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
