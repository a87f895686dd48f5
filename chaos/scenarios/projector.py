"""Fault scenario 4: the projector killed mid-batch; the views equal a rebuild from the log."""

from __future__ import annotations

import random
import threading
import time
import uuid
from functools import partial
from typing import Any

from chaos.harness import (
    Outcome,
    Proc,
    Workspace,
    count_notifications,
    database_url,
    diff_vs_rebuild,
    wait_for,
)

# -- 4. projector kills -----------------------------------------------------------------------------


def scenario_projector_kills(ws: Workspace, size: dict[str, Any], o: Outcome) -> None:
    """A stream of events while `pool projections run` is SIGKILLed whenever it is mid-batch;
    then the views must equal a rebuild from event 1, row for row."""
    from bench.projections import Workload
    from projections import views as pv

    url = ws.nats().url
    db = database_url(ws)
    schema = f"chaos_{uuid.uuid4().hex[:10]}"
    ws.after.append(lambda: pv.drop_schema(db, schema))
    producer = ws.log_reader(url)
    work = Workload(20, 10)
    producer.save(*work.setup())
    target = int(size["events"])
    written = [work.setup_events]
    rng = random.Random(4)

    def write(n: int) -> None:
        """`n` more events over about a second, in saves of 20-400 events."""
        end = written[0] + n
        while written[0] < end:
            aggs, k = work.batch(min(end - written[0], rng.randint(20, 400)))
            producer.save(*aggs)
            written[0] += k
            time.sleep(rng.uniform(0.0, 0.03))

    def position() -> int:
        try:
            pos = pv.positions_at(db, schema)
        except Exception:  # noqa: BLE001 - not created yet
            return 0
        return min((p for p, _ in pos.values()), default=0) if len(pos) == len(pv.VIEWS) else 0

    def projector() -> Proc:
        return ws.spawn(f"projector-{len(ws.procs)}", "projections", "run", "--nats-url", url,
                        "--database-url", db, "--schema", schema, "--batch-size", "200")

    def moved_past(p: int) -> bool:
        return position() > p

    proc = projector()
    kills = mid_stream = 0
    n_kills = int(size["kills"])
    for k in range(n_kills):
        # the next part of the stream, while a fresh projector starts up and works on it
        writer = threading.Thread(target=write, args=((target - written[0]) // (n_kills - k),),
                                  daemon=True)
        writer.start()
        before = position()
        # it must be working, not starting: wait until it has moved, then kill it mid-batch
        if not wait_for(partial(moved_past, before), 60, 0.05):
            o.problems.append("the projector made no progress within 60 s")
            writer.join()
            break
        time.sleep(rng.uniform(0.0, 0.1))
        top = producer.recorder.max_notification_id() or 0
        at = position()
        proc.kill()
        kills += 1
        mid_stream += at < top  # events were waiting for it: it died with work in hand
        writer.join()
        proc = projector()
    top = producer.recorder.max_notification_id() or 0
    caught_up = wait_for(lambda: position() >= top, 120, 0.2)
    proc.stop()
    total = count_notifications(producer)
    applied = {v: a for v, (_p, a) in pv.positions_at(db, schema).items()}
    diff, where = diff_vs_rebuild(producer, db, schema)
    o.figures.update(events=total, kills=kills, kills_mid_stream=mid_stream)
    o.zero("diff_vs_rebuild", diff, where)
    o.zero("lost_or_repeated", sum(abs(total - a) for a in applied.values()),
           f"applied per view {applied}, log {total}")
    o.expect(bool(caught_up), f"the projector did not catch up with {top} in 120 s")
    o.expect(kills == int(size["kills"]), f"{kills} of {size['kills']} kills")
