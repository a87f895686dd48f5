"""The process runtime gives a GPU workload its own /dev/nvidia nodes and no other. No NVIDIA
GPU is on this machine: a directory of empty files stands in for /dev (named as such)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agents.runtimes.contract import WorkloadError, WorkloadSpec, job_env
from agents.runtimes.process import gpu_sandbox_args


def spec(**kw: object) -> WorkloadSpec:
    return WorkloadSpec(lease_id="l", epoch=1, job_number=1, command=("true",), **kw)  # type: ignore[arg-type]


@pytest.fixture
def fake_dev(tmp_path: Path) -> Path:
    """A STAND-IN /dev: empty files with the NVIDIA driver's device node names."""
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl", "nvidia-uvm",
                 "nvidia-uvm-tools"):
        (tmp_path / name).touch()
    return tmp_path


def test_only_the_leases_gpus_and_the_control_devices_are_bound(fake_dev: Path) -> None:
    args = gpu_sandbox_args(spec(gpu_count=2, gpu_uuids=("GPU-b", "GPU-d"), gpu_minors=(1, 3)),
                            fake_dev)
    bound = [args[i + 2] for i, a in enumerate(args) if a == "--dev-bind"]
    assert bound == ["/dev/nvidia1", "/dev/nvidia3", "/dev/nvidiactl", "/dev/nvidia-uvm",
                     "/dev/nvidia-uvm-tools"]
    env = dict(job_env(spec(gpu_count=2, gpu_uuids=("GPU-b", "GPU-d"), gpu_minors=(1, 3))))
    assert env == {"CUDA_VISIBLE_DEVICES": "GPU-b,GPU-d", "NVIDIA_VISIBLE_DEVICES": "GPU-b,GPU-d"}


def test_a_workload_without_gpus_gets_no_gpu_node(fake_dev: Path) -> None:
    assert gpu_sandbox_args(spec(), fake_dev) == []


def test_a_gpu_lease_without_its_devices_is_refused_rather_than_given_any(fake_dev: Path) -> None:
    with pytest.raises(WorkloadError) as e:
        gpu_sandbox_args(spec(gpu_count=1), fake_dev)
    assert e.value.code == "devices_unbound"


def test_a_missing_device_node_fails_clearly(fake_dev: Path) -> None:
    with pytest.raises(WorkloadError) as e:
        gpu_sandbox_args(spec(gpu_count=1, gpu_uuids=("GPU-x",), gpu_minors=(7,)), fake_dev)
    assert e.value.code == "device_missing" and "nvidia7" in str(e.value)
