"""The embedded default: one machine's NATS and PostgreSQL under $POOL_HOME, with its NATS users.

Files and users: docs/architecture.md#the-embedded-default.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bus.local import auth as bus_auth

if TYPE_CHECKING:  # the servers are loaded only by the start: a tenant's `pool` needs neither
    from bus.caps import Caps
    from bus.connguard import ConnectionGuard
    from bus.local.auth import AuthConfig, Credentials
    from bus.local.server import NatsServer
    from projections.postgres.embedded import EmbeddedPostgres

DEFAULT_NATS_PORT = 14222
AUTH_FILE = "auth.json"
AUTH_INCLUDE = "auth.conf"  # next to the server's configuration in $POOL_HOME/nats
SERVER_NAME = "pool-embedded"  # the server's configuration and log are named after it
INSTANCE_LOCK = "instance.lock"  # held by the one `pool up` of this home for its whole life


class InstanceRunning(Exception):
    """Another process already serves this data directory (one `pool up` per POOL_HOME)."""

    code = "instance_running"


def pool_home() -> Path:
    return Path(os.environ.get("POOL_HOME", "./.pool")).resolve()


@dataclass
class Embedded:
    """The servers of one `pool up`: which were started here and which were found."""

    home: Path
    nats_url: str
    database_url: str
    nats: NatsServer | None = None
    postgres: EmbeddedPostgres | None = None
    notes: list[str] = field(default_factory=list)
    service_url: str = ""  # nats_url with the service user's credentials (or nats_url: no auth)
    responder_url: str = ""  # with the responders' (inboxes only); "" without auth
    role_urls: dict[str, str] = field(default_factory=dict)  # each role's user; {} without auth
    # the server's companion, holding each tenant's and node's user to its caps (ADR 023, 028);
    # None without auth
    guard: ConnectionGuard | None = None
    caps: Caps | None = None
    node_caps: Caps | None = None
    auth_mtime: float = 0.0
    lock_fd: int | None = None  # the instance lock, released last by stop()

    @property
    def secured(self) -> bool:
        return self.nats is not None

    def reload_if_changed(self) -> bool:
        """Apply auth.json to the running server if it changed since the last look; whether
        the server was reloaded."""
        path = self.home / AUTH_FILE
        if self.nats is None or not path.exists():
            return False
        mtime = path.stat().st_mtime
        if mtime == self.auth_mtime:
            return False
        self.auth_mtime = mtime
        with _auth_lock(self.home):
            rewritten = _render_include(self.home)
        # a reload the CLI already made (it rendered the same file) is not made twice: nats-server
        # drops every connection still in its handshake at a reload with "Authorization Violation"
        if not rewritten or self.nats.proc is None or self.nats.proc.poll() is not None:
            return False
        self.nats.reload(rewritten)
        return True

    def stop(self) -> None:
        if self.guard is not None:
            self.guard.stop()
            self.guard = None
        if self.nats is not None:
            self.nats.stop()
            self.nats = None
        if self.postgres is not None:
            self.postgres.stop()
            self.postgres = None
        endpoints = self.home / "endpoints.json"
        if endpoints.exists():
            endpoints.unlink()
        if self.lock_fd is not None:
            release_instance_lock(self.lock_fd)
            self.lock_fd = None

    def write_endpoints(self) -> Path:
        path = self.home / "endpoints.json"
        data: dict[str, object] = {
            "nats_url": self.nats_url,
            "service_url": self.service_url or self.nats_url,
            "responder_url": self.responder_url,
            "role_urls": self.role_urls,
            "database_url": self.database_url,
            "pid": os.getpid(),
            "auth": self.secured,
        }
        if self.nats is not None and self.nats.proc is not None:
            data["nats_pid"] = self.nats.proc.pid
        # the service URL carries a password: owner-only, like auth.json
        bus_auth.write_private(path, json.dumps(data, indent=2) + "\n")
        return path


def hold_instance_lock(home: Path) -> int:
    """Take `home`'s instance lock for as long as the returned descriptor stays open; raise
    InstanceRunning, naming the holder, when another process has it. Nothing else is touched."""
    home.mkdir(parents=True, exist_ok=True)
    fd = os.open(home / INSTANCE_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _lock_holder(fd)
        os.close(fd)
        raise InstanceRunning(f"{home} is in use by {holder}; stop it first (one `pool up` "
                              "per POOL_HOME)") from None
    os.ftruncate(fd, 0)
    os.write(fd, (json.dumps({"pid": os.getpid(), "started_at": time.time(),
                              "command": " ".join(["pool", *sys.argv[1:]])}) + "\n").encode())
    return fd


def release_instance_lock(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _lock_holder(fd: int) -> str:
    """Who holds the lock, from what it wrote into the file: 'pid N (`pool up …`, since T)'."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 4096) or b"{}")
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(info["started_at"])))
        return f"pid {int(info['pid'])} (`{info['command']}`, since {since})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"  # it holds the lock but has not written its name yet


