"""Every process the `pool` command starts dies with it, whatever ends it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.proc_children import children as _children

ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _nats_child(proc: subprocess.Popen[bytes], timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in _children(proc.pid):
            try:
                if b"nats-server" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return pid
            except OSError:
                continue
        assert proc.poll() is None, "the bench ended before its server was seen"
        time.sleep(0.02)
    raise AssertionError("no nats-server child appeared")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_stopped_benchmark_leaves_no_nats_server_behind(sig: signal.Signals) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POOL_")}
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "bench", "eventlog", "--quick"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    server = 0
    try:
        server = _nats_child(proc)
        proc.send_signal(sig)
        rc = proc.wait(30)
        if sig == signal.SIGTERM:
            assert rc == 128 + signal.SIGTERM  # unwound, with the conventional code
        deadline = time.monotonic() + 15
        while _alive(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(server), f"nats-server {server} outlived `pool bench eventlog`"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if server and _alive(server):
            os.kill(server, signal.SIGKILL)
