"""`python -m bench.audit_incremental`: the nightly credit audit from a checkpoint, timed.
What it measures and how: docs/architecture.md#the-benchmarks.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bus.local.server import NatsServer


def run_incremental_audit_bench(*, events: int = 1_000_000, last: int = 10_000,
                                quick: bool = False,
                                progress: Callable[[str], None] | None = None
                                ) -> dict[str, Any]:
    if quick:
        events, last = min(events, 50_000), min(last, 5_000)
    say = progress or (lambda _s: None)
    with tempfile.TemporaryDirectory(prefix="pool-bench-audit-") as tmp:
        server = NatsServer(store_dir=Path(tmp), server_name="pool-bench-audit").start()
        try:
            return _run(server.url, events, last, say)
        finally:
            from bus.runtime import close_runtime

            close_runtime(server.url)
            server.stop()


def _run(url: str, events: int, last: int, say: Callable[[str], None]) -> dict[str, Any]:
    from bench.projections import Workload
    from bus.admin import ensure_all_streams
    from projections.audit import CreditAudit
    from projections.audit_checkpoint import ChainedAudit
    from workers.application import PoolApp
    from workers.bootstrap import app_env

    ensure_all_streams(url)
    app = PoolApp(env=app_env(url))
    work = Workload(tenants=200, nodes=50)
    app.save(*work.setup())
    written = work.setup_events
    say(f"bench audit: writing {events:,} events")
    while written < events:
        aggs, n = work.batch(events - written)
        app.save(*aggs)
        written += n
        if written % 100_000 < n:
            say(f"bench audit: {written:,} events written")
    top = app.recorder.max_notification_id() or 0
    at = max(0, top - last)
    say(f"bench audit: a checkpoint at {at:,} (a full audit up to there, not timed)")
    before = ChainedAudit(app, stop=at)
    before.run()
    checkpoint = before.checkpoint()

    say(f"bench audit: the audit from the checkpoint over the last {top - at:,} events")
    t0 = time.perf_counter()
    after = ChainedAudit(app, checkpoint=checkpoint)
    incremental = after.run()
    incremental_s = time.perf_counter() - t0
    say("bench audit: a full replay from sequence 1, for comparison")
    t1 = time.perf_counter()
    full = CreditAudit(app).run()
    full_s = time.perf_counter() - t1
    same = ({t: c.figures() for t, c in incremental.tenants.items()}
            == {t: c.figures() for t, c in full.tenants.items()})
    app.close()
    lines = [
        f"{'figure':52} {'value':>12}",
        "-" * 66,
        f"{'events in the log':52} {top:12,}",
        f"{'events after the checkpoint':52} {top - at:12,}",
        f"{'audit from the checkpoint (s)':52} {incremental_s:12.3f}",
        f"{'full replay from sequence 1 (s)':52} {full_s:12.3f}",
        f"{'same balances and findings':52} {'yes' if same and incremental.ok == full.ok else 'NO':>12}",
        f"machine: {os.cpu_count()} cores; nats-server 2.15 file storage, sync_interval always",
    ]
    return {"events": top, "after_checkpoint": top - at, "incremental_s": incremental_s,
            "full_s": full_s, "same": same, "ok": incremental.ok and full.ok,
            "table": "\n".join(lines)}


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m bench.audit_incremental",
        description="The credit audit from a checkpoint over the log's last events, timed.")
    parser.add_argument("--events", type=int, default=1_000_000,
                        help="events in the log (default 1,000,000)")
    parser.add_argument("--last", type=int, default=10_000,
                        help="events after the checkpoint (default 10,000)")
    parser.add_argument("--quick", action="store_true", help="50,000 events, the last 5,000")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    if args.events < 1 or args.last < 1:
        print("error: --events and --last must be at least 1", file=sys.stderr)
        return 2
    result = run_incremental_audit_bench(events=args.events, last=args.last, quick=args.quick,
                                         progress=lambda s: print(s, file=sys.stderr))
    print(json.dumps(result, indent=2) if args.json else result["table"])
    return 0 if result["same"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
