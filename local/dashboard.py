"""The demo's live dashboard: progress, queue, capacity and balances from the PostgreSQL views.
A rich Live display on a terminal; elsewhere (CI, a pipe) one progress line every few seconds.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Self

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

_ENDED = ("released", "cancelled", "rejected", "preempted")


class Dashboard:
    def __init__(self, demo: Any, *, live: bool | None = None) -> None:
        self.demo = demo
        self.console = Console()
        self.live = self.console.is_terminal if live is None else live
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                 TextColumn("{task.completed}/{task.total} leases ended"),
                                 TimeElapsedColumn())
        self.task = self.progress.add_task("workload", total=1)

    def counts(self) -> tuple[int, int]:
        tracked = list(self.demo.tracked.values())
        return sum(t.state in _ENDED for t in tracked), len(tracked)

    def render(self) -> Group:
        done, total = self.counts()
        self.progress.update(self.task, completed=done, total=max(total, 1))
        snap: dict[str, Any] = getattr(self.demo, "last_snapshot", {}) or {}
        queue = Table(title="queue (waiting)", expand=False)
        for col in ("tenant", "class", "waiting"):
            queue.add_column(col)
        for q in snap.get("queue", []):
            queue.add_row(q["tenant"], q["priority_class"], str(q["waiting"]))
        cap = Table(title="capacity", expand=False)
        for col in ("pool", "nodes", "ready", "cordoned", "lost", "cores used", "GPUs used"):
            cap.add_column(col)
        for c in snap.get("capacity", []):
            cap.add_row(c["pool"], str(c["nodes"]), str(c["ready"]), str(c["cordoned"]),
                        str(c["lost"]), f"{(c['cpu_used'] or 0) // 1000}/"
                        f"{(c['cpu_alloc'] or 0) // 1000}",
                        f"{c['gpu_used'] or 0}/{c['gpu_alloc'] or 0}")
        bal = Table(title="balances (micro-credits)", expand=False)
        for col in ("tenant", "granted", "held", "spent", "available"):
            bal.add_column(col, justify="right")
        for b in snap.get("balance", []):
            bal.add_row(b["tenant"], f"{b['granted']:,}", f"{b['held']:,}", f"{b['spent']:,}",
                        f"{b['available']:,}")
        running = sum(x["n"] for x in snap.get("leases", []) if x["state"] == "running")
        line = f"{running} leases running"
        return Group(self.progress, line, queue, cap, bal)

    def _plain(self) -> None:
        while not self._stop.wait(5.0):
            done, total = self.counts()
            snap = getattr(self.demo, "last_snapshot", {}) or {}
            waiting = sum(q["waiting"] for q in snap.get("queue", []))
            extra = ""
            running = sum(x["n"] for x in snap.get("leases", []) if x["state"] == "running")
            extra = f", {running} running"
            print(f"[{self.demo.elapsed():5.1f}s] {done}/{total} leases ended, "
                  f"{waiting} waiting{extra}", flush=True)

    def _live(self) -> None:
        with Live(self.render(), console=self.console, refresh_per_second=4,
                  transient=False) as live:
            while not self._stop.wait(0.5):
                live.update(self.render())
            live.update(self.render())

    def __enter__(self) -> Self:
        self._thread = threading.Thread(target=self._live if self.live else self._plain,
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        sys.stdout.flush()
        time.sleep(0)
