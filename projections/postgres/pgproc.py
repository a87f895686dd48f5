"""A private PostgreSQL cluster under a temporary directory (initdb + pg_ctl), on a loopback port.
Fault tests stop, crash and restart it; they must never touch a shared server.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from projections.errors import DatabaseUnavailable
from projections.postgres.embedded import reachable_database_url

# unprivileged users to run as when this process is root, in order of preference
RUN_AS = ("postgres", "pgserver", "nobody")


def postgres_bin() -> Path:
    """The directory holding initdb, pg_ctl and postgres: pgserver's, else the PATH's."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs: XDG_RUNTIME_DIR unset; harmless
            import pgserver

        d = Path(pgserver.__file__).parent / "pginstall" / "bin"
        if (d / "pg_ctl").exists():
            return d
    except ImportError:
        pass
    found = shutil.which("pg_ctl")
    if found is None:
        raise DatabaseUnavailable("no pg_ctl: install pgserver or PostgreSQL")
    return Path(found).resolve().parent


def _traversable(path: Path) -> bool:
    """Whether any user may reach `path`: every directory above it is world-searchable."""
    return all(p.stat().st_mode & 0o001 for p in [path, *path.parents])


def reachable_bin(bindir: Path) -> Path:
    """`bindir` itself when every user can reach it; else a copy of its installation in a
    world-readable cache, made once per installation. A checkout under a 0700 parent (a clone
    under /root) holds pgserver's binaries where the unprivileged user PostgreSQL runs as
    cannot follow; opening up the user's own folders is not ours to do. The copy keeps the
    wheel's layout (pgserver/pginstall beside pgserver.libs), which the binaries' RPATH
    ($ORIGIN/../../../pgserver.libs) needs."""
    if _traversable(bindir):
        return bindir
    install = bindir.parent
    package = install.parent
    libs = package.parent / f"{package.name}.libs"
    st = install.stat()
    root = Path(tempfile.gettempdir()) / f"computepool-pg-{st.st_ino}-{int(st.st_mtime)}"
    if root.exists() and not _ours(root):
        # someone else's folder by our name in a shared /tmp: never run what it holds
        root = Path(tempfile.mkdtemp(prefix="computepool-pg-"))
    found = root / package.name / install.name / "bin"
    if not (found / "pg_ctl").exists():
        staging = Path(tempfile.mkdtemp(prefix="computepool-pg-staging-"))
        shutil.copytree(install, staging / package.name / install.name, symlinks=True)
        if libs.is_dir():
            shutil.copytree(libs, staging / libs.name, symlinks=True)
        for d in (staging, staging / package.name):
            d.chmod(0o755)
        if root.exists():  # our own, empty or half made: fill it in place
            shutil.rmtree(root)
        try:
            staging.rename(root)
        except OSError:  # another process made it first
            shutil.rmtree(staging, ignore_errors=True)
    return found


def _ours(path: Path) -> bool:
    st = path.lstat()
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022 and path.is_dir()


def _run_as() -> pwd.struct_passwd | None:
    if os.geteuid() != 0:
        return None
    for name in RUN_AS:
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise DatabaseUnavailable("running as root and no unprivileged user to run PostgreSQL as")


@dataclass
class PrivatePostgres:
    """One PostgreSQL cluster of our own: `start()`, `crash()` (SIGKILL), `stop()`, `restart()`,
    `destroy()`. Its URL stays the same across restarts."""

    port: int = 0
    base: Path | None = None
    user: pwd.struct_passwd | None = field(default=None, repr=False)
    _owns_base: bool = False

    def __post_init__(self) -> None:
        if self.base is None:
            # its own mkdtemp under /tmp: a pytest tmp_path (0700, root) is not traversable
            self.base = Path(tempfile.mkdtemp(prefix="pool-pg-"))
            self._owns_base = True
        self.base.chmod(0o755)
        self.user = _run_as()
        if not self.port:
            from bus.local.server import free_port

            self.port = free_port()

    @property
    def data_dir(self) -> Path:
        assert self.base is not None
        return self.base / "data"

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _pg(self, tool: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        uid: int | None = None
        gid: int | None = None
        groups: list[int] | None = None
        if self.user is not None:  # drop root for the tool and the server it starts
            uid, gid, groups = self.user.pw_uid, self.user.pw_gid, []
            bindir = reachable_bin(postgres_bin())
        else:
            bindir = postgres_bin()
        return subprocess.run([str(bindir / tool), *args], capture_output=True,
                              text=True, timeout=timeout, cwd="/", check=False,
                              user=uid, group=gid, extra_groups=groups)

    def init(self) -> PrivatePostgres:
        if (self.data_dir / "PG_VERSION").exists():
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.user is not None:
            os.chown(self.data_dir, self.user.pw_uid, self.user.pw_gid)
        self.data_dir.chmod(0o700)
        out = self._pg("initdb", "-D", str(self.data_dir), "-U", "postgres", "--auth=trust",
                       "--encoding=utf8", "--no-sync")
        if out.returncode != 0:
            raise DatabaseUnavailable(f"initdb failed: {out.stderr.strip()[-500:]}")
        return self

    def start(self, timeout: float = 30.0) -> PrivatePostgres:
        self.init()
        if self.running():
            return self
        opts = f"-p {self.port} -h 127.0.0.1 -k {self.data_dir} -c fsync=on"
        out = self._pg("pg_ctl", "-D", str(self.data_dir), "-l", str(self.data_dir / "log"),
                       "-o", opts, "-w", "-t", str(int(timeout)), "start", timeout=timeout + 10)
        if out.returncode != 0:
            raise DatabaseUnavailable(f"pg_ctl start failed: {out.stderr.strip()[-500:]}")
        deadline = time.monotonic() + timeout
        while reachable_database_url(self.url, timeout=1) is None:
            if time.monotonic() > deadline:
                raise DatabaseUnavailable(f"PostgreSQL did not answer on port {self.port}")
            time.sleep(0.1)
        return self

    def pid(self) -> int | None:
        try:
            return int((self.data_dir / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def running(self) -> bool:
        pid = self.pid()
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    def crash(self) -> None:
        """SIGKILL the postmaster and its children: no checkpoint, no clean shutdown."""
        pid = self.pid()
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        # the backends notice their postmaster is gone; wait until the port is free again
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and reachable_database_url(self.url, 1) is not None:
            time.sleep(0.1)
        self._pg("pg_ctl", "-D", str(self.data_dir), "-m", "immediate", "-w", "stop")

    def stop(self, mode: str = "fast") -> None:
        if self.running():
            self._pg("pg_ctl", "-D", str(self.data_dir), "-m", mode, "-w", "stop")

    def restart(self) -> None:
        self.stop()
        self.start()

    def destroy(self) -> None:
        self.stop("immediate")
        if self._owns_base and self.base is not None:
            shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> PrivatePostgres:  # noqa: PYI034 - as NatsServer does
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.destroy()
