"""The process sandbox enforces the shape: pids, memory, CPU, a sized /tmp, no host loopback."""

from __future__ import annotations

import os
import socket
import stat
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agents.runtimes.contract import WorkloadError, WorkloadHandle, WorkloadSpec
from agents.runtimes.process import ProcessRuntime, _group_pids

if ProcessRuntime(Path("/tmp")).available() is not None:
    pytest.skip("process runtime unavailable (bubblewrap)", allow_module_level=True)


@pytest.fixture()
def runtime(tmp_path: Path) -> ProcessRuntime:
    return ProcessRuntime(tmp_path / "state")


def _spec(tmp_path: Path, script: str, **kw: Any) -> WorkloadSpec:
    fields: dict[str, Any] = {
        "lease_id": f"l{uuid.uuid4().hex[:12]}", "epoch": 1, "job_number": 1,
        "command": ("/bin/sh", "-c", script), "memory_mib": 64,
        "checkpoint_dir": str(tmp_path / f"ck-{uuid.uuid4().hex[:6]}"),
    }
    fields.update(kw)
    return WorkloadSpec(**fields)


def _wait(rt: ProcessRuntime, h: WorkloadHandle, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = rt.poll(h)
        if code is not None:
            return code
        time.sleep(0.05)
    raise AssertionError(f"{h.key} still running after {timeout}s")


def _run(rt: ProcessRuntime, spec: WorkloadSpec) -> int:
    h = rt.start(spec)
    try:
        return _wait(rt, h)
    finally:
        rt.stop(h, 0)
        rt.forget(h)


def _needs(rt: ProcessRuntime, controller: str) -> None:
    if controller not in rt.cgroups.enforced:
        pytest.skip(f"no {controller} cgroup here: {rt.cgroups.problems}")


def test_a_fork_bomb_is_stopped_by_the_pids_limit(runtime: ProcessRuntime,
                                                   tmp_path: Path) -> None:
    h = runtime.start(_spec(tmp_path, "for i in $(seq 1 80); do sleep 30 & done; sleep 30",
                            pids_limit=20))
    try:
        time.sleep(3)
        running = len(_group_pids(int(h.ref)))
    finally:
        runtime.stop(h, 0)
        runtime.forget(h)
    assert 0 < running <= 20, running


def test_a_job_cannot_use_more_memory_than_its_shape(runtime: ProcessRuntime,
                                                     tmp_path: Path) -> None:
    _needs(runtime, "memory")
    # 160 MiB written into a 64 MiB shape (under the RLIMIT_AS headroom of 4x): killed
    code = _run(runtime, _spec(tmp_path, "python3 -c 'b = b\"x\" * (160 << 20)'; exit $?"))
    assert code != 0


def test_tmp_is_sized_to_the_shape(runtime: ProcessRuntime, tmp_path: Path) -> None:
    code = _run(runtime, _spec(tmp_path, 'set -- $(df -k /tmp | tail -n 1); test "$2" -le 65536'))
    assert code == 0


def test_a_job_cannot_use_more_cpu_than_its_shape(runtime: ProcessRuntime,
                                                  tmp_path: Path) -> None:
    _needs(runtime, "cpu")
    script = (
        "import os, resource, time\n"
        "for _ in range(2):\n"
        "    if os.fork() == 0:\n"
        "        end = time.monotonic() + 3\n"
        "        while time.monotonic() < end: pass\n"
        "        os._exit(0)\n"
        "os.wait(); os.wait()\n"
        "u = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
        "open(os.environ['POOL_CHECKPOINT_DIR'] + '/cpu', 'w').write(str(u.ru_utime + u.ru_stime))\n"
    )
    spec = _spec(tmp_path, "", command=("python3", "-c", script), cpu_millis=100)
    assert _run(runtime, spec) == 0
    used = float((Path(spec.checkpoint_dir or "") / "cpu").read_text())
    # two busy processes for 3 s under a tenth of a core: 0.3 s, with room for accounting slack
    assert used < 0.6, used


@pytest.fixture()
def host_service() -> Iterator[int]:
    """A TCP service on the host's loopback, like the embedded NATS or PostgreSQL."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
                conn.close()
            except OSError:
                continue

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join(2)
    srv.close()


def test_egress_cannot_reach_the_hosts_loopback(runtime: ProcessRuntime, tmp_path: Path,
                                                host_service: int) -> None:
    if runtime.network_egress() == "none":
        pytest.skip("no user-mode network stack (slirp4netns) here")
    script = (
        "import os, socket, sys\n"
        "out = open(os.environ['POOL_CHECKPOINT_DIR'] + '/net', 'w')\n"
        "out.write(open('/proc/net/dev').read())\n"
        f"for host in ('127.0.0.1', '10.0.2.2'):\n"
        "    try:\n"
        f"        socket.create_connection((host, {host_service}), timeout=2).close()\n"
        "        out.write('REACHED ' + host + '\\n')\n"
        "    except OSError as e:\n"
        "        out.write('refused ' + host + ' ' + type(e).__name__ + '\\n')\n"
    )
    spec = _spec(tmp_path, "", command=("python3", "-c", script), network_egress="open")
    assert _run(runtime, spec) == 0
    seen = (Path(spec.checkpoint_dir or "") / "net").read_text()
    assert "REACHED" not in seen, seen
    assert "tap0" in seen  # it had a network of its own: the egress was real


def test_a_node_without_user_mode_networking_refuses_egress(tmp_path: Path) -> None:
    rt = ProcessRuntime(tmp_path / "state", slirp=None)
    assert rt.network_egress() == "none"
    assert any("egress" in line for line in rt.limitations())
    with pytest.raises(WorkloadError) as e:
        rt.start(_spec(tmp_path, "true", network_egress="open"))
    assert e.value.code == "egress_unavailable"


def test_a_jobs_log_is_readable_by_its_owner_only(runtime: ProcessRuntime,
                                                  tmp_path: Path) -> None:
    spec = _spec(tmp_path, "echo secret")
    h = runtime.start(spec)
    try:
        assert _wait(runtime, h) == 0
        mode = stat.S_IMODE(os.stat(runtime.state_dir / f"{spec.key}.log").st_mode)
        assert mode == 0o600, oct(mode)
    finally:
        runtime.stop(h, 0)
        runtime.forget(h)
    # forgotten (its output shipped): the log is gone with it
    assert not (runtime.state_dir / f"{spec.key}.log").exists()
