"""A MIG lease's sandbox holds only its own instance's capability files, and a job cannot name
other devices in CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES. No NVIDIA GPU here: NVML, the
driver's capabilities folder and /dev are STAND-INS (tests/nvml_standin.py, empty files)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from agents.gpubind import bind
from agents.probe import NodeProbe, Reserve, probe_gpus
from agents.runtimes.contract import WorkloadError, WorkloadSpec, job_env
from agents.runtimes.process import ProcessRuntime, gpu_sandbox_args
from tests import nvml_standin


def _standin(tmp_path: Path) -> tuple[Path, dict[str, dict[str, object]], object]:
    """A stand-in /dev (every GPU node, control node and capability file) and this node's
    devices as the agent lists them, probed from the stand-in NVML and capabilities folder."""
    dev, caps = tmp_path / "dev", tmp_path / "capabilities"
    (dev / "nvidia-caps").mkdir(parents=True)
    for d in nvml_standin.DEVICES:
        (dev / f"nvidia{d.minor}").touch()
    for name in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"):
        (dev / name).touch()
    for n in range(1, 12):  # config (1), monitor (2) and every instance's
        (dev / "nvidia-caps" / f"nvidia-cap{n}").touch()
    nvml_standin.write_capabilities(caps)
    gpus = probe_gpus(nvml_standin, caps)
    probe = NodeProbe(8000, "amd64", 65536, 100, gpus)
    own = {d["id"]: d for d in probe.capabilities(reserve=Reserve(0, 0, 0), runtimes=("sandboxed",),
                                                  labels={})["devices"]}
    return dev, own, gpus


def _spec(devices: list[str], own: dict[str, dict[str, object]], gpus: object,
          **kw: object) -> WorkloadSpec:
    b = bind(own, devices, gpus)  # type: ignore[arg-type]
    fields: dict[str, object] = {
        "lease_id": f"l{uuid.uuid4().hex[:10]}", "epoch": 1, "job_number": 1,
        "command": ("true",), "gpu_count": len(devices), "gpu_uuids": b.uuids,
        "gpu_minors": b.minors, "gpu_mig": b.mig, "gpu_caps": b.caps}
    fields.update(kw)
    return WorkloadSpec(**fields)  # type: ignore[arg-type]


def test_the_probe_reads_each_mig_instances_own_capability_files(tmp_path: Path) -> None:
    _, _, gpus = _standin(tmp_path)
    for mig, minors in nvml_standin.capability_minors().items():
        assert gpus.capability_minors(mig) == minors  # type: ignore[attr-defined]
    # a driver that does not say: no files, and the lease is refused rather than given all
    assert probe_gpus(nvml_standin, tmp_path / "absent").capability_minors("MIG-standin-b") == ()


def test_a_mig_lease_binds_only_its_own_capability_files(tmp_path: Path) -> None:
    dev, own, gpus = _standin(tmp_path)
    args = gpu_sandbox_args(_spec(["MIG-standin-b"], own, gpus), dev)
    caps = [args[i + 2] for i, a in enumerate(args)
            if a == "--dev-bind" and "nvidia-caps" in args[i + 2]]
    gi, ci = nvml_standin.capability_minors()["MIG-standin-b"]
    assert caps == [f"/dev/nvidia-caps/nvidia-cap{gi}", f"/dev/nvidia-caps/nvidia-cap{ci}"]
    with pytest.raises(WorkloadError) as e:  # the files unknown: refused, never the folder
        gpu_sandbox_args(_spec(["MIG-standin-b"], own, gpus, gpu_caps=()), dev)
    assert e.value.code == "devices_unbound"


def test_the_device_variables_are_the_runtimes_whatever_the_job_sets(tmp_path: Path) -> None:
    _, own, gpus = _standin(tmp_path)
    forged = (("CUDA_VISIBLE_DEVICES", "all"), ("NVIDIA_VISIBLE_DEVICES", "all"), ("A", "1"))
    env = dict(job_env(_spec(["MIG-standin-b"], own, gpus, env=forged)))
    assert env == {"A": "1", "CUDA_VISIBLE_DEVICES": "MIG-standin-b",
                   "NVIDIA_VISIBLE_DEVICES": "MIG-standin-b"}
    assert dict(job_env(_spec([], own, gpus, env=forged))) == {"A": "1"}  # no GPUs: neither


def test_a_mig_sandbox_sees_its_own_capabilities_and_devices_only(tmp_path: Path) -> None:
    dev, own, gpus = _standin(tmp_path)
    rt = ProcessRuntime(tmp_path / "state", dev=dev)
    if rt.available() is not None:
        pytest.skip(str(rt.available()))
    script = ('ls /dev/nvidia-caps > "$POOL_CHECKPOINT_DIR/caps"; '
              'echo "$CUDA_VISIBLE_DEVICES $NVIDIA_VISIBLE_DEVICES" > "$POOL_CHECKPOINT_DIR/env"')
    spec = _spec(["MIG-standin-c"], own, gpus, command=("/bin/sh", "-c", script),
                 checkpoint_dir=str(tmp_path / "ck"),
                 env=(("CUDA_VISIBLE_DEVICES", "all"), ("NVIDIA_VISIBLE_DEVICES", "all")))
    h = rt.start(spec)
    deadline = time.monotonic() + 30
    while rt.poll(h) is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert rt.poll(h) == 0, rt.read_output(h, 0, 4096)
    gi, ci = nvml_standin.capability_minors()["MIG-standin-c"]
    assert (tmp_path / "ck" / "caps").read_text().split() == sorted(
        [f"nvidia-cap{gi}", f"nvidia-cap{ci}"])
    assert (tmp_path / "ck" / "env").read_text() == "MIG-standin-c MIG-standin-c\n"
    rt.forget(h)


def test_an_order_naming_a_device_not_this_nodes_is_refused(tmp_path: Path) -> None:
    _, own, gpus = _standin(tmp_path)
    with pytest.raises(WorkloadError) as e:
        bind(own, ["MIG-standin-b", "GPU-elsewhere"], gpus)  # type: ignore[arg-type]
    assert e.value.code == "device_unknown"
