"""The projector's process (`python -m workers.projector`, `pool projections run`): one
projector from the composition root, folding the log into the views until stopped.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from projections.views import DEFAULT_BATCH, DEFAULT_SCHEMA
from projections.views.retention import history_days
from workers.bootstrap import PlaneConfig, Role, build
from workers.projecting import CATCH_UP_FACTOR, FREEZE_AFTER_EVENTS, PRUNE_EVERY_S, Projector

__all__ = ["CATCH_UP_FACTOR", "FREEZE_AFTER_EVENTS", "PRUNE_EVERY_S", "Projector", "main", "run"]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pool-projector")
    p.add_argument("--nats-url", required=True)
    p.add_argument("--database-url", required=True)
    p.add_argument("--schema", default=DEFAULT_SCHEMA)
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH)
    p.add_argument("--history-days", type=history_days, default=None,
                   help="how long the views keep their past for --at (default "
                   "$POOL_HISTORY_DAYS or 30)")
    args = p.parse_args(argv)
    run(args.nats_url, args.database_url, args.schema, args.batch_size,
        history_max_age_s=args.history_days and args.history_days * 86400)
    return 0


def run(nats_url: str, database_url: str, schema: str, batch_size: int,
        announce: Any = None, *, history_max_age_s: float | None = None) -> None:
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    config = PlaneConfig(nats_url, database_url=database_url, views_schema=schema,
                         projector_batch_size=batch_size, history_max_age_s=history_max_age_s)
    proj = build(config, {Role.PROJECTOR}).projector
    assert proj is not None  # a database is given
    if announce:
        announce(f"projecting {nats_url} into schema {schema}: Ctrl-C to stop")
    try:
        proj.run_forever(stop)
    finally:
        proj.stop()
        from bus.runtime import close_runtime

        close_runtime(nats_url)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
