"""`python -m bench.ended`: a scheduler's (and, `--dispatcher`, the dispatcher's) start-up after
a growing number of ended leases, by a full replay and from a checkpoint, side by side in one run
(docs/performance-log.md)."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.queued import in_process, write_log
from bus.local.server import NatsServer

STEPS = (10_000, 30_000, 100_000)  # ended leases in the log at each measurement
QUICK_STEPS = (300, 600, 1_200)
TAIL = 100  # leases ended after each checkpoint: what a start-up from it folds
PER_SAVE = 249  # leases a save: four events each, under the 1000-message atomic batch
NODES = 100


def _end_leases(url: str, start: int, count: int) -> None:
    """`count` leases through request → reserve → commit → release, as their events land in
    the log (no agent, node or account events: the scheduler folds each lease's four)."""
    from bench.schedule import TENANTS
    from domain.lease import Lease
    from domain.resources import NodeId, PoolId, Shape, TenantId
    from workers.application import PoolApp
    from workers.bootstrap import app_env

    app = PoolApp(env=app_env(url))
    now = time.time()
    shape = Shape.build(cpu_millis=1000, memory_mib=2048)
    for first in range(start, start + count, PER_SAVE):
        batch = []
        for i in range(first, min(start + count, first + PER_SAVE)):
            lease = Lease.request(
                tenant_id=TenantId(TENANTS[i % 3][0]), pool_id=PoolId("bench"),
                idempotency_key=f"e{i}", shape=shape, maximum_runtime_seconds=3600, now=now,
                priority_class="standard", queued=True)
            lease.reserve(now, node_id=NodeId(f"n{i % NODES:05d}"),
                          commit_timeout_seconds=3600, hold_microcredits=0)
            lease.commit(now)
            lease.release(now)
            batch.append(lease)
        app.save(*batch)
    app.close()


def _start_dispatcher(url: str, out: Any, key: bytes | None, write: bool) -> None:
    """In a process of its own: a fresh dispatcher (lease feed included) folds the log to its
    end, from the checkpoint when `key` is given and not `write`; with `write`, it checkpoints
    its fold after the replay. Orders and feed records already sent are not sent again."""
    from bench.queued import rss_mib
    from bus.agentbus import ControlLink
    from bus.checkpoints import CheckpointStore
    from bus.feed import FeedWriter
    from workers.application import PoolApp
    from workers.bootstrap import app_env
    from workers.dispatcher import Dispatcher
    from workers.feed import FeedPublisher
    from workers.scheduler.checkpoint import Checkpointer

    dispatcher = Dispatcher(PoolApp(env=app_env(url)), ControlLink(url),
                            feed=FeedPublisher(FeedWriter(url)))
    checkpoints = None
    if key is not None:
        checkpoints = Checkpointer(CheckpointStore(url, name="dispatcher"), key,
                                   purpose="dispatcher")
        checkpoints.tried = write  # the full replay reads none
        dispatcher.checkpoints = checkpoints
    t0, c0 = time.perf_counter(), time.process_time()
    events = 0
    while True:
        n = dispatcher.step()
        events += n
        if not n:
            break
    replay_s, replay_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    rss, _ = rss_mib()
    written: dict[str, Any] = {}
    if checkpoints is not None and write:
        assert checkpoints.write_now(dispatcher)
        written = {"checkpoint_bytes": checkpoints.last_bytes}
    out.put({"events": events, "replay_s": replay_s, "replay_cpu_s": replay_cpu_s,
             "rss_after_replay_mib": rss, **written})


def _dispatcher_in_process(url: str, key: bytes | None, write: bool = False) -> dict[str, Any]:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out: Any = ctx.Queue()
    proc = ctx.Process(target=_start_dispatcher, args=(url, out, key, write), daemon=True)
    proc.start()
    result: dict[str, Any] = out.get(timeout=3600)
    proc.join(60)
    return result


def run_ended_bench(*, steps: Sequence[int] = STEPS, quick: bool = False,
                    progress: Callable[[str], None] | None = None,
                    dispatcher: bool = False) -> dict[str, Any]:
    """At each step: that many leases ended in the log; a fresh scheduler process replays it
    all and checkpoints its fold, TAIL more leases end, and another fresh process starts from
    the checkpoint. With `dispatcher`, the same for the dispatcher (after an untimed one has
    sent the orders and feed records, which a restart does not send again)."""
    from bus.admin import ensure_all_streams
    from bus.runtime import close_runtime

    if quick:
        steps = QUICK_STEPS
    say = progress or (lambda _s: None)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pool-bench-ended-") as tmp:
        server = NatsServer(store_dir=Path(tmp), server_name="pool-bench-ended").start()
        try:
            url = server.url
            ensure_all_streams(url)
            write_log(url, NODES, 0, say)
            ended = 0
            key = os.urandom(32)
            for step in sorted(steps):
                _end_leases(url, ended, step - ended)
                ended = step
                close_runtime(url)
                say(f"bench ended: {ended:,} leases ended; a fresh scheduler replays them")
                full = in_process(url, key, write=True)
                dfull: dict[str, Any] = {}
                if dispatcher:
                    say(f"bench ended: {ended:,} leases ended; dispatchers replay them")
                    _dispatcher_in_process(url, None)  # sends what is new: not timed
                    dfull = _dispatcher_in_process(url, key, write=True)
                _end_leases(url, ended, TAIL)
                ended += TAIL
                close_runtime(url)
                restored = in_process(url, key)
                if dispatcher:
                    _dispatcher_in_process(url, None)  # sends the tail's orders: not timed
                    drestored = _dispatcher_in_process(url, key)
                    rows_extra = {
                        "dispatcher_full_replay_s": dfull["replay_s"],
                        "dispatcher_full_replay_cpu_s": dfull["replay_cpu_s"],
                        "dispatcher_checkpoint_bytes": dfull["checkpoint_bytes"],
                        "dispatcher_from_checkpoint_s": drestored["replay_s"],
                        "dispatcher_from_checkpoint_cpu_s": drestored["replay_cpu_s"],
                        "dispatcher_events_after_checkpoint": drestored["events"]}
                else:
                    rows_extra = {}
                rows.append({"ended": step, "events": full["events"],
                             "full_replay_s": full["replay_s"],
                             "full_replay_cpu_s": full["replay_cpu_s"],
                             "checkpoint_bytes": full["checkpoint_bytes"],
                             "from_checkpoint_s": restored["replay_s"],
                             "from_checkpoint_cpu_s": restored["replay_cpu_s"],
                             "events_after_checkpoint": restored["events"],
                             "rss_after_full_mib": full["rss_after_replay_mib"],
                             "rss_after_checkpoint_mib": restored["rss_after_replay_mib"],
                             **rows_extra})
        finally:
            server.stop()
    lines = [(f"{'ended leases':>12} {'events':>9} {'full replay s':>14} {'from ckpt s':>12} "
              f"{'ratio':>6} {'ckpt KiB':>9} {'RSS full/ckpt MiB':>18}")]
    for r in rows:
        lines.append(f"{r['ended']:12,} {r['events']:9,} {r['full_replay_s']:14.2f} "
                     f"{r['from_checkpoint_s']:12.2f} "
                     f"{r['from_checkpoint_s'] / max(r['full_replay_s'], 1e-9):6.2f} "
                     f"{r['checkpoint_bytes'] / 1024:9,.0f} "
                     f"{r['rss_after_full_mib']:8,.0f}/{r['rss_after_checkpoint_mib']:,.0f}")
    if dispatcher:
        lines.append(f"{'dispatcher':>12} {'':>9} {'full replay s':>14} {'from ckpt s':>12} "
                     f"{'ratio':>6} {'ckpt KiB':>9}")
        for r in rows:
            lines.append(f"{r['ended']:12,} {'':>9} {r['dispatcher_full_replay_s']:14.2f} "
                         f"{r['dispatcher_from_checkpoint_s']:12.2f} "
                         f"{r['dispatcher_from_checkpoint_s'] / max(r['dispatcher_full_replay_s'], 1e-9):6.2f} "
                         f"{r['dispatcher_checkpoint_bytes'] / 1024:9,.0f}")
    lines.append(f"each start-up from a checkpoint folds the {TAIL} leases ended after it; "
                 f"machine: {os.cpu_count()} cores")
    return {"steps": rows, "table": "\n".join(lines)}


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m bench.ended",
        description="A scheduler's start-up after N ended leases: full replay and from a "
        "checkpoint, N growing.")
    parser.add_argument("--steps", default=",".join(str(s) for s in STEPS),
                        help="ended leases at each measurement, comma-separated "
                        f"(default {','.join(str(s) for s in STEPS)})")
    parser.add_argument("--quick", action="store_true",
                        help=f"steps {','.join(str(s) for s in QUICK_STEPS)}")
    parser.add_argument("--dispatcher", action="store_true",
                        help="also time the dispatcher's start-up, full and from its checkpoint")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    try:
        steps = [int(s) for s in args.steps.split(",") if s.strip()]
    except ValueError:
        print("error: --steps takes whole numbers, comma-separated", file=sys.stderr)
        return 2
    if not steps or min(steps) < 1:
        print("error: every step must be at least 1", file=sys.stderr)
        return 2
    result = run_ended_bench(steps=steps, quick=args.quick, dispatcher=args.dispatcher,
                             progress=lambda s: print(s, file=sys.stderr))
    print(json.dumps(result, indent=2) if args.json else result["table"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
