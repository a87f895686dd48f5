"""Checkpoints on the bus: one named blob (a head and its chunks) in POOL_CHECKPOINTS, stored
and read back whole; what the blob means and how it is verified is its writer's business.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import uuid
from typing import Any
from urllib.parse import unquote, urlsplit

from nats.js.errors import NotFoundError

from bus.connection import PASSWORD_ENV, USER_ENV, servers
from bus.errors import BusError
from bus.headers import HDR_CHECKPOINT_CHUNKS, HDR_CHECKPOINT_ID, HDR_CHECKPOINT_SLOT
from bus.runtime import BusRuntime, get_runtime
from bus.streams import checkpoint_stream_config, ensure_stream
from bus.subjects import CHECKPOINT_PREFIX, CHECKPOINT_STREAM, token

# a key given outright, for a deployment whose scheduler connects without a password
KEY_ENV = "POOL_CHECKPOINT_KEY"
# under the server's default max_payload (1 MiB) with room for headers
CHUNK_BYTES = 512 * 1024
WINDOW = 32  # chunks published (or read) at once
TIMEOUT_S = 600.0  # a whole put or get of a large checkpoint


def checkpoint_key(url: str, purpose: str = "scheduler") -> bytes | None:
    """The key a role signs its checkpoints with: derived from the password it connects with
    (in `url`, or in the environment as compose.yaml passes it), so only processes holding
    that role's credentials can write a checkpoint its readers accept; else from
    $POOL_CHECKPOINT_KEY; None when there is neither (then no checkpoint is written or read)."""
    secret = unquote(urlsplit(servers(url)[0]).password or "")
    if not secret and os.environ.get(USER_ENV):
        secret = os.environ.get(PASSWORD_ENV, "")
    if not secret:
        secret = os.environ.get(KEY_ENV, "")
    if not secret:
        return None
    return hmac.new(secret.encode(), f"computepool {purpose} checkpoint".encode(),
                    hashlib.sha256).digest()


class CheckpointTorn(BusError):
    """A checkpoint's chunks are not all its own (overwritten while it was read)."""

    code = "checkpoint_torn"


class CheckpointStore:
    """A named checkpoint in POOL_CHECKPOINTS: `put` stores a new one, its chunks in the slot
    the current head does not name and then its head; `get` reads the latest whole. The
    stream keeps one message a subject, so a slot's chunks replace the ones written there two
    checkpoints ago, and nothing needs purging. It talks on a connection and loop of its own,
    so a large upload never waits in line with the scheduler's reads and saves."""

    def __init__(self, url: str, *, name: str = "scheduler",
                 runtime: BusRuntime | None = None) -> None:
        self.name = token(name)
        self.rt = runtime or get_runtime(url, "checkpoints")
        self._prefix = f"{CHECKPOINT_PREFIX}.{self.name}"

    def ensure(self, replicas: int = 1) -> None:
        """Create the stream if missing (the operator's user; a role's user may not)."""

        async def go() -> None:
            await ensure_stream(await self.rt.jetstream(), checkpoint_stream_config(replicas))

        self.rt.run(go())

    async def _head(self, js: Any) -> Any:
        try:
            return await js.get_msg(CHECKPOINT_STREAM, subject=f"{self._prefix}.head",
                                    direct=True)
        except NotFoundError:
            return None

    def put(self, head: bytes, body: bytes) -> None:
        """Store `body` in chunks and then `head`: a reader sees the old checkpoint or this one
        (the head names its chunks' slot and id)."""

        async def go() -> None:
            js = await self.rt.jetstream()
            current = await self._head(js)
            slot = "b" if current is not None and (current.headers or {}).get(
                HDR_CHECKPOINT_SLOT) == "a" else "a"
            cid = uuid.uuid4().hex
            chunks = [body[i:i + CHUNK_BYTES] for i in range(0, len(body), CHUNK_BYTES)] or [b""]
            for start in range(0, len(chunks), WINDOW):
                await asyncio.gather(*(
                    js.publish(f"{self._prefix}.{slot}.{i}", chunks[i], timeout=30,
                               headers={HDR_CHECKPOINT_ID: cid})
                    for i in range(start, min(len(chunks), start + WINDOW))))
            await js.publish(f"{self._prefix}.head", head, timeout=30, headers={
                HDR_CHECKPOINT_ID: cid, HDR_CHECKPOINT_SLOT: slot,
                HDR_CHECKPOINT_CHUNKS: str(len(chunks))})

        self.rt.run(go(), timeout=TIMEOUT_S)

    def get(self) -> tuple[bytes, bytes] | None:
        """(head, body) of the latest checkpoint, or None when there is none; CheckpointTorn
        when a chunk is missing or another checkpoint's (written over while this read)."""

        async def go() -> tuple[bytes, bytes] | None:
            js = await self.rt.jetstream()
            msg = await self._head(js)
            if msg is None:
                return None
            headers = msg.headers or {}
            try:
                cid = headers[HDR_CHECKPOINT_ID]
                slot = headers[HDR_CHECKPOINT_SLOT]
                n = int(headers[HDR_CHECKPOINT_CHUNKS])
            except (KeyError, ValueError) as e:
                raise CheckpointTorn(f"the head has no chunk list: {e!r}") from e
            parts: list[bytes] = []
            try:
                for start in range(0, n, WINDOW):
                    got = await asyncio.gather(*(
                        js.get_msg(CHECKPOINT_STREAM, subject=f"{self._prefix}.{slot}.{i}",
                                   direct=True)
                        for i in range(start, min(n, start + WINDOW))))
                    for m in got:
                        if (m.headers or {}).get(HDR_CHECKPOINT_ID) != cid:
                            raise CheckpointTorn("a chunk belongs to another checkpoint")
                        parts.append(bytes(m.data or b""))
            except NotFoundError as e:
                raise CheckpointTorn("a chunk is missing") from e
            return bytes(msg.data or b""), b"".join(parts)

        return self.rt.run(go(), timeout=TIMEOUT_S)

    def delete(self) -> bool:
        """Remove every checkpoint of this name (the operator's user: it purges); False when
        the stream does not exist."""

        async def go() -> bool:
            js = await self.rt.jetstream()
            try:
                await js.purge_stream(CHECKPOINT_STREAM, subject=f"{self._prefix}.>")
            except NotFoundError:
                return False
            return True

        return self.rt.run(go())
