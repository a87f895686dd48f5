"""STYLE.md: `ruff` and `mypy --strict` on domain/ and schemas/ at least. Both run here, so the
README's one test command is also the lint gate."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("domain", "schemas")


def _run(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).parent / tool
    if not exe.exists():
        pytest.fail(f"{tool} is not installed beside this Python: pip install -e '.[test]'")
    return subprocess.run([str(exe), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=240, check=False)


def test_ruff_finds_nothing_in_domain_and_schemas() -> None:
    done = _run("ruff", "check", "--no-cache", *CHECKED)
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_strict_finds_nothing_in_domain_and_schemas() -> None:
    # strict comes from pyproject.toml ([tool.mypy] strict = true); said again so that a
    # change there cannot quietly loosen this gate
    done = _run("mypy", "--strict", "--no-incremental", *CHECKED)
    assert done.returncode == 0, done.stdout + done.stderr
