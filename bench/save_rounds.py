"""`python -m bench.save_rounds`: one round of single-message saves, three ways, side by side
(inner figure): an atomic batch, a request each, and the requests in one write."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench.machine import machine_line
from bus.local.server import NatsServer

WAYS = ("atomic batch", "a request each", "one write")


def run_save_rounds(*, size: int = 16, rounds: int = 300, repeats: int = 3) -> dict[str, Any]:
    """Per way: the client's CPU µs per message and the wall ms per round, one figure per
    repeat, the ways alternated within each repeat."""
    with tempfile.TemporaryDirectory(prefix="pool-bench-rounds-") as tmp:
        server = NatsServer(store_dir=Path(tmp), server_name="pool-bench-rounds").start()
        try:
            out = asyncio.run(_run(server.url, size, rounds, repeats))
        finally:
            server.stop()
    return {"size": size, "rounds": rounds, "repeats": repeats, "ways": out,
            "one_write_cpu_ratio": statistics.median(
                w / r for w, r in zip(out["one write"]["cpu_us_per_message"],
                                      out["a request each"]["cpu_us_per_message"],
                                      strict=True)),
            "machine": machine_line()}


async def _run(url: str, size: int, rounds: int, repeats: int) -> dict[str, dict[str, list[float]]]:
    import nats

    from bus.jetstream.natsfast import publish_atomic, request_each
    from bus.jetstream.wire import _header_dict

    nc = await nats.connect(url)
    try:
        await nc.jetstream().add_stream(name="ROUNDS", subjects=["rounds.>"],
                                        allow_atomic=True)
        # one message per subject, as the group commit's rounds are (a save per aggregate)
        msgs = [(f"rounds.{i}", b"x" * 300, f"Pool-Id: {i}\r\nPool-Kind: uuid\r\n")
                for i in range(size)]

        async def batch() -> object:
            return await publish_atomic(nc, [(s, p, _header_dict(h)) for s, p, h in msgs])

        async def each() -> object:
            return await asyncio.gather(*(nc.request(s, p, headers=_header_dict(h), timeout=10)
                                          for s, p, h in msgs))

        async def one_write() -> object:
            return await request_each(nc, msgs)

        fns: dict[str, Callable[[], Awaitable[object]]] = {
            "atomic batch": batch, "a request each": each, "one write": one_write}
        out: dict[str, dict[str, list[float]]] = {
            w: {"cpu_us_per_message": [], "ms_per_round": []} for w in WAYS}
        for _ in range(repeats):
            for way in WAYS:
                c0, t0 = time.process_time(), time.perf_counter()
                for _ in range(rounds):
                    await fns[way]()
                c1, t1 = time.process_time(), time.perf_counter()
                out[way]["cpu_us_per_message"].append((c1 - c0) / (rounds * size) * 1e6)
                out[way]["ms_per_round"].append((t1 - t0) / rounds * 1e3)
        return out
    finally:
        await nc.close()


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
