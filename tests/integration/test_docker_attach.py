"""`pool lease attach -i` into a docker job started with `--stdin`: the real agent on the real
engine follows the container's output and writes the tenant's input to its stdin, as it does
for the bubblewrap sandbox (tests/integration/test_exec.py)."""
# ruff: noqa: F811 - `plane` and `image` are test_docker_logs' fixtures, imported to be used

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

from client.api import PoolClient
from tests.integration.test_docker_logs import ROOT, _pool, image, plane  # noqa: F401

ECHOER = ["/bin/sh", "-c", "echo ready; while read l; do echo got-$l; done; echo eof; exit 7"]


def _running(url: str, lease_id: str) -> None:
    deadline = time.monotonic() + 60
    with PoolClient(url, "alpha") as alpha:
        while alpha.lease(lease_id, "get")["lease"]["state"] != "running":
            assert time.monotonic() < deadline, alpha.lease(lease_id, "get")
            time.sleep(0.2)


def _read_until(proc: subprocess.Popen[str], line: str, timeout: float = 30) -> list[str]:
    assert proc.stdout is not None
    got: list[str] = []
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        while line not in got:
            got.append(proc.stdout.readline())
            assert got[-1], (got, proc.stderr.read() if proc.stderr else "")
    finally:
        timer.cancel()
    return got


def test_attach_i_feeds_a_docker_job_s_stdin_and_exits_with_its_code(plane: str,
                                                                      image: str) -> None:
    who = ["--nats-url", plane, "--tenant", "alpha"]
    run = _pool("lease", "run", "-d", "--stdin", *who, "--pool", "p1", "--cpu-millis", "500",
                "--memory-mib", "128", "--max-runtime", "120", "--image", image,
                "--runtime", "container", "--", *ECHOER)
    assert run.returncode == 0, run.stderr
    lease_id = run.stdout.strip()
    _running(plane, lease_id)
    env = {k: v for k, v in os.environ.items() if not k.startswith("POOL_")}
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "lease", "attach", "-i",
                             lease_id, *who], cwd=ROOT, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        assert proc.stdin is not None
        proc.stdin.write("hello\n")
        proc.stdin.flush()
        assert _read_until(proc, "got-hello\n")[-1] == "got-hello\n"
        proc.stdin.close()  # the end of this stdin: the job's input ends, it exits 7
        assert _read_until(proc, "eof\n")[-1] == "eof\n"
        assert proc.wait(30) == 7
    finally:
        if proc.poll() is None:
            proc.kill()


def test_attach_i_to_a_docker_job_without_stdin_is_refused_on_its_input(plane: str,
                                                                         image: str) -> None:
    who = ["--nats-url", plane, "--tenant", "alpha"]
    run = _pool("lease", "run", "-d", *who, "--pool", "p1", "--cpu-millis", "500",
                "--memory-mib", "128", "--max-runtime", "120", "--image", image,
                "--runtime", "container", "--", "sleep", "60")
    assert run.returncode == 0, run.stderr
    lease_id = run.stdout.strip()
    _running(plane, lease_id)
    env = {k: v for k, v in os.environ.items() if not k.startswith("POOL_")}
    proc = subprocess.run([sys.executable, "-m", "cli.main", "lease", "attach", "-i",
                           lease_id, *who, "--json"], cwd=ROOT, env=env, text=True,
                          input="x\n", capture_output=True, timeout=60, check=False)
    assert proc.returncode == 1, proc.stderr
    assert json.loads(proc.stdout)["error"]["code"] == "stdin_closed", proc.stdout
    _pool("lease", "cancel", lease_id, *who)
