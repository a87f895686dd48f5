"""Questions for a pool's leader on `pool.lead.<pool>.<verb>`: the scheduler process leading a
pool answers there while it leads it; any other process asks, with a short timeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import re
import threading
from collections.abc import Callable
from typing import Any

from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from bus.errors import BusError
from bus.replies import INBOX_ROOT
from bus.runtime import BusRuntime, get_runtime
from bus.subjects import lead_filter, lead_subject

log = logging.getLogger(__name__)

# (pool, verb, body) -> the reply; run on a worker thread (it may wait for a scheduling cycle)
Answer = Callable[[str, str, bytes], bytes]
QUEUE = "pool-lead"
# a requester's inbox as nats clients make them; the reply subject is as hostile as the body
_REPLY = re.compile(rf"^{INBOX_ROOT}(\.[A-Za-z0-9_-]{{1,128}}){{1,8}}$")


class LeadDesk:
    """Answers `pool.lead.<pool>.*` for the pools `serve`d (those this process leads) with
    `answer`; `ask` puts a question to another pool's leader (None: no answer in time)."""

    def __init__(self, runtime: BusRuntime | str, answer: Answer, *, timeout: float = 1.0,
                 threads: int = 2) -> None:
        self._rt = get_runtime(runtime) if isinstance(runtime, str) else runtime
        self._answer = answer
        self.timeout = timeout
        self._subs: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._workers = concurrent.futures.ThreadPoolExecutor(threads,
                                                              thread_name_prefix="pool-lead")
        self.answered = 0

    def serving(self) -> set[str]:
        with self._lock:
            return set(self._subs)

    def serve(self, pool: str, leading: bool = True) -> None:
        """Start (or, `leading=False`, stop) answering for `pool`; a bus that does not answer
        leaves it as it was (logged: askers then fall back to their own answer)."""
        with self._lock:
            try:
                if leading and pool not in self._subs:
                    self._subs[pool] = self._rt.run(self._subscribe(pool), self.timeout + 5)
                elif not leading and pool in self._subs:
                    sub = self._subs.pop(pool)
                    self._rt.run(sub.unsubscribe(), self.timeout + 5)
            except BusError as e:
                log.warning("questions for pool %s: %s", pool, e)

    async def _subscribe(self, pool: str) -> Any:
        nc = await self._rt.connection()

        async def on_msg(msg: Any) -> None:
            if not msg.reply or len(msg.reply) > 512 or not _REPLY.match(msg.reply):
                return  # nowhere safe to answer
            verb = msg.subject.rsplit(".", 1)[-1]
            loop = asyncio.get_running_loop()
            try:
                reply = await loop.run_in_executor(self._workers, self._answer, pool, verb,
                                                   bytes(msg.data))
            except Exception:  # the asker times out and answers itself
                log.exception("answering %s failed", msg.subject)
                return
            self.answered += 1
            with contextlib.suppress(NatsError):
                await nc.publish(msg.reply, reply)

        sub = await nc.subscribe(lead_filter(pool), queue=QUEUE, cb=on_msg)
        await nc.flush(max(1, round(self.timeout)))
        return sub

    def ask(self, pool: str, verb: str, body: bytes) -> bytes | None:
        """The leader of `pool`'s reply to `verb`, or None when none came within the timeout."""
        try:
            return self._rt.run(self._ask(lead_subject(pool, verb), body), self.timeout + 2)
        except BusError as e:
            log.debug("asking the leader of pool %s: %s", pool, e)
            return None

    def ask_all(self, pools: list[str], verb: str, body: bytes) -> list[bytes | None]:
        """`ask` of each pool's leader, all at once: one timeout for them all, not one each."""
        if not pools:
            return []

        async def every() -> list[bytes | None]:
            return list(await asyncio.gather(
                *(self._ask(lead_subject(pool, verb), body) for pool in pools)))

        try:
            return self._rt.run(every(), self.timeout + 2)
        except BusError as e:
            log.debug("asking the leaders of pools %s: %s", ", ".join(pools), e)
            return [None] * len(pools)

    async def _ask(self, subject: str, body: bytes) -> bytes | None:
        nc = await self._rt.connection()
        try:
            msg = await nc.request(subject, body, timeout=self.timeout)
        except (NoRespondersError, NatsTimeout):
            return None
        return bytes(msg.data)

    def close(self) -> None:
        for pool in self.serving():
            self.serve(pool, False)
        self._workers.shutdown(wait=False, cancel_futures=True)
