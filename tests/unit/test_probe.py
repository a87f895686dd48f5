"""The node probe: real CPU, memory and disk; NVML for real where there is no GPU (it must
say so once and offer none), and the GPU paths through a named stand-in for NVML."""

from __future__ import annotations

from pathlib import Path

import msgspec

from agents.probe import NodeProbe, Reserve, probe_gpus, probe_node
from schemas import v1
from tests import nvml_standin


def test_the_probe_reads_this_machine_and_offers_allocatable_capacity(tmp_path: Path) -> None:
    p = probe_node(tmp_path)
    assert p.cpu_millis >= 1000 and p.memory_mib > 0 and p.local_disk_gib > 0
    caps = p.capabilities(reserve=Reserve(cpu_millis=500, memory_mib=1024, local_disk_gib=1),
                          runtimes=("sandboxed",), labels={"zone": "z1", "rack": "r7"})
    assert caps["allocatable"]["cpu_millis"] == p.cpu_millis - 500
    assert caps["allocatable"]["memory_mib"] == p.memory_mib - 1024
    assert caps["zone"] == "z1" and caps["failure_domain"] == "z1"
    assert caps["labels"] == {"rack": "r7"}
    msgspec.convert(caps, v1.NodeCapabilitiesSpec)  # what the agent registers is valid


def test_without_an_nvidia_library_the_node_offers_no_gpus_and_says_why() -> None:
    g = probe_gpus()  # the real pynvml: this machine has no driver library
    if g.gpus:
        return  # a GPU machine: the real path ran, nothing to assert about its absence
    assert g.note and "no GPUs offered" in g.note
    assert NodeProbe(1000, "amd64", 1024, 10, g).capabilities(
        reserve=Reserve(0, 0, 0), runtimes=(), labels={})["allocatable"]["gpu_count"] == 0


def test_gpus_and_mig_partitions_come_from_nvml_as_distinct_shapes() -> None:
    g = probe_gpus(nvml_standin)
    assert nvml_standin.initialised == 0  # shut down again
    assert [x.model for x in g.gpus] == ["NVIDIA L4", "NVIDIA A100-SXM4-80GB"]
    assert g.gpus[0].memory_mib == 24 * 1024 and g.gpus[0].uuid == "GPU-standin-0000"
    assert g.gpus[1].mig_enabled
    assert g.partitions() == {"3g.40gb": 1, "1g.10gb": 2}
    caps = NodeProbe(8000, "amd64", 65536, 100, g).capabilities(
        reserve=Reserve(0, 0, 0), runtimes=("container",), labels={})
    # the MIG-mode GPU is offered only as its partitions, never also whole
    assert caps["allocatable"]["gpu_count"] == 1
    assert caps["allocatable"]["gpu_partitions"] == {"3g.40gb": 1, "1g.10gb": 2}
    spec = msgspec.convert(caps, v1.NodeCapabilitiesSpec)
    assert spec.to_domain().allocatable.gpu_count == 1
