"""What the agent keeps on disk across its restarts: the jobs it started (so that a redelivered
order never starts one twice) and each lease's particulars (to re-adopt its workload).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class Ledger:
    """`started.json` and `leases/<lease id>.json` in the agent's state folder."""

    def __init__(self, state_dir: Path) -> None:
        self._started_file = state_dir / "started.json"
        self.started: set[str] = set(self._load_started())
        self._meta_dir = state_dir / "leases"
        self._meta_dir.mkdir(exist_ok=True)

    def _load_started(self) -> list[str]:
        try:
            return list(json.loads(self._started_file.read_text()))
        except (OSError, ValueError):
            return []

    def record_started(self, key: str) -> None:
        """Written BEFORE the start: a crash in between loses a start, never doubles one."""
        self.started.add(key)
        tmp = self._started_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(sorted(self.started)))
        tmp.replace(self._started_file)

    def write_meta(self, lease_id: str, meta: dict[str, Any]) -> None:
        (self._meta_dir / f"{lease_id}.json").write_text(json.dumps(meta))

    def read_meta(self, lease_id: str) -> dict[str, Any]:
        try:
            return json.loads((self._meta_dir / f"{lease_id}.json").read_text())  # type: ignore[no-any-return]
        except (OSError, ValueError):
            return {}
