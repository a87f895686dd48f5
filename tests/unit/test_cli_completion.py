"""`pool completion bash` completes commands and flags from the parser; `pool --version`."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _complete(script: str, *words: str) -> list[str]:
    line = " ".join(words)
    probe = (f'{script}\nCOMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; _pool_complete; '
             'printf "%s\\n" "${COMPREPLY[@]}"')
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True)
    return out.stdout.split()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_bash_completion_offers_the_verbs_and_flags_of_the_command_typed_so_far() -> None:
    script = subprocess.run([sys.executable, "-m", "cli.main", "completion", "bash"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    assert _complete(script, "pool", "lea") == ["lease", "leases"]
    assert _complete(script, "pool", "lease", "ru") == ["run"]
    assert "--cpu-millis" in _complete(script, "pool", "lease", "run", "--cpu")
    assert "--tenant" in _complete(script, "pool", "--json", "lease", "logs", "x", "--")


def test_pool_version_names_the_package_version() -> None:
    out = subprocess.run([sys.executable, "-m", "cli.main", "--version"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("pool ") and "computepool" in out
