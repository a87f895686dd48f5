"""`python -m bench.save_rounds`: one round of single-message saves, three ways, side by side
(inner figure): an atomic batch, a request each, and the requests in one write."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.bus_rates import SAVE_ROUND_WAYS as WAYS
from bench.bus_rates import save_round_ways
from bench.machine import machine_line
from bus.local.server import NatsServer


def run_save_rounds(*, size: int = 16, rounds: int = 300, repeats: int = 3) -> dict[str, Any]:
    """Per way: the client's CPU µs per message and the wall ms per round, one figure per
    repeat, the ways alternated within each repeat."""
    with tempfile.TemporaryDirectory(prefix="pool-bench-rounds-") as tmp:
        server = NatsServer(store_dir=Path(tmp), server_name="pool-bench-rounds").start()
        try:
            out = asyncio.run(save_round_ways(server.url, size, rounds, repeats))
        finally:
            server.stop()
    return {"size": size, "rounds": rounds, "repeats": repeats, "ways": out,
            "one_write_cpu_ratio": statistics.median(
                w / r if r else float("nan")
                for w, r in zip(out["one write"]["cpu_us_per_message"],
                                out["a request each"]["cpu_us_per_message"], strict=True)),
            "machine": machine_line()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.save_rounds", description=__doc__)
    ap.add_argument("--size", type=int, default=16, help="messages per round (default 16)")
    ap.add_argument("--rounds", type=int, default=300, help="rounds per repeat (default 300)")
    ap.add_argument("--repeats", type=int, default=3, help="alternations (default 3)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    for name in ("size", "rounds", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    result = run_save_rounds(size=args.size, rounds=args.rounds, repeats=args.repeats)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"a round of {args.size} single-message saves, {args.rounds} rounds, "
          f"{args.repeats} alternations (medians):")
    for way in WAYS:
        got = result["ways"][way]
        print(f"  {way:<15} client CPU {statistics.median(got['cpu_us_per_message']):6.1f} µs a "
              f"message, {statistics.median(got['ms_per_round']):6.2f} ms a round")
    print(f"one write ÷ a request each, client CPU: {result['one_write_cpu_ratio']:.2f}")
    print(f"machine: {result['machine']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
