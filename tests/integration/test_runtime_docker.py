"""The docker runtime against the real engine: a busybox image pushed to a local registry and
run by digest, under runc and (where registered) gVisor's runsc.

Without an engine (or busybox-static, or docker-registry) the whole module is skipped with one
reason line (shown by `-ra`); tests/unit/test_runtime_docker_options.py runs without one.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import docker
import docker.errors
import pytest

from agents.runtimes.contract import ImageRejected, WorkloadError, WorkloadHandle, WorkloadSpec
from agents.runtimes.docker import LABEL_NODE, DockerRuntime, time_plain_docker_run
from bench.docker_engine import (
    LocalRegistry,
    busybox_by_digest,
    busybox_unavailable,
    engine_unavailable,
)

_unavailable = engine_unavailable() or busybox_unavailable() or LocalRegistry.unavailable()
if _unavailable is not None:
    pytest.skip(_unavailable, allow_module_level=True)


def spec(command: str = "true", **kw: object) -> WorkloadSpec:
    fields: dict[str, object] = {"lease_id": f"L{uuid.uuid4().hex[:8]}", "epoch": 1,
                                 "job_number": 0, "command": ("/bin/sh", "-c", command),
                                 "isolation": "container", "memory_mib": 64}
    fields.update(kw)
    return WorkloadSpec(**fields)  # type: ignore[arg-type]


# -- the real engine ------------------------------------------------------------------------

@pytest.fixture(scope="session")
def engine() -> Iterator[docker.DockerClient]:
    client = docker.from_env(timeout=120)
    yield client
    client.close()


@pytest.fixture(scope="session")
def image(engine: docker.DockerClient, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The busybox image, run by digest from a local registry (pulled on first start)."""
    with busybox_by_digest(engine, tmp_path_factory.mktemp("registry")) as ref:
        yield ref


@pytest.fixture()
def node_id() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


@pytest.fixture()
def runtime(engine: docker.DockerClient, node_id: str) -> Iterator[DockerRuntime]:
    """A runtime scoped to a node id of its own; its containers and networks are removed
    afterwards."""
    runtime = DockerRuntime(node_id=node_id)
    yield runtime
    for c in engine.containers.list(all=True, filters={"label": f"{LABEL_NODE}={node_id}"}):
        c.remove(force=True)
    runtime.adopt()  # sweeps this node's networks and their filters


