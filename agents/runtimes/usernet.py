"""Egress for a sandbox through a user-mode network stack (slirp4netns), never the host's own
network namespace: the host's loopback (embedded NATS, PostgreSQL) stays out of reach."""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import time

from agents.runtimes import egress
from agents.runtimes.contract import WorkloadError

_TIMEOUT_S = 10.0


def available() -> str | None:
    """The slirp4netns binary when a sandbox can be given egress here (slirp4netns, and a
    network namespace we may create), else None."""
    slirp, unshare = shutil.which("slirp4netns"), shutil.which("unshare")
    if slirp is None or unshare is None:
        return None
    try:
        r = subprocess.run([unshare, "--net", "--", "/bin/true"], capture_output=True,
                           timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return slirp if r.returncode == 0 else None


class Wiring:
    """One sandbox's network: its supervisor starts in a network namespace of its own (`prefix`),
    which bwrap keeps (`bwrap_args`) and holds the command on `block_r` until slirp4netns is
    attached; the supervisor keeps `exit_w`, so slirp4netns ends when the sandbox does."""

    def __init__(self) -> None:
        self.block_r, self.block_w = os.pipe()
        self.exit_r, self.exit_w = os.pipe()

    @staticmethod
    def prefix() -> list[str]:
        return [shutil.which("unshare") or "unshare", "--net", "--"]

    def bwrap_args(self) -> list[str]:
        # --share-net keeps the supervisor's fresh namespace, not the host's
        return ["--share-net", "--block-fd", str(self.block_r)]

    def child_fds(self) -> tuple[int, ...]:
        return (self.block_r, self.exit_w)

    def connect(self, slirp: str, pid: int,
                filter_rules: tuple[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Once the supervisor `pid` runs: load `filter_rules` (iptables-restore and its
        input: agents/runtimes/egress.py) into its namespace, attach slirp4netns to it (no
        route to the host's loopback), wait until it is up, then let the command run. Raises
        WorkloadError (code egress_failed) when it cannot; the sandbox then must be killed."""
        for fd in self.child_fds():
            os.close(fd)
        try:
            _wait_own_namespace(pid)
            if filter_rules is not None:  # before any packet can leave
                egress.install(filter_rules[0], pid, filter_rules[1])
            ready_r, ready_w = os.pipe()
            try:
                net = subprocess.Popen(
                    [slirp, "--configure", "--disable-host-loopback", "--mtu", "65520",
                     "--exit-fd", str(self.exit_r), "--ready-fd", str(ready_w), str(pid),
                     "tap0"],
                    pass_fds=(self.exit_r, ready_w), stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    start_new_session=True)
            finally:
                os.close(ready_w)
            try:
                if _read(ready_r, _TIMEOUT_S) != b"1":
                    net.kill()
                    net.wait()
                    raise WorkloadError("the sandbox's network did not come up",
                                        code="egress_failed")
            finally:
                os.close(ready_r)
            os.write(self.block_w, b"1")
            return net
        finally:
            for fd in (self.block_w, self.exit_r):
                os.close(fd)

    def abandon(self) -> None:
        """Close everything (the sandbox could not be started)."""
        for fd in (self.block_r, self.block_w, self.exit_r, self.exit_w):
            try:
                os.close(fd)
            except OSError:
                pass


def _wait_own_namespace(pid: int) -> None:
    """Until `pid` left our network namespace: attaching before would give the host a tap."""
    ours = os.readlink("/proc/self/ns/net")
    deadline = time.monotonic() + _TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if os.readlink(f"/proc/{pid}/ns/net") != ours:
                return
        except OSError as e:
            raise WorkloadError("the sandbox ended before its network was set up",
                                code="egress_failed") from e
        time.sleep(0.002)
    raise WorkloadError("the sandbox did not get a network namespace", code="egress_failed")


def _read(fd: int, timeout: float) -> bytes:
    ready, _, _ = select.select([fd], [], [], timeout)
    return os.read(fd, 1) if ready else b""
