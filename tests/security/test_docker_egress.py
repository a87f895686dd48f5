"""A docker job with egress is on a network of its own: it reaches the internet but neither
another lease's container, nor the host's own addresses, private ranges or link-local. The
hosts are the test's own (tests/security/testhosts.py) and a second job, on the real engine."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from agents.runtimes import egress
from agents.runtimes.contract import WorkloadHandle, WorkloadSpec
from agents.runtimes.docker import LABEL_NODE, DockerRuntime
from agents.runtimes.dockernet import Net
from bench.docker_engine import (
    LocalRegistry,
    busybox_by_digest,
    busybox_unavailable,
    engine_unavailable,
)
from tests.security.testhosts import PORT, egress_hosts

_unavailable = engine_unavailable() or busybox_unavailable() or LocalRegistry.unavailable()
if _unavailable is not None:
    pytest.skip(_unavailable, allow_module_level=True)

# each target in turn: `REACHED` when it answered hello, else `refused`; then the gateway
PROBE = ('for t in "$@"; do '
         'if nc -w 3 ${t%:*} ${t#*:} </dev/null 2>/dev/null | grep -q hello; '
         'then echo "REACHED $t"; else echo "refused $t"; fi; done; '
         'gw=$(ip route | awk \'/^default/ {print $3}\'); '
         'if nc -w 3 $gw $OWN_PORT </dev/null 2>/dev/null | grep -q hello; '
         'then echo "REACHED gateway"; else echo "refused gateway"; fi; '
         # no IPv6 at all: the filter is IPv4's (the engine turns it off on such a network)
         'echo "ipv6 off: $(cat /proc/sys/net/ipv6/conf/all/disable_ipv6 2>/dev/null || echo 1)"')


@pytest.fixture(scope="module")
def engine() -> Iterator[docker.DockerClient]:
    client = docker.from_env(timeout=120)
    yield client
    client.close()


@pytest.fixture(scope="module")
def image(engine: docker.DockerClient, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with busybox_by_digest(engine, tmp_path_factory.mktemp("registry")) as ref:
        yield ref


@pytest.fixture()
def runtime(engine: docker.DockerClient) -> Iterator[DockerRuntime]:
    node = f"egress-{uuid.uuid4().hex[:8]}"
    rt = DockerRuntime(node_id=node)
    if rt.network_egress() == "none":
        pytest.skip(f"no egress for docker jobs here: {rt.limitations()}")
    yield rt
    for c in engine.containers.list(all=True, filters={"label": f"{LABEL_NODE}={node}"}):
        c.remove(force=True)
    rt.adopt()  # sweeps this node's networks and their filters


def _spec(image: str, command: tuple[str, ...], **kw: object) -> WorkloadSpec:
    fields: dict[str, object] = {"lease_id": f"l{uuid.uuid4().hex[:10]}", "epoch": 1,
                                 "job_number": 1, "command": command, "image": image,
                                 "isolation": "container", "memory_mib": 64,
                                 "network_egress": "open"}
    fields.update(kw)
    return WorkloadSpec(**fields)  # type: ignore[arg-type]


def _address(engine: docker.DockerClient, h: WorkloadHandle) -> str:
    networks = engine.containers.get(h.ref).attrs["NetworkSettings"]["Networks"]
    (net,) = networks.values()
    return str(net["IPAddress"])


def _wait(rt: DockerRuntime, h: WorkloadHandle, timeout: float = 90) -> int:
    deadline = time.monotonic() + timeout
    while (code := rt.poll(h)) is None:
        assert time.monotonic() < deadline, f"{h.key} still running"
        time.sleep(0.1)
    return code


def test_a_docker_job_reaches_the_internet_but_no_neighbour_host_or_private_address(
        engine: docker.DockerClient, image: str, runtime: DockerRuntime) -> None:
    with egress_hosts(own_address="0.0.0.0") as hosts:
        # another lease's job, listening: the host reaches it, the first job must not
        neighbour = runtime.start(_spec(image, ("nc", "-ll", "-p", "8080", "-e", "echo",
                                                "hello")))
        other = _address(engine, neighbour)
        deadline = time.monotonic() + 10
        while True:
            try:

                with socket.create_connection((other, 8080), timeout=1) as c:
                    assert c.recv(6) == b"hello\n"
                break
            except OSError:
                assert time.monotonic() < deadline, "the neighbour never listened"
                time.sleep(0.1)
        own = [a for a in egress.host_addresses() if not a.startswith("127.")]
        targets = [f"{hosts.public}:{PORT}", f"{hosts.private}:{PORT}",
                   f"{hosts.link_local}:{PORT}", f"{other}:8080",
                   *(f"{a}:{hosts.own_port}" for a in own)]
        job = runtime.start(_spec(image, ("/bin/sh", "-c", PROBE, "probe", *targets),
                                  env=(("OWN_PORT", str(hosts.own_port)),)))
        assert _wait(runtime, job) == 0
        seen = runtime.logs(job)
        assert f"REACHED {hosts.public}:{PORT}\n" in seen, seen  # the egress works
        for denied in targets[1:] + ["gateway"]:
            assert f"refused {denied}\n" in seen, seen
        assert "ipv6 off: 1\n" in seen, seen
        runtime.stop(neighbour, 0)
        for h in (job, neighbour):
            runtime.forget(h)
        # each network and its filter go with their job
        for h in (job, neighbour):
            name = str(h.extra["name"])
            assert not engine.networks.list(names=[name])
            assert Net(name).bridge not in Path("/proc/net/dev").read_text()


def test_the_pools_allow_list_opens_a_private_network_and_nothing_else(
        image: str, runtime: DockerRuntime) -> None:
    with egress_hosts() as hosts:
        targets = [f"{hosts.private}:{PORT}", f"{hosts.link_local}:{PORT}"]
        job = runtime.start(_spec(image, ("/bin/sh", "-c", PROBE, "probe", *targets),
                                  egress_allow=(f"{hosts.private}/32",),
                                  env=(("OWN_PORT", "1"),)))
        assert _wait(runtime, job) == 0
        seen = runtime.logs(job)
        assert f"REACHED {hosts.private}:{PORT}\n" in seen, seen
        assert f"refused {hosts.link_local}:{PORT}\n" in seen, seen
        runtime.forget(job)
