"""`computepool.AsyncClient`: the sync Client's calls awaited, each run in a worker thread
(asyncio.to_thread), its iterators as async iterators; one transport, not a second client."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Self, TypeVar

from computepool.client import Artifact, Client, LeaseList, RunResult
from gateway.wire import Lease
from schemas import v1
from schemas.feed import FeedRecord

T = TypeVar("T")
_DONE = object()


async def _aiter(items: Iterator[T]) -> AsyncIterator[T]:
    """A blocking iterator pulled one item at a time in a worker thread."""
    try:
        while True:
            got = await asyncio.to_thread(next, items, _DONE)
            if got is _DONE:
                return
            yield got  # type: ignore[misc]  # not _DONE: an item
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            await asyncio.to_thread(close)


class AsyncClient:
    """As Client, awaited: `async with AsyncClient(url, token=…) as c: await c.get(id)`. Each
    call runs the sync client's in a thread; the transports' own I/O is blocking."""

    def __init__(self, url: str | None = None, **options: Any) -> None:
        self._sync: Client = options.pop("client", None) or Client(url, **options)

    @classmethod
    def from_context(cls, name: str | None = None, *, timeout: float = 10.0) -> Self:
        return cls(client=Client.from_context(name, timeout=timeout))

    @property
    def client(self) -> Client:
        """The sync Client this one awaits."""
        return self._sync

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.to_thread(functools.partial(fn, *args, **kwargs))

    async def request(self, request: v1.LeaseRequest | None = None, **fields: Any) -> Lease:
        return await self._call(self.client.request, request, **fields)

    async def get(self, lease_id: str) -> Lease:
        return await self._call(self.client.get, lease_id)

    async def why(self, lease_id: str) -> dict[str, Any]:
        return await self._call(self.client.why, lease_id)

    async def commit(self, lease_id: str, command: Sequence[str] = (), **fields: Any) -> Lease:
        return await self._call(self.client.commit, lease_id, command, **fields)

    async def renew(self, lease_id: str, extend_seconds: int | None = None) -> Lease:
        return await self._call(self.client.renew, lease_id, extend_seconds)

    async def cancel(self, lease_id: str, reason: str | None = None) -> Lease:
        return await self._call(self.client.cancel, lease_id, reason)

    async def release(self, lease_id: str, **fields: Any) -> Lease:
        return await self._call(self.client.release, lease_id, **fields)

    async def leases(self, **filters: Any) -> LeaseList:
        return await self._call(self.client.leases, **filters)

    async def run(self, command: Sequence[str], **fields: Any) -> RunResult:
        return await self._call(self.client.run, command, **fields)

    def watch(self, lease_id: str, *, after: int = 0) -> AsyncIterator[FeedRecord]:
        return _aiter(self.client.watch(lease_id, after=after))

    def logs(self, lease_id: str, *, follow: bool = False,
             since: float | None = None) -> AsyncIterator[str]:
        return _aiter(self.client.logs(lease_id, follow=follow, since=since))

    async def artifacts(self, lease_id: str) -> list[Artifact]:
        return await self._call(self.client.artifacts, lease_id)

    async def download(self, lease_id: str, dest: str | os.PathLike[str]) -> list[Path]:
        return await self._call(self.client.download, lease_id, dest)

    async def set_secret(self, name: str, value: bytes) -> dict[str, Any]:
        return await self._call(self.client.set_secret, name, value)

    async def secrets(self) -> list[dict[str, Any]]:
        return await self._call(self.client.secrets)

    async def delete_secret(self, name: str) -> None:
        await self._call(self.client.delete_secret, name)

    async def close(self) -> None:
        await self._call(self.client.close)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