def start(home: Path | None = None, *, with_postgres: bool = True) -> Embedded:
    """Start (or find) NATS and PostgreSQL for this machine; data stays under `home`.

    The first thing taken is the instance lock: a second start on the same home raises
    InstanceRunning before it reads or writes anything there."""
    home = home or pool_home()
    lock_fd = hold_instance_lock(home)
    try:
        emb = _start(home, with_postgres=with_postgres)
    except BaseException:
        release_instance_lock(lock_fd)
        raise
    emb.lock_fd = lock_fd
    return emb


def _start(home: Path, *, with_postgres: bool) -> Embedded:
    from bus.caps import Caps
    from bus.connguard import ConnectionGuard, user_caps
    from bus.local.accounts import adopt_global_store
    from bus.local.server import NatsServer, free_port

    # a bad cap is refused before anything starts
    caps, node_caps = Caps.from_env(), Caps.nodes_from_env()
    nats_url = os.environ.get("POOL_NATS_URL")
    server: NatsServer | None = None
    notes: list[str] = []
    service_url = responder_url = ""
    roles: dict[str, str] = {}
    if nats_url:
        notes.append(f"nats: using {nats_url} (POOL_NATS_URL)")
    else:
        port = int(os.environ.get("POOL_NATS_PORT", DEFAULT_NATS_PORT))
        with _auth_lock(home):
            auth = bus_auth.load_or_create(home / AUTH_FILE)
            # this start's caps, for every later render too
            if (auth.tenant_caps, auth.node_caps) != (caps, node_caps):
                auth.tenant_caps, auth.node_caps = caps, node_caps
                bus_auth.save(auth, home / AUTH_FILE)
            _render_include(home, auth)
        include = f'include "{AUTH_INCLUDE}"'
        # a home from before tenants had accounts of their own: its streams go to POOL's
        adopt_global_store(home / "nats" / "jetstream")
        try:
            server = NatsServer(store_dir=home / "nats", port=port, server_name=SERVER_NAME,
                                extra_config=include)
            server.start()
        except Exception:  # noqa: BLE001 - whatever failed there, a free port is tried next
            # the preferred port is taken by something that is not ours: take a free one
            server = NatsServer(store_dir=home / "nats", port=free_port(), server_name=SERVER_NAME,
                                extra_config=include)
            server.start()
        nats_url = server.url
        service_url = bus_auth.url_with_credentials(nats_url, auth.service)
        responder_url = bus_auth.url_with_credentials(nats_url, auth.responder)
        roles = bus_auth.role_urls(nats_url, auth)
        notes.append(f"nats: {nats_url} (embedded nats-server 2.15, JetStream in {home / 'nats'})")
        notes.append(f"auth: users required; service user {auth.service.user!r}, "
                     f"{len(auth.tenants)} tenant(s), {len(auth.nodes)} node(s) in "
                     f"{home / AUTH_FILE} (add with `pool admin tenant creds TENANT`)")
    from projections.postgres.embedded import reachable_database_url, start_embedded_postgres

    database_url = os.environ.get("POOL_DATABASE_URL", "")
    pg: EmbeddedPostgres | None = None
    if database_url:
        if reachable_database_url(database_url) is None:
            if server is not None:
                server.stop()
            from projections.errors import DatabaseUnavailable

            raise DatabaseUnavailable(f"POOL_DATABASE_URL={bus_auth.redact(database_url)} "
                                      "does not answer")
        notes.append(f"postgres: using {bus_auth.redact(database_url)} (POOL_DATABASE_URL)")
    elif with_postgres:
        try:
            pg = start_embedded_postgres(home / "pg")
        except Exception:
            if server is not None:
                server.stop()
            raise
        database_url = pg.url
        notes.append(f"postgres: {bus_auth.redact(database_url)} (embedded pgserver, data in "
                     f"{home / 'pg'}; password in {home / 'pg.password'}, mode 0600)")
    emb = Embedded(home, nats_url, database_url, server, pg, notes)
    if server is not None:
        emb.caps, emb.node_caps = caps, node_caps
        emb.guard = ConnectionGuard(bus_auth.guard_url(nats_url, auth),
                                    user_caps(caps, node_caps))
        try:
            emb.guard.start()
        except Exception:
            emb.guard = None
            emb.stop()
            raise
        notes.append(f"limits: {caps.describe()}; {node_caps.describe('node')}; past them a "
                     "connection is closed by the connection guard")
        emb.service_url = service_url
        emb.responder_url = responder_url
        emb.role_urls = roles
        emb.auth_mtime = (home / AUTH_FILE).stat().st_mtime
    emb.write_endpoints()
    return emb


