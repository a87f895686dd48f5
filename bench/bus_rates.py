"""`pool bench eventlog`: raw JetStream rates next to eventsourcing saves, measured in one run.
Why each figure is a median and a ratio to the raw rate: docs/architecture.md#the-benchmarks.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bus.connection import connect
from bus.headers import HDR_BATCH_COMMIT, HDR_BATCH_ID, HDR_BATCH_SEQ
from bus.local.server import NatsServer
from bus.streams import scratch_stream_config

ROUNDS = 3


async def _raw_rates(url: str, messages: int, batch_sizes: tuple[int, ...]) -> dict[str, float]:
    nc = await connect(url)
    js = nc.jetstream()
    config = scratch_stream_config("bench")
    stream = str(config.name)
    await js.add_stream(config)
    subj = f"bench.{stream}"
    payload = b"x" * 200
    out: dict[str, list[float]] = {"awaited": [], "pipelined": []}
    for size in batch_sizes:
        out[f"atomic_{size}"] = []
    try:
        for _ in range(ROUNDS):
            n = max(1, messages // 10)
            t0 = time.perf_counter()
            for i in range(n):
                await js.publish(f"{subj}.a.{i % 100}", payload)
            out["awaited"].append(n / (time.perf_counter() - t0))

            t0 = time.perf_counter()
            window = 512
            for start in range(0, messages, window):
                await asyncio.gather(
                    *(
                        js.publish(f"{subj}.p.{i % 100}", payload)
                        for i in range(start, min(messages, start + window))
                    )
                )
            out["pipelined"].append(messages / (time.perf_counter() - t0))

            for size in batch_sizes:
                batches = max(1, messages // size // (4 if size < 10 else 1))
                t0 = time.perf_counter()
                for _b in range(batches):
                    await atomic_batch(nc, [(f"{subj}.b.{i}", payload) for i in range(size)])
                out[f"atomic_{size}"].append(batches * size / (time.perf_counter() - t0))
    finally:
        await js.delete_stream(stream)
        await nc.close()
    return {k: statistics.median(v) for k, v in out.items()}


async def atomic_batch(nc: Any, messages: list[tuple[str, bytes]]) -> None:
    """Publish `messages` as one JetStream atomic batch (ADR-50); raises if it did not land."""
    batch_id = uuid.uuid4().hex
    last = len(messages)
    for i, (subject, data) in enumerate(messages, start=1):
        headers = {HDR_BATCH_ID: batch_id, HDR_BATCH_SEQ: str(i)}
        if i == last:
            headers[HDR_BATCH_COMMIT] = "1"
            reply = await nc.request(subject, data, headers=headers, timeout=10)
            if b'"error"' in reply.data:
                raise RuntimeError(reply.data.decode())
        else:
            await nc.publish(subject, data, headers=headers)


SAVE_ROUND_WAYS = ("atomic batch", "a request each", "one write")


async def save_round_ways(url: str, size: int, rounds: int,
                          repeats: int) -> dict[str, dict[str, list[float]]]:
    """One round of `size` one-message saves sent `rounds` times each way (SAVE_ROUND_WAYS),
    the ways alternated `repeats` times: per way the client's CPU µs per message and the wall
    ms per round, one figure a repeat (bench/save_rounds.py)."""
    from bus.jetstream.natsfast import publish_atomic, request_each
    from bus.jetstream.wire import header_dict

    nc = await connect(url)
    try:
        await nc.jetstream().add_stream(name="ROUNDS", subjects=["rounds.>"],
                                        allow_atomic=True)
        # one message per subject, as the group commit's rounds are (a save per aggregate)
        msgs = [(f"rounds.{i}", b"x" * 300, f"Pool-Id: {i}\r\nPool-Kind: uuid\r\n")
                for i in range(size)]

        async def batch() -> object:
            return await publish_atomic(nc, [(s, p, header_dict(h)) for s, p, h in msgs])

        async def each() -> object:
            return await asyncio.gather(*(nc.request(s, p, headers=header_dict(h), timeout=10)
                                          for s, p, h in msgs))

        async def one_write() -> object:
            return await request_each(nc, msgs)

        fns: dict[str, Callable[[], Awaitable[object]]] = {
            "atomic batch": batch, "a request each": each, "one write": one_write}
        out: dict[str, dict[str, list[float]]] = {
            w: {"cpu_us_per_message": [], "ms_per_round": []} for w in SAVE_ROUND_WAYS}
        for _ in range(repeats):
            for way in SAVE_ROUND_WAYS:
                c0, t0 = time.process_time(), time.perf_counter()
                for _ in range(rounds):
                    await fns[way]()
                c1, t1 = time.process_time(), time.perf_counter()
                out[way]["cpu_us_per_message"].append((c1 - c0) / (rounds * size) * 1e6)
                out[way]["ms_per_round"].append((t1 - t0) / rounds * 1e3)
        return out
    finally:
        await nc.close()


def serve_stateless_replies(url: str, subject: str, ready: Any, stop: Any) -> None:
    """In a process of its own: answer every request on `subject` (a queue group) with a
    lease-shaped reply, decoding the body and storing nothing: the most any responder on
    this bus could answer the same clients (`pool bench e2e`'s floor row)."""

    async def main() -> None:
        nc = await connect(url)

        async def answer(msg: Any) -> None:
            body = json.loads(msg.data)
            await msg.respond(json.dumps({"ok": True, "lease": {
                "lease_id": str(uuid.uuid4()),
                "idempotency_key": body.get("idempotency_key")}}).encode())

        await nc.subscribe(subject, queue="bench-stateless", cb=answer)
        await nc.flush()
        ready.put("stateless")
        while not stop.is_set():
            await asyncio.sleep(0.1)
        await nc.drain()

    asyncio.run(main())


def raw_atomic_rate(url: str, *, rounds: int = ROUNDS, batches: int = 5, size: int = 999) -> float:
    """Median msgs/s of `size`-message atomic batches into a stream of its own (not the log)."""

    async def go() -> float:
        nc = await connect(url)
        js = nc.jetstream()
        config = scratch_stream_config("raw")
        stream = str(config.name)
        await js.add_stream(config)
        try:
            rates = []
            for r in range(rounds):
                msgs = [(f"raw.{stream}.r{r}.{i}", b"x" * 200) for i in range(size)]
                t0 = time.perf_counter()
                for _ in range(batches):
                    await atomic_batch(nc, msgs)
                rates.append(batches * size / (time.perf_counter() - t0))
            return statistics.median(rates)
        finally:
            await js.delete_stream(stream)
            await nc.close()

    return asyncio.run(go())


def _app_rates(url: str, saves: int) -> dict[str, float]:
    """Saves/s through an eventsourcing Application on bus.jetstream: 1 and 3 aggregates."""
    from eventsourcing.application import Application
    from eventsourcing.domain import Aggregate, event

    class Counter(Aggregate):
        @event("Created")
        def __init__(self, name: str) -> None:
            self.name = name
            self.count = 0

        @event("Incremented")
        def increment(self, by: int) -> None:
            self.count += by

    stream = f"BENCHAPP_{uuid.uuid4().hex[:8].upper()}"
    env = {"PERSISTENCE_MODULE": "bus.jetstream", "NATS_URL": url, "NATS_STREAM": stream}
    app: Application[uuid.UUID] = Application(env=env)
    out: dict[str, list[float]] = {"save_1": [], "save_3": []}
    try:
        for _ in range(ROUNDS):
            aggs = [Counter(name=f"c{i}") for i in range(3)]
            app.save(*aggs)
            t0 = time.perf_counter()
            for i in range(saves):
                aggs[0].increment(by=1)
                app.save(aggs[0])
            out["save_1"].append(saves / (time.perf_counter() - t0))
            n3 = max(1, saves // 2)
            t0 = time.perf_counter()
            for _i in range(n3):
                for a in aggs:
                    a.increment(by=1)
                app.save(*aggs)
            out["save_3"].append(n3 / (time.perf_counter() - t0))
    finally:
        app.close()
    return {k: statistics.median(v) for k, v in out.items()}


def run_eventlog_bench(
    *,
    nats_url: str | None = None,
    messages: int = 20000,
    saves: int = 2000,
    quick: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the event-log benchmark against `nats_url`, or a fresh embedded server."""
    if quick:
        messages, saves = min(messages, 2000), min(saves, 200)
    say = progress or (lambda _s: None)
    server: NatsServer | None = None
    tmp: tempfile.TemporaryDirectory[str] | None = None
    if not nats_url:
        tmp = tempfile.TemporaryDirectory(prefix="pool-bench-")
        server = NatsServer(store_dir=Path(tmp.name), server_name="pool-bench").start()
        nats_url = server.url
    try:
        say(f"bench eventlog: raw JetStream publish, {messages} messages × {ROUNDS} rounds")
        raw = asyncio.run(_raw_rates(nats_url, messages, (3, 999)))
        say(f"bench eventlog: Application saves, {saves} × {ROUNDS} rounds")
        app = _app_rates(nats_url, saves)
    finally:
        if server is not None:
            from bus.runtime import close_runtime

            close_runtime(nats_url)
            server.stop()
        if tmp is not None:
            tmp.cleanup()
    rows = [
        ("raw publish, awaited", raw["awaited"], "msgs/s", raw["awaited"] / raw["awaited"]),
        ("raw publish, pipelined", raw["pipelined"], "msgs/s", raw["pipelined"] / raw["awaited"]),
        ("raw atomic batch of 3", raw["atomic_3"], "msgs/s", raw["atomic_3"] / raw["awaited"]),
        ("raw atomic batch of 999", raw["atomic_999"], "msgs/s", raw["atomic_999"] / raw["awaited"]),
        ("Application save, 1 aggregate", app["save_1"], "saves/s", app["save_1"] / raw["awaited"]),
        ("Application save, 3 aggregates (atomic)", app["save_3"], "saves/s",
         app["save_3"] / (raw["atomic_3"] / 3)),
    ]
    lines = [
        f"{'figure':44} {'median':>12} {'unit':8} {'ratio':>7}",
        "-" * 76,
    ]
    for name, value, unit, ratio in rows:
        lines.append(f"{name:44} {value:12,.0f} {unit:8} {ratio:7.2f}")
    lines.append("ratios: raw rows ÷ raw awaited publish; 1-aggregate save ÷ raw awaited publish;")
    lines.append("        3-aggregate save ÷ raw 3-message atomic batches/s — all from this run")
    lines.append(f"machine: {os.cpu_count()} cores, nats-server 2.15 file storage, sync_interval always")
    return {
        "raw": raw,
        "application": app,
        "ratios": {
            "save_1_vs_awaited": app["save_1"] / raw["awaited"],
            "save_3_vs_atomic_3": app["save_3"] / (raw["atomic_3"] / 3),
        },
        "messages": messages,
        "saves": saves,
        "table": "\n".join(lines),
    }
