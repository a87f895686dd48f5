"""Secrets stay off command lines: every local user can read /proc/<pid>/cmdline."""

from __future__ import annotations

import time
from pathlib import Path

from local.demo import Demo


def test_the_demo_passes_the_service_password_outside_the_command_line(tmp_path: Path) -> None:
    demo = Demo(tmp_path / "demo", nodes=1, flood=1, live=False, say=lambda _s: None)
    secret = "s3cret-service-password"
    proc = demo.spawn("probe", "serve", "--help", nats_url=f"nats://pool-service:{secret}@h:1")
    try:
        cmdline = b""
        deadline = time.monotonic() + 10
        while b"cli.main" not in cmdline:  # until the child has exec'd (before, it is a copy)
            assert time.monotonic() < deadline, "the child never ran"
            cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
    finally:
        proc.wait(30)
    assert secret.encode() not in cmdline
    assert secret.encode() in environ  # readable by its own user (and root) only