def endpoints(home: Path | None = None) -> tuple[str, str]:
    """NATS and database URLs for a client command: env first, then a running `pool up`."""
    home = home or pool_home()
    nats_url = os.environ.get("POOL_NATS_URL", "")
    db_url = os.environ.get("POOL_DATABASE_URL", "")
    path = home / "endpoints.json"
    if (not nats_url or not db_url) and path.exists():
        data = json.loads(path.read_text())
        nats_url = nats_url or data.get("nats_url", "")
        db_url = db_url or data.get("database_url", "")
    return nats_url, db_url


# -- credentials for the commands of this machine ------------------------------------------


def _read_endpoints(home: Path) -> dict[str, object]:
    path = home / "endpoints.json"
    if not path.exists():
        return {}
    data: dict[str, object] = json.loads(path.read_text())
    return data


def responder_url(home: Path | None = None) -> str:
    """The command responders' URL of a local `pool up` ("" with POOL_NATS_URL or no auth)."""
    if os.environ.get("POOL_NATS_URL"):
        return ""
    return str(_read_endpoints(home or pool_home()).get("responder_url") or "")


def role_urls(home: Path | None = None) -> dict[str, str]:
    """Each control-plane role's URL of a local `pool up` ({} with POOL_NATS_URL or no auth)."""
    if os.environ.get("POOL_NATS_URL"):
        return {}
    urls = _read_endpoints(home or pool_home()).get("role_urls") or {}
    assert isinstance(urls, dict)
    return {str(k): str(v) for k, v in urls.items()}


def admin_url(home: Path | None = None) -> str:
    """The URL the admin CLI speaks as: its own user on a local `pool up`, else service_url."""
    return role_urls(home).get("admin") or service_url(home)


def service_url(home: Path | None = None) -> str:
    """The URL admin commands use: POOL_NATS_URL as given, else the local service's (with creds)."""
    home = home or pool_home()
    env = os.environ.get("POOL_NATS_URL", "")
    if env:
        return env
    data = _read_endpoints(home)
    return str(data.get("service_url") or data.get("nats_url") or "")


def local_auth(home: Path | None = None) -> AuthConfig | None:
    """The users of a `pool up` on this machine, or None (no embedded pool, or an external NATS)."""
    home = home or pool_home()
    if os.environ.get("POOL_NATS_URL"):
        return None
    return bus_auth.load(home / AUTH_FILE)


