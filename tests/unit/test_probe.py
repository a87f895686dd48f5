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


def test_the_probe_lists_each_gpu_and_mig_instance_as_a_device_the_schema_accepts() -> None:
    g = probe_gpus(nvml_standin)
    caps = NodeProbe(8000, "amd64", 65536, 100, g).capabilities(
        reserve=Reserve(0, 0, 0), runtimes=("container",), labels={})
    devices = {d["id"]: d for d in caps["devices"]}
    assert devices["GPU-standin-0000"]["minor"] == 0
    assert devices["GPU-standin-0000"]["pci_bus_id"] == "00000000:17:00.0"
    assert devices["MIG-standin-b"]["profile"] == "1g.10gb"
    assert devices["MIG-standin-b"]["parent"] == "GPU-standin-0001"
    assert "GPU-standin-0001" not in devices  # carved into MIG: not offered whole
    spec = msgspec.convert(caps, v1.NodeCapabilitiesSpec)
    assert len(spec.to_domain().devices) == 4


def test_gpus_on_one_nvswitch_share_an_nvlink_domain() -> None:
    board = nvml_standin.Board(8, per_switch=4)
    g = probe_gpus(board)
    assert board.initialised == 0
    assert [x.nvlink_domain for x in g.gpus] == ["nvlink-0"] * 4 + ["nvlink-4"] * 4
    # a machine whose GPUs have no NVLink (the L4 stand-in) names no domain
    assert probe_gpus(nvml_standin).gpus[0].nvlink_domain is None


def test_time_slice_replicas_replace_whole_gpus_and_a_runtime_that_cannot_bind_offers_none() -> None:
    g = probe_gpus(nvml_standin.Board(2))
    p = NodeProbe(8000, "amd64", 65536, 100, g)
    ts = p.capabilities(reserve=Reserve(0, 0, 0), runtimes=("container",), labels={},
                        time_slice_replicas=3)
    assert ts["allocatable"]["gpu_count"] == 0
    assert ts["allocatable"]["gpu_partitions"] == {"time-slice": 6}
    assert [d["id"] for d in ts["devices"]][:2] == ["GPU-board-0000/ts0", "GPU-board-0000/ts1"]
    msgspec.convert(ts, v1.NodeCapabilitiesSpec)
    none = p.capabilities(reserve=Reserve(0, 0, 0), runtimes=("container",), labels={},
                          binds_gpus=False)
    assert none["allocatable"]["gpu_count"] == 0 and "devices" not in none


def test_a_device_list_that_disagrees_with_the_offered_gpus_is_refused() -> None:
    caps = NodeProbe(8000, "amd64", 65536, 100, probe_gpus(nvml_standin.Board(2))).capabilities(
        reserve=Reserve(0, 0, 0), runtimes=("container",), labels={})
    caps["devices"] = caps["devices"][:1]  # two GPUs offered, one listed
    try:
        msgspec.convert(caps, v1.NodeCapabilitiesSpec)
    except msgspec.ValidationError as e:
        assert "devices disagree" in str(e)
    else:
        raise AssertionError("accepted")


def test_a_multi_node_nvlink_domain_read_from_the_fabric_becomes_the_nodes_label() -> None:
    board = nvml_standin.Board(4, fabric=(bytes.fromhex("a1b2c3d4e5f60718293a4b5c6d7e8f90"), 7))
    p = NodeProbe(8000, "amd64", 65536, 100, probe_gpus(board))
    caps = p.capabilities(reserve=Reserve(0, 0, 0), runtimes=("container",),
                          labels={"rack": "r1"})
    assert caps["labels"] == {"rack": "r1", "nvlink_domain": "a1b2c3d4e5f6-7"}
    # an operator's label wins; a board without a fabric names none
    assert p.capabilities(reserve=Reserve(0, 0, 0), runtimes=("container",),
                          labels={"nvlink_domain": "nvl-a"})["labels"] == {"nvlink_domain": "nvl-a"}
    assert probe_gpus(nvml_standin.Board(2)).fabric_domain is None


def test_hostile_device_lists_are_refused_by_the_registration_schema() -> None:
    import pytest

    caps = NodeProbe(8000, "amd64", 65536, 100, probe_gpus(nvml_standin.Board(2))).capabilities(
        reserve=Reserve(0, 0, 0), runtimes=("container",), labels={})
    for bad in ({"id": "GPU-x/../../etc"}, {"id": "GPU-x\n"}, {"id": "-GPU"},
                {"id": "MIG-a", "kind": "mig"},  # no profile nor parent
                {"id": "GPU-a/ts0", "kind": "replica", "profile": "1g.10gb", "parent": "GPU-a"},
                {"id": "GPU-a", "minor": 70000}):
        hostile = {**caps, "devices": [bad, *caps["devices"][1:]]}
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(hostile, v1.NodeCapabilitiesSpec)
