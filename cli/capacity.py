"""`pool capacity --by KEY`: free capacity per rack, block, NVLink domain, zone or failure
domain, folded from the event log's node ledgers (plain `pool capacity` reads the views)."""

from __future__ import annotations

import argparse
import json

from cli.connect import close_app, log_app
from cli.output import EXIT_OK, UsageError, table


def cmd_capacity(args: argparse.Namespace) -> int:
    from domain.topology import TOPOLOGY_LABELS, TRAIT_KEYS, capacity_by

    if args.by not in TOPOLOGY_LABELS + TRAIT_KEYS:
        raise UsageError(f"--by: one of {', '.join(TOPOLOGY_LABELS + TRAIT_KEYS)}, "
                         f"not {args.by!r}")
    app = log_app(args)
    try:
        ids = []
        start = 1
        while True:  # the node ledgers the log holds: every NodeRegistered names one
            page = app.recorder.select_notifications(start, 1000)
            if not page:
                break
            ids += [n.originator_id for n in page if n.topic.endswith(".NodeRegistered")]
            start = page[-1].id + 1
        nodes = capacity_by((app.repository.get(i) for i in dict.fromkeys(ids)), args.by,
                            pool=args.pool)
    finally:
        close_app(app, args)
    if args.json:
        print(json.dumps({"ok": True, "result": {"by": args.by, "rows": nodes}}))
    else:
        print(table(nodes, (args.by, "nodes", "ready", "gpus", "gpus_free",
                            "whole_gpu_nodes_free", "cpu_millis", "cpu_millis_free")))
    return EXIT_OK


def add_by_options(cp: argparse.ArgumentParser) -> None:
    """`--by KEY` (and what it needs) on `pool capacity`."""
    cp.add_argument("--by", metavar="KEY", help="free capacity per domain of KEY instead, folded from the "
                    "log: rack | block | nvlink_domain | zone | region | failure_domain")
    cp.add_argument("--pool", help="with --by: only this pool's nodes")
    cp.add_argument("--nats-url", help="with --by: the NATS server (default: POOL_NATS_URL or "
                    "`pool up`)")
