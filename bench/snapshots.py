"""`python -m bench.snapshots`: the cold load of an account with a long history, through its
latest snapshot and from its whole history, alternated in one run on one nats-server."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

TENANT = "long-history"
SAVE = 100  # events per save while the history is written


def run_snapshot_bench(*, movements: int = 20_000, tail: int = 250, runs: int = 7,
                       quick: bool = False) -> dict[str, Any]:
    """`movements` credit movements on one account (a grant every hundred, the rest holds and
    settlements), one snapshot, then `tail` more; `runs` cold loads each way, alternated."""
    from bus.local.server import NatsServer
    from bus.runtime import close_runtime

    if quick:
        movements, tail, runs = min(movements, 2_000), min(tail, 50), min(runs, 3)
    with tempfile.TemporaryDirectory(prefix="pool-bench-snap-") as tmp:
        server = NatsServer(store_dir=Path(tmp), server_name="pool-bench-snap").start()
        try:
            return _run(server.url, movements, tail, runs)
        finally:
            close_runtime(server.url)
            server.stop()


def _tid() -> str:
    """A transfer id as the command path makes one (random hex): an account's snapshot is
    mostly its window of them."""
    return uuid.uuid4().hex


def _write(app: Any, count: int, start: int) -> None:
    from domain.account import Account
    from domain.resources import LeaseId, TenantId

    acc = app.find(Account, Account.create_id(TENANT)) or Account.open(
        tenant_id=TenantId(TENANT), now=0.0)
    pending = 0
    for i in range(start, start + count):
        lease = LeaseId(f"lease-{i // 2}")
        if i % 100 == 0:
            acc.grant(_tid(), 1_000_000, now=float(i))
        elif i % 2 == 0:
            acc.hold(_tid(), lease, 500, now=float(i))
        elif acc.has_hold(lease):
            acc.settle(_tid(), lease, 300, now=float(i))
        else:
            acc.hold(_tid(), lease, 500, now=float(i))
        pending += 1
        if pending >= SAVE:
            app.save(acc)
            pending = 0
    app.save(acc)


def _cold_load(url: str, snapshots: bool) -> tuple[float, int, int]:
    """Seconds to load the account in an application that has never seen it, the log
    messages its events recorder read, and the account's version."""
    from domain.account import Account
    from workers.application.core import Store
    from workers.bootstrap import app_env

    app = Store(env=app_env(url, IS_SNAPSHOTTING_ENABLED="y" if snapshots else "n",
                              POOL_SNAPSHOT_INTERVAL="0"))
    try:
        aid = Account.create_id(TENANT)
        t0 = time.perf_counter()
        acc = app.find(Account, aid)
        took = time.perf_counter() - t0
        assert acc is not None
        return took, int(app.recorder.messages_read), int(acc.version)  # type: ignore[attr-defined]
    finally:
        app.close()


def _run(url: str, movements: int, tail: int, runs: int) -> dict[str, Any]:
    from bus.admin import ensure_all_streams
    from domain.account import Account
    from workers.application.core import Store
    from workers.bootstrap import app_env

    ensure_all_streams(url)
    writer = Store(env=app_env(url, POOL_SNAPSHOT_INTERVAL="0"))
    try:
        _write(writer, movements, 0)
        aid = Account.create_id(TENANT)
        snapshot_version = writer.snapshotting.take(aid)
        _write(writer, tail, movements)
        assert writer.snapshots is not None
        stored = writer.snapshots.recorder.select_events(aid, desc=True, limit=1)
        snapshot_bytes = len(stored[0].state) if stored else 0
    finally:
        writer.close()
    with_snap: list[float] = []
    without: list[float] = []
    read = {True: 0, False: 0}
    version = 0
    for i in range(runs * 2):
        snap = i % 2 == 0  # alternated, so both see the same load on the machine
        took, messages, version = _cold_load(url, snap)
        (with_snap if snap else without).append(took)
        read[snap] = messages
    from bench.machine import machine_line

    a, b = statistics.median(with_snap), statistics.median(without)
    return {
        "movements": movements, "events": version, "snapshot_version": snapshot_version,
        "snapshot_bytes": snapshot_bytes, "runs": runs,
        "with_snapshot_ms": round(a * 1000, 1), "messages_with_snapshot": read[True],
        "with_snapshot_runs_ms": [round(t * 1000, 1) for t in with_snap],
        "whole_history_ms": round(b * 1000, 1), "messages_whole_history": read[False],
        "whole_history_runs_ms": [round(t * 1000, 1) for t in without],
        "ratio": round(b / a, 1) if a else None,
        "machine": machine_line(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.snapshots", description=__doc__)
    p.add_argument("--movements", type=int, default=20_000)
    p.add_argument("--tail", type=int, default=250, help="movements after the snapshot")
    p.add_argument("--runs", type=int, default=7, help="cold loads each way")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    out = run_snapshot_bench(movements=args.movements, tail=args.tail, runs=args.runs,
                             quick=args.quick)
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
