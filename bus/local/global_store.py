"""Moving a cluster's streams from the global account to POOL (ADR 027): a clustered store keeps
each stream's account in the cluster's metadata, so the files cannot be renamed as a single
server's are (`accounts.adopt_global_store`). Instead each stream is snapshotted through the
JetStream API while the cluster runs as it was (no accounts: every client in `$G`), deleted
there, and restored into POOL once the cluster runs with its accounts: the same messages, the
same sequences and gaps, the same consumers.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import nats

from bus.local.accounts import GLOBAL_ACCOUNT

log = logging.getLogger(__name__)

# where the snapshots wait between the two runs, under the cluster's store root: each stream
# as <name>.json (its config and state) and <name>.snap (the snapshot's bytes)
PARKED = "global-streams"
CHUNK_BYTES = 128 * 1024


def has_global_streams(store_dirs: list[Path]) -> bool:
    """Whether any server's store (a NatsServer's `store_dir`: JetStream's is its `jetstream/`,
    which keeps accounts in its own `jetstream/`) holds a stream in the global account."""
    return any(any((d / "jetstream" / "jetstream" / GLOBAL_ACCOUNT / "streams").glob("*"))
               for d in store_dirs)


async def _snapshot(nc: Any, name: str, folder: Path, tries: int = 6) -> None:
    """`name`'s snapshot into `folder`, asked again while no answer comes (a stream's leader is
    still being chosen just after the cluster's start), each time on an inbox of its own: a
    late answer to an earlier ask cannot mix its chunks into the file."""
    part = folder / f"{name}.snap.part"
    for attempt in range(tries):
        inbox = nc.new_inbox()
        done = asyncio.Event()
        with part.open("wb") as out:
            async def on_chunk(msg: Any, out: Any = out, done: asyncio.Event = done) -> None:
                if msg.data:
                    out.write(msg.data)
                else:
                    done.set()  # an empty message ends the snapshot
                if msg.reply:  # the server's flow control
                    await nc.publish(msg.reply, b"")

            sub = await nc.subscribe(inbox, cb=on_chunk)
            try:
                answer = json.loads((await nc.request(
                    f"$JS.API.STREAM.SNAPSHOT.{name}",
                    json.dumps({"deliver_subject": inbox, "chunk_size": CHUNK_BYTES}).encode(),
                    timeout=10)).data)
            except nats.errors.TimeoutError:
                await sub.unsubscribe()
                log.info("no answer to the snapshot of %s yet (try %d)", name, attempt + 1)
                continue
            if "error" in answer:
                raise RuntimeError(f"snapshot of {name}: {answer['error']}")
            await asyncio.wait_for(done.wait(), 600)
            await sub.unsubscribe()
        part.rename(folder / f"{name}.snap")
        (folder / f"{name}.json").write_text(json.dumps(
            {"config": answer["config"], "state": answer["state"]}))
        return
    raise TimeoutError(f"no answer to the snapshot of {name}")


async def _names(nc: Any) -> list[str]:
    """Every stream's name, page by page (a cluster's stream list leaves out the streams
    whose info is late; the names are the metadata's own)."""
    names: list[str] = []
    while True:
        page = json.loads((await nc.request("$JS.API.STREAM.NAMES", json.dumps(
            {"offset": len(names)}).encode(), timeout=30)).data)
        names += page.get("streams") or []
        if not page.get("streams") or len(names) >= int(page.get("total", 0)):
            return names


async def park(url: str, folder: Path) -> list[str]:
    """Snapshot every stream a client of `url` sees into `folder`, then delete it there;
    the names parked."""
    folder.mkdir(parents=True, exist_ok=True)
    nc = await nats.connect(servers=url.split(","))
    try:
        js = nc.jetstream()
        names = await _names(nc)
        for name in names:
            await _snapshot(nc, name, folder)
        for name in names:  # only once every one is safe on disk
            await js.delete_stream(name)
        return names
    finally:
        await nc.close()


async def restore(url: str, folder: Path) -> list[str]:
    """Restore every stream parked in `folder` through a client of `url` (POOL's operator),
    removing each one's files once it is back; the names restored."""
    nc = await nats.connect(servers=url.split(","))
    done: list[str] = []
    try:
        for meta in sorted(folder.glob("*.json")):
            name = meta.stem
            body = meta.read_text().encode()
            answer = json.loads((await nc.request(f"$JS.API.STREAM.RESTORE.{name}", body,
                                                  timeout=30)).data)
            if "error" in answer:
                raise RuntimeError(f"restore of {name}: {answer['error']}")
            with (folder / f"{name}.snap").open("rb") as f:
                while chunk := f.read(CHUNK_BYTES):
                    await nc.request(answer["deliver_subject"], chunk, timeout=30)
            created = json.loads((await nc.request(answer["deliver_subject"], b"",
                                                   timeout=600)).data)
            if "error" in created:
                raise RuntimeError(f"restore of {name}: {created['error']}")
            (folder / f"{name}.snap").unlink()
            meta.unlink()
            done.append(name)
        return done
    finally:
        await nc.close()


def park_sync(url: str, folder: Path) -> list[str]:
    names = asyncio.run(park(url, folder))
    log.warning("parked %d stream(s) of the global account in %s to move them to POOL (ADR 027)",
                len(names), folder)
    return names


def restore_sync(url: str, folder: Path) -> list[str]:
    if not folder.is_dir() or not any(folder.glob("*.json")):
        return []
    names = asyncio.run(restore(url, folder))
    log.warning("restored %d stream(s) from the global account into POOL: %s", len(names),
                ", ".join(names))
    return names
