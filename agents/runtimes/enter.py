"""Entering a running bubblewrap sandbox: a command in its namespaces, user, root and cgroup
(`pool lease exec`), and TCP connections made inside its network namespace (port-forward)."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import socket
import threading
from pathlib import Path

from agents.runtimes.contract import WorkloadError

# the namespaces nsenter joins, by its flags; the user namespace first (it grants the rest)
NAMESPACES = (("user", "--user"), ("mnt", "--mount"), ("uts", "--uts"), ("ipc", "--ipc"),
              ("net", "--net"), ("pid", "--pid"), ("cgroup", "--cgroup"))
SANDBOX_UID = 65534  # the uid and gid the job runs as inside its sandbox (process runtime)
_CLONE_NEWNET = 0x40000000
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")
_FALLBACK_ENV = ("PATH=/usr/local/bin:/usr/bin:/bin", "HOME=/tmp")


class EntryRefused(WorkloadError):
    """The sandbox cannot be entered (gone, replaced, or entering is not possible here)."""

    code = "exec_unavailable"


def _stat_fields(pid: int) -> list[str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def _start_ticks(pid: int) -> str | None:
    f = _stat_fields(pid)
    return None if f is None else f[19]


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def sandbox_init(supervisor: int) -> int:
    """The sandbox's own pid 1 under the job's supervisor (supervisor → bwrap → pid 1): the
    process whose namespaces are the job's for as long as the sandbox lives."""
    own = os.readlink("/proc/self/ns/pid")
    todo, seen = [supervisor], 0
    while todo and seen < 64:
        pid = todo.pop(0)
        seen += 1
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") != own:
                return pid
        except OSError:
            continue
        todo += _children(pid)
    raise EntryRefused("the job's sandbox is not running")


class SandboxEntry:
    """Open handles on one sandbox's namespaces, root and working directory, taken from its
    pid 1 and checked to still be that process after they were opened (a pid reused in between
    cannot lead elsewhere). `close()` when done."""

    def __init__(self, supervisor: int, supervisor_ticks: str | None,
                 cgroup_procs: list[str] | tuple[str, ...] = ()) -> None:
        if supervisor_ticks is not None and _start_ticks(supervisor) != supervisor_ticks:
            raise EntryRefused("the job's sandbox is not running")
        pid = sandbox_init(supervisor)
        ticks = _start_ticks(pid)
        self.cgroup_procs = tuple(cgroup_procs)
        self.fds: dict[str, int] = {}
        try:
            for name, _ in NAMESPACES:
                self.fds[name] = os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC)
            self.fds["root"] = os.open(f"/proc/{pid}/root", os.O_RDONLY | os.O_DIRECTORY
                                       | os.O_CLOEXEC)
        except OSError as e:
            self.close()
            raise EntryRefused(f"cannot open the sandbox's namespaces: {e.strerror}") from e
        if ticks is None or _start_ticks(pid) != ticks or sandbox_init(supervisor) != pid:
            self.close()
            raise EntryRefused("the job's sandbox ended while it was being entered")
        self.pid = pid
        self.env = _job_env(pid)

    def close(self) -> None:
        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = {}

    def pass_fds(self) -> tuple[int, ...]:
        return tuple(self.fds.values())

    def argv(self, command: list[str] | tuple[str, ...], *, tty: bool = False) -> list[str]:
        """nsenter into every namespace as the job's user, in its root at /work or /tmp, with
        the job's environment; with `tty`, through `script` so the terminal is the sandbox's
        own /dev/pts (the host's pty is not there)."""
        nsenter = shutil.which("nsenter")
        if nsenter is None:
            raise EntryRefused("nsenter (util-linux) is not installed on this node")
        args = [nsenter]
        for name, flag in NAMESPACES:
            args.append(f"{flag}=/proc/self/fd/{self.fds[name]}")
        root = f"/proc/self/fd/{self.fds['root']}"
        args += [f"--root={root}", f"--wd={root}{self._workdir()}",
                 f"--setuid={SANDBOX_UID}", f"--setgid={SANDBOX_UID}", "--",
                 "/usr/bin/env", "-i", "--", *self.env, "TERM=" + ("xterm" if tty else "dumb")]
        if tty:
            # script copies the terminal's settings and size to a pty of the sandbox's devpts,
            # and passes resizes on; -e: the command's exit code
            import shlex

            return [*args, "script", "-q", "-e", "-c", shlex.join(command), "/dev/null"]
        return [*args, *command]

    def _workdir(self) -> str:
        root = f"/proc/self/fd/{self.fds['root']}"
        return "/work" if os.path.isdir(f"{root}/work") else "/tmp"

    def preexec(self) -> None:
        """In the child, before exec: join the job's cgroups (its limits count the session
        too) and never gain privileges. Only os calls: it runs between fork and exec."""
        pid = str(os.getpid()).encode()
        for p in self.cgroup_procs:
            fd = os.open(p, os.O_WRONLY)
            try:
                os.write(fd, pid)
            finally:
                os.close(fd)
        _no_new_privs()

    def connect(self, port: int, timeout: float = 5.0) -> socket.socket:
        """A TCP connection to 127.0.0.1:`port` inside the sandbox's network namespace (made
        on a thread of its own that joins the namespace and ends: the agent's threads stay in
        the host's). Raises OSError when nothing listens there."""
        out: list[socket.socket | BaseException] = []

        def inside() -> None:
            try:
                _setns(self.fds["net"], _CLONE_NEWNET)
                s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
                s.settimeout(None)
                out.append(s)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                out.append(e)

        t = threading.Thread(target=inside, name="sandbox-connect", daemon=True)
        t.start()
        t.join(timeout + 1)
        if not out:
            raise OSError("connecting inside the sandbox timed out")
        got = out[0]
        if isinstance(got, BaseException):
            raise got if isinstance(got, OSError) else OSError(str(got))
        return got


def _job_env(init: int) -> tuple[str, ...]:
    """The environment the job was started with (its first process's), as NAME=VALUE words
    for `env -i`; the minimal one when it cannot be read. What comes from the job goes back
    only into its own sandbox, so a changed one can harm nothing else."""
    for pid in _children(init)[:1]:
        try:
            raw = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            break
        words = []
        for item in raw.split(b"\0"):
            text = item.decode(errors="replace")
            key, eq, _ = text.partition("=")
            if eq and _ENV_KEY.match(key):
                words.append(text)
        if words:
            return tuple(words[:1024])
    return _FALLBACK_ENV


_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _setns(fd: int, nstype: int) -> None:
    if _lib().setns(fd, nstype) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _no_new_privs() -> None:
    _lib().prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
