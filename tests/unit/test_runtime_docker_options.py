"""The docker runtime's isolation policy as container options, without an engine: these run
everywhere, also where tests/integration/test_runtime_docker.py is skipped for want of Docker.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import docker
import pytest
from docker.types import DeviceRequest

from agents.runtimes.contract import ImageRejected, WorkloadError, WorkloadSpec
from agents.runtimes.docker import LABEL_NODE, DockerRuntime, container_options, digest_pinned
from agents.runtimes.dockernet import Net, ruleset

DIGEST = "sha256:" + "ab" * 32


def spec(command: str = "true", **kw: object) -> WorkloadSpec:
    fields: dict[str, object] = {"lease_id": f"L{uuid.uuid4().hex[:8]}", "epoch": 1,
                                 "job_number": 0, "command": ("/bin/sh", "-c", command),
                                 "isolation": "container", "memory_mib": 64}
    fields.update(kw)
    return WorkloadSpec(**fields)  # type: ignore[arg-type]


def test_only_digest_pinned_references_count_as_pinned() -> None:
    assert digest_pinned(f"127.0.0.1:5000/repo@{DIGEST}")
    assert digest_pinned(f"reg.example/team/train:v1@{DIGEST}")
    assert not digest_pinned("reg.example/train:v1")
    assert not digest_pinned("reg.example/train")
    assert not digest_pinned("reg.example/train@sha256:abc")


def test_a_tag_only_reference_is_refused_before_the_engine_is_asked() -> None:
    dead = docker.DockerClient(base_url="unix:///nonexistent.sock", version="1.41")
    runtime = DockerRuntime(client=dead)  # any call to the engine would fail
    for image, code in (("127.0.0.1:5000/repo:latest", "image_not_digest_pinned"),
                        ("busybox", "image_not_digest_pinned"), (None, "image_missing")):
        with pytest.raises(ImageRejected) as refused:
            runtime.start(spec(image=image))
        assert refused.value.code == code


def test_the_container_options_carry_the_whole_isolation_policy(tmp_path: Path) -> None:
    s = spec(cpu_millis=1500, memory_mib=512, pids_limit=64, checkpoint_dir=str(tmp_path),
             labels=(("team", "ml"), ("computepool.tenant", "acme"),
                     ("computepool.lease", "forged"), ("computepool.checkpoint_dir", "/etc")),
             env=(("A", "1"),))
    o = container_options(s, oci_runtime="runc", node_id="n1")
    assert o["user"] == "65534:65534" and o["read_only"] is True
    assert o["cap_drop"] == ["ALL"] and o["security_opt"] == ["no-new-privileges"]
    assert o["network_mode"] == "none" and "/tmp" in o["tmpfs"]
    assert o["nano_cpus"] == 1_500_000_000 and o["mem_limit"] == 512 << 20
    assert o["pids_limit"] == 64 and o["runtime"] == "runc" and o["device_requests"] is None
    assert o["labels"]["computepool.lease"] == s.lease_id  # a tenant label cannot forge it
    assert o["labels"]["computepool.checkpoint_dir"] == str(tmp_path)
    assert o["labels"]["team"] == "ml" and o["labels"]["computepool.tenant"] == "acme"
    assert o["labels"][LABEL_NODE] == "n1"
    assert o["labels"]["computepool.epoch"] == "1" and o["labels"]["computepool.job"] == "0"
    assert o["volumes"] == {str(tmp_path): {"bind": "/checkpoint", "mode": "rw"}}
    assert o["environment"]["POOL_CHECKPOINT_DIR"] == "/checkpoint"
    assert o["environment"]["A"] == "1"
    assert o["working_dir"] is None and "POOL_WORKDIR" not in o["environment"]


def test_a_job_with_files_gets_them_as_its_working_directory(tmp_path: Path) -> None:
    o = container_options(spec(workdir=str(tmp_path)), oci_runtime="runc")
    assert o["volumes"] == {str(tmp_path): {"bind": "/work", "mode": "rw"}}
    assert o["working_dir"] == "/work" and o["environment"]["POOL_WORKDIR"] == "/work"


def test_gpus_are_requested_by_uuid_and_egress_gets_a_network() -> None:
    o = container_options(spec(gpu_count=2, gpu_uuids=("GPU-a", "GPU-b"), network_egress="any",
                               env=(("CUDA_VISIBLE_DEVICES", "all"),)), oci_runtime="runc")
    assert o["device_requests"] == [DeviceRequest(device_ids=["GPU-a", "GPU-b"],
                                                  capabilities=[["gpu"]])]
    # a network of its own, named as its container: never the engine's shared default bridge
    assert o["network_mode"] == o["name"] != "bridge"
    assert o["environment"]["NVIDIA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    assert o["environment"]["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"  # not the job's `all`
    by_count = container_options(spec(gpu_count=1), oci_runtime="runc")["device_requests"]
    assert by_count == [DeviceRequest(count=1, capabilities=[["gpu"]])]


class _EngineWithoutRunsc:
    """A stand-in for the engine's API with only runc registered: the probe logic alone."""

    api = type("Api", (), {"base_url": "http+docker://localhost"})()

    def ping(self) -> bool:
        return True

    def info(self) -> dict[str, object]:
        return {"Runtimes": {"runc": {"path": "runc"}}}


