"""`scripts/gpu-check.sh --offline` as a bare GPU machine would run it: the bundle installed
into a fresh interpreter with no index, the bundle's bubblewrap, the NVML stand-in's GPUs.

The stand-ins: NVML and the driver's MIG capabilities folder (tests/nvml_standin.py), a /dev
of empty files, and an `nvidia-smi -L` that lists a GPU only where its /dev node was bound into
the sandbox, and a MIG instance only where its capability files were: so what each job
reports is what the sandbox let it see.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import nvml_standin

ROOT = Path(__file__).resolve().parents[2]
VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"
BUNDLE = ROOT / ".gpu-bundle" / f"py{VERSION}"

pytestmark = pytest.mark.slow


def _standin_dev(dev: Path) -> None:
    """A /dev with the stand-in's GPU nodes, the driver's control nodes and the capability
    files of every MIG instance (numbered as the stand-in's driver says)."""
    for d in nvml_standin.DEVICES:
        (dev / f"nvidia{d.minor}").touch()
    for name in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"):
        (dev / name).touch()
    (dev / "nvidia-caps").mkdir()
    for minors in nvml_standin.capability_minors().values():
        for k in minors:
            (dev / "nvidia-caps" / f"nvidia-cap{k}").touch()


def _mig_instances() -> list[tuple[nvml_standin._Device, nvml_standin._Device]]:
    return [(d, c) for d in nvml_standin.DEVICES for c in d.children]


def _standin_nvidia_smi() -> str:
    """`nvidia-smi -L` as a shell script: GPUs by their /dev node, MIG instances by theirs."""
    lines = []
    caps = {u: k for u, (_, k) in nvml_standin.capability_minors().items()}
    for i, d in enumerate(nvml_standin.DEVICES):
        lines.append(f"if [ -e /dev/nvidia{d.minor} ]; then "
                     f"echo 'GPU {i}: {d.name} (UUID: {d.uuid})'")
        for j, c in enumerate(d.children):
            profile = c.name.rsplit(" ", 1)[1]
            lines.append(f"  [ -e /dev/nvidia-caps/nvidia-cap{caps[c.uuid]} ] && "
                         f"echo '  MIG {profile} Device {j}: (UUID: {c.uuid})'")
        lines.append("fi")
    return shlex.join(["/bin/sh", "-c", "\n".join(lines) + "\ntrue"])


def _sandbox_unavailable() -> str:
    done = subprocess.run(
        [str(BUNDLE / "bwrap" / "bin" / "bwrap"), "--unshare-all", "--ro-bind", "/", "/",
         "--proc", "/proc", "--dev", "/dev", "--", "/bin/true"],
        capture_output=True, text=True, timeout=30, check=False,
        env={"LD_LIBRARY_PATH": str(BUNDLE / "bwrap" / "lib")})
    if done.returncode == 0:
        return ""
    return done.stderr.strip() or f"exit {done.returncode}"


def _fresh_python(where: Path) -> Path:
    """This interpreter's base Python in a venv of its own: no site packages, no pip."""
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(where)], check=True, timeout=60)
    return where / "bin" / "python"


def test_the_offline_check_binds_each_job_to_its_own_device(tmp_path: Path) -> None:
    built = subprocess.run(
        [str(ROOT / "scripts" / "gpu-bundle.sh"), "--python-version", VERSION],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHON": sys.executable})
    assert built.returncode == 0, built.stderr
    assert built.stdout.startswith("gpu-bundle: "), built.stdout
    why = _sandbox_unavailable()
    if why:
        pytest.skip(f"the bundle's bwrap cannot create a sandbox here: {why}")
    dev = tmp_path / "dev"
    dev.mkdir()
    _standin_dev(dev)
    nvml_standin.write_capabilities(tmp_path / "capabilities")
    out = tmp_path / "out"
    python = _fresh_python(tmp_path / "venv")
    # nothing to reach: no index, and a proxy that refuses
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path),
           "TMPDIR": str(tmp_path), "PYTHON": str(python), "PIP_NO_INDEX": "1",
           "PIP_CONFIG_FILE": os.devnull, "https_proxy": "http://127.0.0.1:9",
           "http_proxy": "http://127.0.0.1:9"}
    started = time.monotonic()
    done = subprocess.run(
        [str(ROOT / "scripts" / "gpu-check.sh"), "--offline", str(BUNDLE), "--bundled-bwrap",
         "--out", str(out),
         "--nvml", "tests.nvml_standin", "--dev", str(dev),
         "--capabilities", str(tmp_path / "capabilities"),
         "--list-command", _standin_nvidia_smi()],
        capture_output=True, text=True, timeout=300, check=False, env=env, cwd=tmp_path)
    assert time.monotonic() - started < 120, "the check took too long"
    assert (out / "report.json").is_file(), done.stderr
    report = json.loads((out / "report.json").read_text())
    assert "jobs" in report, done.stderr
    assert report["python"].startswith(VERSION)
    assert report["bwrap"].startswith(tmp_path.as_posix()), "the bundle's bwrap was not used"
    jobs = {tuple(j["devices"]): j for j in report["jobs"]}
    mig = [c.uuid for _, c in _mig_instances()]
    assert sorted(jobs) == sorted([("GPU-standin-0000",)] + [(u,) for u in mig]), done.stderr
    # the whole GPU: exactly its own
    whole = jobs[("GPU-standin-0000",)]
    assert whole["seen"] == ["GPU-standin-0000"] and whole["saw_exactly_its_own"]
    assert (out / "jobs" / f"{whole['lease_id']}.txt").read_text() == whole["output"]
    # a MIG instance: its own GPU and itself, never the other GPU nor the instances it shares
    # its GPU with (only its own capability files are bound)
    for u in mig:
        job = jobs[(u,)]
        assert job["seen"] == ["GPU-standin-0001", u], job
        assert job["saw_exactly_its_own"]
    assert done.returncode == 0, done.stderr
