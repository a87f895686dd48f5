"""`pool bench workdir`: a work directory's upload (pack, hash, store) and fetch (the agent's:
get, verify, cache) beside a raw object-store put and get of the same bytes (nats-py's own
object store client, what `nats object put/get` does), and a job's start with a cached work
directory beside one with none, all in one run against one nats-server.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.run import bench_main

TENANT = "bench"
RAW_BUCKET = "bench_raw"
MIB = 100
QUICK_MIB = 4
START_MIB = 5  # the first-lease example's size: a script and a 5 MiB data file
RUNS = 5  # of each transfer
QUICK_RUNS = 2
STARTS = 20
QUICK_STARTS = 5


def _tree(root: Path, mib: int, files: int = 16) -> None:
    """`mib` MiB of random bytes in `files` files (random: nothing compresses them)."""
    root.mkdir(parents=True)
    each = mib * (1 << 20) // files
    for i in range(files):
        (root / f"part-{i:02d}.bin").write_bytes(os.urandom(each))
    (root / "train.py").write_text("print('ok')\n")


async def _raw(url: str, tar: Path, runs: int) -> tuple[list[float], list[float]]:
    """Seconds of each put and each get of the tar's bytes through nats-py's object store."""
    import nats

    data = tar.read_bytes()
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        obs = await js.create_object_store(RAW_BUCKET)
        puts, gets = [], []
        for i in range(runs):
            t0 = time.perf_counter()
            await obs.put(f"raw-{i}", data)
            puts.append(time.perf_counter() - t0)
            out = tar.with_name(f"raw-{i}.out")
            t0 = time.perf_counter()
            # into a file, as `nats object get` and our fetch do (into memory, nats-py
            # appends bytes to bytes: quadratic)
            f = out.open("wb")
            try:
                await obs.get(f"raw-{i}", writeinto=f)
            finally:
                f.close()
            gets.append(time.perf_counter() - t0)
            if out.stat().st_size != len(data) or out.read_bytes() != data:
                raise RuntimeError("the raw object store gave back other bytes")
            out.unlink()
            await obs.delete(f"raw-{i}")
        return puts, gets
    finally:
        await nc.close()


def _transfers(url: str, tmp: Path, mib: int, runs: int,
               say: Callable[[str], None]) -> dict[str, Any]:
    from agents.workdir import JobFiles
    from bus.objects import work_bucket
    from client.api import PoolClient
    from client.workdir import pack, upload
    from client.workdir_cache import DigestCache

    cache = DigestCache(tmp / "digests.json")  # not the user's own
    src = tmp / "src"
    _tree(src, mib)
    t0 = time.perf_counter()
    packed = pack(src, tmp / "packed.tar")
    pack_s = time.perf_counter() - t0
    ups, fetches, unchanged = [], [], []
    with PoolClient(url) as c:
        store = c.files()
        for i in range(runs):
            store.delete(work_bucket(TENANT), packed.digest)
            t0 = time.perf_counter()
            done = upload(store, TENANT, src, cache=cache)
            ups.append(time.perf_counter() - t0)
            assert done.uploaded and done.packed.digest == packed.digest
            t0 = time.perf_counter()
            again = upload(store, TENANT, src, cache=cache)
            unchanged.append(time.perf_counter() - t0)
            assert not again.uploaded
            files = JobFiles(tmp / f"node-{i}", store)
            t0 = time.perf_counter()
            files.fetch(TENANT, packed.digest, packed.size_bytes)
            fetches.append(time.perf_counter() - t0)
        say(f"bench workdir: {runs} uploads and fetches of {packed.size_bytes} bytes")
        puts, gets = asyncio.run(_raw(url, packed.path, runs))
        say(f"bench workdir: {runs} raw puts and gets")
    size = packed.size_bytes / (1 << 20)
    med = statistics.median
    return {"tar_mib": round(size, 2), "files": packed.files, "pack_s": pack_s,
            "upload_mib_s": size / med(ups), "raw_put_mib_s": size / med(puts),
            "upload_ratio": med(puts) / med(ups),
            "fetch_mib_s": size / med(fetches), "raw_get_mib_s": size / med(gets),
            "fetch_ratio": med(gets) / med(fetches),
            "unchanged_ms": med(unchanged) * 1000}


def _starts(url: str, tmp: Path, mib: int, starts: int,
            say: Callable[[str], None]) -> dict[str, Any]:
    """Median ms from the start order's arrival to the runtime's `start` returning: the job's
    folder prepared (the cached archive unpacked, or made empty) and the sandbox launched."""
    from agents.runtimes.contract import WorkloadSpec
    from agents.runtimes.process import ProcessRuntime
    from agents.workdir import JobFiles
    from client.api import PoolClient
    from client.workdir import upload

    runtime = ProcessRuntime(tmp / "rt")
    why = runtime.available()
    if why is not None:
        return {"unavailable": why}
    src = tmp / "start-src"
    _tree(src, mib, files=1)
    with PoolClient(url) as c:
        store = c.files()
        ref = upload(store, TENANT, src).packed
        files = JobFiles(tmp / "start-node", store)
        files.fetch(TENANT, ref.digest, ref.size_bytes)  # cached before the first start
        took: dict[str, list[float]] = {"none": [], "cached": []}
        for i in range(1 + starts):  # the first pair warms the page cache and bwrap
            for kind in ("none", "cached"):
                lease = f"b{uuid.uuid4().hex[:12]}"
                key = f"{lease}.1.1"
                t0 = time.perf_counter()
                if kind == "cached":
                    files.prepare(key, TENANT, ref.digest, ref.size_bytes)
                spec = WorkloadSpec(lease_id=lease, epoch=1, job_number=1,
                                    command=("/bin/true",), memory_mib=64,
                                    workdir=str(files.job_dir(key)) if kind == "cached"
                                    else None)
                handle = runtime.start(spec)
                t1 = time.perf_counter()
                if i:
                    took[kind].append(t1 - t0)
                while runtime.poll(handle) is None:
                    time.sleep(0.01)
                runtime.forget(handle)
                files.remove(key)
    say(f"bench workdir: {starts} starts with a cached {mib} MiB workdir and without")
    none, cached = (statistics.median(took[k]) * 1000 for k in ("none", "cached"))
    return {"start_mib": mib, "start_none_ms": none, "start_cached_ms": cached,
            "start_added_ms": cached - none}


def run_workdir_bench(*, runs: int = RUNS, quick: bool = False, mib: int | None = None,
                      progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Upload and fetch throughput of a `mib` MiB work directory against raw object-store
    put and get, and the start a cached work directory adds; the figures and a table."""
    from bus.local.server import NatsServer
    from bus.objects import ensure_tenant_buckets_sync

    say = progress or (lambda _s: None)
    size = mib or (QUICK_MIB if quick else MIB)
    runs = QUICK_RUNS if quick else runs
    with tempfile.TemporaryDirectory(prefix="pool-bench-workdir-") as d:
        tmp = Path(d)
        server = NatsServer(store_dir=tmp / "nats", server_name="bench-workdir")
        server.start()
        try:
            ensure_tenant_buckets_sync(server.url, [TENANT])
            result = _transfers(server.url, tmp, size, runs, say)
            result.update(_starts(server.url, tmp, QUICK_MIB if quick else START_MIB,
                                  QUICK_STARTS if quick else STARTS, say))
        finally:
            server.stop()
    result.update(mib=size, runs=runs)
    result["table"] = _table(result)
    return result