def tenant_credentials(tenant: str, home: Path | None = None) -> Credentials | None:
    auth = local_auth(home)
    return None if auth is None else auth.tenants.get(bus_auth.checked_name("tenant", tenant))


@contextlib.contextmanager
def _auth_lock(home: Path) -> Iterator[None]:
    home.mkdir(parents=True, exist_ok=True)
    fd = os.open(home / ".auth.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _render_include(home: Path, auth: AuthConfig | None = None) -> int:
    """Write the server's accounts and users from auth.json; how many reloads apply them
    (0: the file is unchanged)."""
    auth = auth or bus_auth.load(home / AUTH_FILE)
    if auth is None:
        return 0
    return bus_auth.write_server_include(auth, home / "nats" / AUTH_INCLUDE)


def _reload_running_server(home: Path, *, reload: int = 1) -> int | None:
    """SIGHUP the embedded nats-server recorded in endpoints.json `reload` times (only look,
    with 0); its pid, or None if none runs."""
    pid = _read_endpoints(home).get("nats_pid")
    if not isinstance(pid, int):
        return None
    cmdline = Path(f"/proc/{pid}/cmdline")
    try:
        if cmdline.parent.parent.is_dir() and b"nats-server" not in cmdline.read_bytes():
            return None  # a stale endpoints.json: that pid is someone else's now
    except OSError:
        return None  # gone
    from bus.local.server import reload_server

    try:
        os.kill(pid, 0)
        if reload:
            reload_server(pid, home / "nats" / f"{SERVER_NAME}.log", reload)
    except ProcessLookupError:
        return None
    return pid


def _wait_usable(home: Path, creds: Credentials, timeout: float = 10.0) -> None:
    from bus.admin import can_connect

    url = str(_read_endpoints(home).get("nats_url") or "")
    if not url:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if can_connect(url, user=creds.user, password=creds.password):
            return
        time.sleep(0.1)
    raise RuntimeError(f"the embedded nats-server did not accept user {creds.user!r} after reload")


def _add_user(kind: str, name: str, home: Path | None, rotate: bool) -> Credentials:
    home = home or pool_home()
    if os.environ.get("POOL_NATS_URL"):
        raise RuntimeError("POOL_NATS_URL names an external NATS server: its users are managed "
                           "there, not by this machine's auth.json")
    path = home / AUTH_FILE
    if not path.exists():
        raise RuntimeError(f"no {path}: run `pool up` first (it creates the service user)")
    with _auth_lock(home):
        auth = bus_auth.load(path)
        if auth is None:
            raise RuntimeError(f"no {path}: run `pool up` first (it creates the service user)")
        users = auth.tenants if kind == "tenant" else auth.nodes
        # another spelling of an existing name must not be handed that name's user
        creds = users.get(bus_auth.checked_name(kind, name))
        changed = creds is None or rotate
        rewritten = 0
        if changed:
            creds = auth.add_tenant(name) if kind == "tenant" else auth.add_node(name)
            bus_auth.save(auth, path)
            rewritten = _render_include(home, auth)
    assert creds is not None
    # `pool up` may have rendered the same file first and reloaded the server itself
    running = _reload_running_server(home, reload=rewritten if changed else 0) is not None
    if changed and running:
        _wait_usable(home, creds)
    if kind == "tenant" and running:
        # its file buckets and telemetry stream, made by the operator (a tenant may not
        # configure a stream)
        from bus.objects import ensure_tenant_buckets_sync
        from bus.telemetry_streams import ensure_tenant_telemetry_sync

        ensure_tenant_buckets_sync(service_url(home), [name])
        ensure_tenant_telemetry_sync(service_url(home), [name])
    return creds


def add_tenant(tenant: str, home: Path | None = None, *, rotate: bool = False) -> Credentials:
    """The tenant's user (created, saved and loaded into a running `pool up` if new)."""
    return _add_user("tenant", tenant, home, rotate)


def add_node(node_id: str, home: Path | None = None, *, rotate: bool = False) -> Credentials:
    """The node agent's user, like `add_tenant`."""
    return _add_user("node", node_id, home, rotate)