def wait_exit(runtime: DockerRuntime, handle: WorkloadHandle, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = runtime.poll(handle)
        if code is not None:
            return code
        time.sleep(0.05)
    raise AssertionError(f"{handle.key} still running after {timeout}s")


@pytest.fixture()
def run(runtime: DockerRuntime, image: str) -> Callable[..., tuple[int, str]]:
    """Run a shell command to its end in the runtime; (exit code, output)."""
    def _run(command: str, **kw: object) -> tuple[int, str]:
        handle = runtime.start(spec(command, image=image, **kw))
        code = wait_exit(runtime, handle)
        return code, runtime.logs(handle)
    return _run


PROBE = ("id -u; id -g; touch /probe 2>/dev/null && echo root-writable || echo root-read-only; "
         "touch /tmp/x && echo tmp-writable; grep -E '^(CapEff|NoNewPrivs)' /proc/self/status; "
         "echo ifaces: $(tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ')")


def test_the_workload_runs_as_nobody_with_a_read_only_root_no_caps_and_no_network(
        run: Callable[..., tuple[int, str]]) -> None:
    code, out = run(PROBE)
    assert code == 0, out
    lines = out.split()
    assert lines[:2] == ["65534", "65534"]
    assert "root-read-only" in out and "tmp-writable" in out
    assert "CapEff:\t0000000000000000" in out and "NoNewPrivs:\t1" in out
    assert "ifaces: lo\n" in out


def test_egress_gives_the_workload_a_network_interface(
        run: Callable[..., tuple[int, str]]) -> None:
    code, out = run("tail -n +3 /proc/net/dev | cut -d: -f1", network_egress="any")
    assert code == 0 and "eth0" in out, out


def test_the_shape_limits_reach_the_container(runtime: DockerRuntime, image: str,
                                              engine: docker.DockerClient) -> None:
    handle = runtime.start(spec(
        "cat /sys/fs/cgroup/memory.max 2>/dev/null || cat /sys/fs/cgroup/memory/memory.limit_in_bytes",
        image=image, cpu_millis=500, memory_mib=48, pids_limit=32))
    assert wait_exit(runtime, handle) == 0
    assert runtime.logs(handle).strip() == str(48 << 20)  # seen from inside, in its cgroup
    host = engine.containers.get(handle.ref).attrs["HostConfig"]
    assert (host["NanoCpus"], host["PidsLimit"], host["NetworkMode"]) == (500_000_000, 32, "none")
    assert host["Runtime"] == "runc" and host["ReadonlyRootfs"] is True


def test_memory_over_the_shape_is_killed(runtime: DockerRuntime, image: str) -> None:
    # busybox tail keeps a line in memory, and /dev/zero has no newline
    handle = runtime.start(spec("tail /dev/zero", image=image, memory_mib=32))
    assert wait_exit(runtime, handle) == 137
    assert runtime.exit_reason(handle) == "oom_killed"


def test_the_exit_code_is_reported(run: Callable[..., tuple[int, str]]) -> None:
    assert run("exit 7")[0] == 7


def test_the_checkpoint_dir_is_mounted_and_named_in_the_env(
        run: Callable[..., tuple[int, str]], tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    code, out = run('echo step-9 > "$POOL_CHECKPOINT_DIR/state"; echo $POOL_LEASE_ID',
                    checkpoint_dir=str(ckpt))
    assert code == 0, out
    assert (ckpt / "state").read_text() == "step-9\n"


def test_stop_sends_sigterm_and_the_workload_exits_within_the_grace(
        runtime: DockerRuntime, image: str) -> None:
    handle = runtime.start(spec("trap 'echo got-term; exit 42' TERM; echo ready; "
                                "while :; do sleep 0.1; done", image=image))
    deadline = time.monotonic() + 10
    while "ready" not in runtime.logs(handle) and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    assert runtime.stop(handle, grace_seconds=10) == 42
    assert time.monotonic() - t0 < 5
    assert "got-term" in runtime.logs(handle)


def test_stop_kills_after_the_grace_when_sigterm_is_ignored(
        runtime: DockerRuntime, image: str) -> None:
    handle = runtime.start(spec("trap '' TERM; echo ready; while :; do sleep 0.1; done",
                                image=image))
    deadline = time.monotonic() + 10
    while "ready" not in runtime.logs(handle) and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    assert runtime.stop(handle, grace_seconds=1.0) == 137
    assert 1.0 <= time.monotonic() - t0 < 10


def test_a_restarted_agent_adopts_its_containers_by_label_and_learns_exits_it_missed(
        runtime: DockerRuntime, image: str, node_id: str) -> None:
    running = runtime.start(spec("sleep 300", image=image))
    ended = runtime.start(spec("exit 3", image=image))
    wait_exit(runtime, ended)  # it ended while "the agent was down"

    restarted = DockerRuntime(node_id=node_id)
    adopted = {h.key: h for h in restarted.adopt()}
    assert set(adopted) == {running.key, ended.key}
    assert adopted[running.key].ref == running.ref
    assert abs(adopted[running.key].started_at - running.started_at) < 1
    assert restarted.poll(adopted[running.key]) is None
    assert restarted.poll(adopted[ended.key]) == 3
    assert DockerRuntime(node_id=node_id + "-other").adopt() == []

    assert restarted.stop(adopted[running.key], grace_seconds=5) == 143  # SIGTERM, default action
    restarted.forget(adopted[ended.key])
    assert {h.key for h in restarted.adopt()} == {running.key}


def test_the_same_workload_is_never_started_twice(runtime: DockerRuntime, image: str) -> None:
    s = spec("sleep 300", image=image)
    runtime.start(s)
    with pytest.raises(WorkloadError) as again:
        runtime.start(s)
    assert again.value.code == "already_started"


def test_an_image_over_the_size_limit_is_refused(runtime: DockerRuntime, image: str) -> None:
    with pytest.raises(ImageRejected) as refused:
        runtime.start(spec(image=image, max_image_size_bytes=1024))
    assert refused.value.code == "image_too_large"
    assert runtime.adopt() == []


def test_usage_reports_cpu_and_memory_of_a_running_workload(
        runtime: DockerRuntime, image: str) -> None:
    handle = runtime.start(spec("while :; do :; done", image=image, cpu_millis=1000))
    time.sleep(1.5)
    first = runtime.usage(handle)
    time.sleep(1.0)
    second = runtime.usage(handle)
    runtime.stop(handle, grace_seconds=1)
    assert first.memory_mib_used is not None and first.cpu_millis_used is not None
    assert first.cpu_millis_used > 100  # a busy loop, capped at 1 CPU
    assert second.cpu_millis_used is not None and 100 < second.cpu_millis_used <= 1300
    assert runtime.usage(handle).cpu_millis_used is None  # ended: nothing to sample


def test_sandboxed_runs_under_gvisor_runsc(runtime: DockerRuntime,
                                           run: Callable[..., tuple[int, str]]) -> None:
    if "sandboxed" not in runtime.isolation_classes():
        pytest.skip("the engine has no runsc runtime registered; .ci/runtimes installs runsc "
                    "and registers it in /etc/docker/daemon.json")
    code, out = run(PROBE + "; cat /proc/version", isolation="sandboxed")
    assert code == 0, out
    assert out.split()[:2] == ["65534", "65534"]
    assert "root-read-only" in out and "CapEff:\t0000000000000000" in out
    assert "ifaces: lo\n" in out
    assert os.uname().release not in out.splitlines()[-1]  # gVisor's own kernel, not the host's


def test_a_plain_docker_run_of_the_same_image_is_timed(image: str) -> None:
    seconds = time_plain_docker_run(image)
    assert 0 < seconds < 60