def _table(r: dict[str, Any]) -> str:
    lines = [(f"work directory: {r['mib']} MiB random in {r['files']} files, a "
             f"{r['tar_mib']} MiB tar; medians of {r['runs']} runs (one nats-server, file "
             "storage, fsync always)"),
             f"  pack (tar + SHA-256)          {r['pack_s'] * 1000:8.0f} ms",
             (f"  upload (pack, hash, store)    {r['upload_mib_s']:8.1f} MiB/s   raw object put "
             f"{r['raw_put_mib_s']:7.1f} MiB/s   ratio {r['upload_ratio']:.2f} (goal >= 0.8)"),
             (f"  fetch (get, verify, cache)    {r['fetch_mib_s']:8.1f} MiB/s   raw object get "
             f"{r['raw_get_mib_s']:7.1f} MiB/s   ratio {r['fetch_ratio']:.2f} (goal >= 0.8)"),
             f"  unchanged upload (pack, look) {r['unchanged_ms']:8.0f} ms"]
    if "unavailable" in r:
        lines.append(f"  job start: {r['unavailable']}")
    else:
        lines.append(f"  job start (bubblewrap, `true`): no workdir {r['start_none_ms']:.1f} ms, "
                     f"a cached {r['start_mib']} MiB workdir {r['start_cached_ms']:.1f} ms: "
                     f"+{r['start_added_ms']:.1f} ms (goal <= +20 ms)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return bench_main("workdir", __doc__, run_workdir_bench, argv, runs=RUNS,
                      quick_runs=QUICK_RUNS)


if __name__ == "__main__":
    sys.exit(main())
