"""Micro-benchmark of NodeTable.filter + rank at 10,000 nodes (a script, not a test).

Run: .venv/bin/python bench/placement_micro.py [nodes]. Prints per-request timings in µs.
"""

from __future__ import annotations

import functools
import random
import sys
import time
from collections.abc import Callable

from domain.policy import FairQueue, NodeTable, PendingRequest
from domain.policy.placement import Packing
from domain.resources import NodeCapabilities, Resources, Shape


def build(n: int, seed: int = 7) -> NodeTable:
    rng = random.Random(seed)
    table = NodeTable(initial_capacity=n)
    for i in range(n):
        gpu = rng.random() < 0.3
        mig = gpu and rng.random() < 0.3
        ext = (("gpu/1g.10gb", 7),) if mig else ()
        caps = NodeCapabilities(
            allocatable=Resources(
                cpu_millis=rng.choice([16_000, 32_000, 64_000]),
                memory_mib=rng.choice([65_536, 131_072, 262_144]),
                gpu_count=(0 if mig else rng.choice([1, 4, 8])) if gpu else 0,
                local_disk_gib=rng.choice([200, 500, 1000]),
                extended=ext,
            ),
            cpu_arch=rng.choice(["amd64", "amd64", "arm64"]),
            gpu_model=rng.choice(["A100", "H100", "L4"]) if gpu else None,
            gpu_memory_gib=rng.choice([24, 40, 80]) if gpu else 0,
            network_egress=rng.choice(["none", "restricted", "open"]),
            bandwidth_mbps=rng.choice([1000, 10_000, 25_000]),
            runtimes=("container", "sandboxed") if rng.random() < 0.5 else ("container",),
            region=f"r{i % 3}",
            zone=f"r{i % 3}-z{i % 9}",
            failure_domain=f"rack-{i % 200}",
            trust_level="trusted" if rng.random() < 0.8 else "marketplace",
            labels=(("pool", rng.choice(["batch", "serve"])),),
            image_cache=tuple(f"img{rng.randrange(50)}" for _ in range(3)),
        )
        state = "ready" if rng.random() < 0.95 else rng.choice(["cordoned", "draining", "lost"])
        table.add_or_update_node(f"n{i:05d}", caps, state)
    # Load it to roughly half: the interesting case for best-fit.
    lease = 0
    for i in range(n):
        free = table.free_resources(f"n{i:05d}")
        if rng.random() < 0.7:
            table.allocate(
                f"n{i:05d}", f"l{lease}",
                Resources(free.cpu_millis // 2, free.memory_mib // 2), tenant=f"t{lease % 10}",
            )
            lease += 1
    return table


SHAPES = {
    "cpu-only": Shape.build(cpu_millis=4000, memory_mib=8192),
    "gpu+constraints": Shape.build(
        cpu_millis=8000, memory_mib=32_768, gpu_count=2, gpu_model="H100", gpu_memory_gib_min=40,
        runtime="sandboxed", network_egress="restricted",
        preferences=[("zone", "r1-z4"), ("image_cached", "img3"), ("node_label", "pool=batch")],
    ),
    "mig-partition": Shape.build(cpu_millis=2000, memory_mib=8192, gpu_partition="1g.10gb"),
    "prefs-only": Shape.build(
        cpu_millis=1000, memory_mib=1024,
        preferences=[("region", "r2"), ("image_cached", "img7"), ("gpu_model", "L4")],
    ),
}


def timeit(f: Callable[[], object], reps: int) -> float:
    """Best-of-5 mean seconds per call, in µs."""
    f()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            f()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e6


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    t0 = time.perf_counter()
    table = build(n)
    print(f"built {n} nodes, {len(table.dimensions)} dims in {time.perf_counter() - t0:.2f}s")
    for name, shape in SHAPES.items():
        res = table.filter(shape)
        elig = res.eligible
        f_us = timeit(functools.partial(table.filter, shape), 200)
        packing: Packing
        for packing in ("best-fit", "spread"):
            r_us = timeit(functools.partial(table.rank, shape, elig, packing), 200)

            def filter_rank(shape: Shape = shape, packing: Packing = packing) -> object:
                return table.rank(shape, table.filter(shape).eligible, packing)

            both = timeit(filter_rank, 200)
            print(
                f"{name:16s} {packing:8s} eligible={elig.size:5d}  filter={f_us:7.1f}µs  "
                f"rank={r_us:7.1f}µs  filter+rank={both:7.1f}µs"
            )
        place_us = timeit(functools.partial(table.place, shape), 200)
        print(f"{name:16s} place(filter+rank limit=1) = {place_us:7.1f}µs")

    q = FairQueue(table.totals(), priority_ranks={"low": 0, "normal": 1, "high": 2},
                  aging_seconds_per_rank=300)
    for i in range(20_000):
        q.push(PendingRequest(f"p{i}", f"t{i % 500}", ["low", "normal", "high"][i % 3],
                              SHAPES["cpu-only"], float(i), i))
    t0 = time.perf_counter()
    for _ in range(2000):
        r = q.pop(30_000.0)
        assert r is not None
        q.placed(r)
    print(f"FairQueue pop+placed, 500 tenants × 3 classes: "
          f"{(time.perf_counter() - t0) / 2000 * 1e6:.1f}µs")


if __name__ == "__main__":
    main()
