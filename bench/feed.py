"""`python -m bench.feed`: what the lease feed costs the dispatcher replaying a log (inner figure).
Each round, side by side: the dispatcher alone, with the feed writing every record, and with
the feed already written (a restart)."""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bus.local.server import NatsServer

PER_REQUEST = 999  # leases per request (`count`, at most 999): one event each


def run_feed_bench(*, requests: int = 40, rounds: int = 3) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="pool-bench-feed-") as tmp:
        server = NatsServer(store_dir=Path(tmp), server_name="pool-bench-feed").start()
        try:
            return _run(server.url, requests, rounds)
        finally:
            from bus.runtime import close_runtime

            close_runtime(server.url)
            server.stop()


def _run(url: str, requests: int, rounds: int) -> dict[str, Any]:
    from bus.admin import ensure_all_streams
    from client.api import PoolClient
    from workers.plane import ControlPlane

    ensure_all_streams(url)
    plane = ControlPlane(url, run_scheduler=False, data_plane=False).start()
    try:
        with PoolClient(url) as admin, PoolClient(url, "alpha") as alpha:
            assert admin.admin("pool.set", {"pool_id": "p1"})["ok"]
            assert admin.admin("tenant.set", {"tenant": "alpha", "pool_id": "p1",
                                              "weight": 1.0})["ok"]
            assert admin.admin("credits.grant", {"tenant": "alpha", "amount_microcredits":
                                                 10**15, "transfer_id": "bench"})["ok"]
            for i in range(requests):
                reply = alpha.request_lease({
                    "pool_id": "p1", "shape": {"cpu_millis": 100, "memory_mib": 64},
                    "maximum_runtime_seconds": 60, "idempotency_key": f"feed-{i}",
                    "count": PER_REQUEST})
                assert reply["ok"], reply
    finally:
        plane.stop()
    records = PER_REQUEST * requests
    out: dict[str, list[float]] = {"alone": [], "writing": [], "written": []}
    for _ in range(rounds):
        out["alone"].append(_replay(url, feed=False, fresh=True, records=records))
        out["writing"].append(_replay(url, feed=True, fresh=True, records=records))
        out["written"].append(_replay(url, feed=True, fresh=False, records=records))
    return {
        "records": records,
        "seconds": out,
        "writing_ratio": statistics.median(w / a for w, a in zip(out["writing"], out["alone"],
                                                                  strict=True)),
        "written_ratio": statistics.median(w / a for w, a in zip(out["written"], out["alone"],
                                                                  strict=True)),
    }


def _replay(url: str, *, feed: bool, fresh: bool, records: int) -> float:
    """Seconds for a new dispatcher to fold the whole log (from a feed of nothing when
    `fresh`)."""
    from bus.agentbus import ControlLink
    from bus.feed import FeedWriter
    from bus.runtime import run_sync
    from workers.application import PoolApp
    from workers.bootstrap import app_env
    from workers.dispatcher import Dispatcher
    from workers.feed import FeedPublisher

    if fresh:
        run_sync(_forget(url))
    app = PoolApp(env=app_env(url))
    dispatcher = Dispatcher(app, ControlLink(url),
                            feed=FeedPublisher(FeedWriter(url)) if feed else None)
    t0 = time.perf_counter()
    while dispatcher.step():
        pass
    seconds = time.perf_counter() - t0
    if feed and fresh:
        assert dispatcher.feed is not None and dispatcher.feed.records_written == records
    app.close()
    return seconds


async def _forget(url: str) -> None:
    """No feed and no saved positions: the next dispatcher starts as on a new pool."""
    from bus.agentbus import POSITIONS_BUCKET
    from bus.connection import connect
    from bus.feed import POSITION_KEY
    from bus.subjects import FEED_STREAM
    from workers.dispatcher import POSITION_KEY as DISPATCHER_KEY

    nc = await connect(url)
    js = nc.jetstream()
    try:
        with contextlib.suppress(Exception):  # not made yet
            await js.delete_stream(FEED_STREAM)
        kv = await js.key_value(POSITIONS_BUCKET)
        for key in (POSITION_KEY, DISPATCHER_KEY):
            with contextlib.suppress(Exception):  # not saved yet
                await kv.delete(key)
    finally:
        await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.feed", description=__doc__)
    parser.add_argument("--requests", type=int, default=40,
                        help=f"requests of {PER_REQUEST} leases each (one event a lease)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(run_feed_bench(requests=args.requests, rounds=args.rounds), indent=1))


if __name__ == "__main__":
    main()