def test_sandboxed_is_not_offered_when_the_engine_has_no_runsc() -> None:
    runtime = DockerRuntime(client=_EngineWithoutRunsc())  # type: ignore[arg-type]
    assert runtime.isolation_classes() == ("container",)
    with pytest.raises(WorkloadError) as refused:
        runtime.start(spec(image=f"127.0.0.1:5000/repo@{DIGEST}", isolation="sandboxed"))
    assert refused.value.code == "isolation_unavailable"


def test_the_pools_volumes_are_bound_as_the_operator_named_them(tmp_path: Path) -> None:
    o = container_options(spec(volumes=(("/srv/data", "/data", True), ("/srv/out", "/out", False))),
                          oci_runtime="runc")
    assert o["volumes"] == {"/srv/data": {"bind": "/data", "mode": "ro"},
                            "/srv/out": {"bind": "/out", "mode": "rw"}}


def test_a_node_that_cannot_filter_a_jobs_network_refuses_egress(
        monkeypatch: pytest.MonkeyPatch) -> None:
    dead = docker.DockerClient(base_url="unix:///nonexistent.sock", version="1.41")
    runtime = DockerRuntime(client=dead)
    runtime._filter.iptables = None  # a host without iptables
    assert runtime.network_egress() == "none"
    assert any("iptables" in line for line in runtime.limitations())
    with pytest.raises(WorkloadError) as refused:
        runtime.start(spec(image=f"reg.example/x@{DIGEST}", network_egress="open"))
    assert refused.value.code == "egress_unavailable"
    monkeypatch.setenv("POOL_EGRESS_ALLOW", "10.0.0.0/8,not-a-network")
    assert DockerRuntime(client=dead).network_egress() == "none"  # a typo opens nothing


def test_a_jobs_network_filter_refuses_private_link_local_and_the_host_itself() -> None:
    net = Net("computepool-n1-L1-1-0")
    assert len(net.bridge) <= 15  # an interface name
    lines = ruleset(net, ["10.9.0.0/16"]).splitlines()
    o, i, br = net.forward_chain, net.input_chain, net.bridge
    reject = "-j REJECT --reject-with icmp-admin-prohibited"
    assert f"-A {o} -d 169.254.0.0/16 {reject}" in lines
    assert f"-A {o} -d 172.16.0.0/12 {reject}" in lines  # other tenants' bridges
    assert lines.index(f"-A {o} -d 10.9.0.0/16 -j RETURN") < \
        lines.index(f"-A {o} -d 10.0.0.0/8 {reject}")  # the operator's exception first
    assert lines[-4:-1] == [f"-A {i} {reject}", f"-I DOCKER-USER -i {br} -j {o}",
                            f"-I INPUT -i {br} -j {i}"]  # every new packet to the host


def test_the_engines_log_of_a_job_is_sized_by_its_output_cap() -> None:
    small = container_options(spec(output_cap_bytes=200_000), oci_runtime="runc")
    assert small["log_config"].config == {"max-size": "204096", "max-file": "2"}
    assert small["labels"]["computepool.output_cap_bytes"] == "200000"  # read back on adoption
    default = container_options(spec(), oci_runtime="runc")["log_config"].config
    assert default == {"max-size": str(10 << 20), "max-file": "2"}  # never more than before
