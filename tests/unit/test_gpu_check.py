"""scripts/gpu-check.sh on a machine without an NVIDIA GPU (this one): it must say so in one
line and exit 2, not fail somewhere later. The GPU path itself runs only where a GPU is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agents.probe import probe_gpus

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(bool(probe_gpus().gpus), reason="an NVIDIA GPU is here: run the check itself")
def test_without_a_gpu_the_check_says_so_and_exits_2() -> None:
    done = subprocess.run([str(ROOT / "scripts" / "gpu-check.sh")], capture_output=True,
                          text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("gpu-check: no NVIDIA GPU here"), done.stderr
    assert done.stderr.count("\n") == 1
