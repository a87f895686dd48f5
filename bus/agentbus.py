"""The data plane's streams: agent commands (a work queue), durable deadline timers, the links.

Streams and subjects: docs/architecture.md#the-work-queue-and-the-timers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import nats
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
)
from nats.js.errors import BadRequestError, NotFoundError, ServiceUnavailableError

from bus.connection import connect
from bus.errors import BusTimeout, BusUnavailable
from bus.headers import HDR_MSG_ID, HDR_SCHEDULE, HDR_SCHEDULE_TARGET
from bus.jetstream.natsfast import publish_atomic
from bus.jetstream.wire import MAX_BATCH
from bus.junk import int_value, junk_values, live_answer
from bus.objects import FileStore
from bus.replies import admin_inbox, node_inbox
from bus.runtime import BusRuntime, LoopThread, get_runtime, translated
from bus.streams import (
    agent_stream_config,
    ensure_kv_bucket,
    ensure_stream,
    schedule_stream_config,
    through_reloads,
)
from bus.subjects import AGENT_STREAM, SCHEDULE_STREAM, token
from bus.telemetry import ensure_telemetry_stream

log = logging.getLogger(__name__)

AGENT_VERBS = ("start", "stop", "preempt")
RECONCILER_CONSUMER = "reconciler"
POSITIONS_BUCKET = "pool_positions"
# how long a caller waits for timers started with `schedule_many_started`
ARM_TIMEOUT_S = 30.0


@through_reloads
async def ensure_data_plane_streams(js: Any, *, replicas: int = 1) -> None:
    await ensure_stream(js, agent_stream_config(replicas=replicas))
    await ensure_stream(js, schedule_stream_config(replicas=replicas))
    # what the agents' telemetry lands in and tenants replay: without it (a `pool serve` on a
    # server no `pool up` prepared) every replay was answered bus_unavailable
    await ensure_telemetry_stream(js, replicas=replicas)
    await ensure_kv_bucket(js, POSITIONS_BUCKET, replicas=replicas)  # the dispatcher's position
    try:
        await js.add_consumer(
            SCHEDULE_STREAM,
            ConsumerConfig(durable_name=RECONCILER_CONSUMER, filter_subject="pool.due.>",
                           ack_policy=AckPolicy.EXPLICIT, ack_wait=30,
                           deliver_policy=DeliverPolicy.ALL, max_ack_pending=10_000),
        )
    except BadRequestError:
        pass  # exists with this config already


def agent_consumer_name(node_id: str) -> str:
    return f"agent-{token(node_id)}"


@through_reloads
async def ensure_agent_queue(js: Any, node_id: str) -> None:
    """The durable consumer node `node_id`'s agent reads its commands from (kept if made)."""
    try:
        await js.add_consumer(AGENT_STREAM, ConsumerConfig(
            durable_name=agent_consumer_name(node_id), ack_policy=AckPolicy.EXPLICIT,
            filter_subject=f"pool.agent.{token(node_id)}.>", ack_wait=60, max_deliver=-1))
    except BadRequestError:
        pass


def _rfc3339(at: float) -> str:
    """`at` as RFC 3339 in UTC to the millisecond (truncated), as `2026-12-05T15:00:00.123Z`."""
    # isoformat ends a UTC time with "+00:00"; it pads the year to four digits as %Y does here
    return dt.datetime.fromtimestamp(at, tz=dt.UTC).isoformat(timespec="milliseconds")[:-6] + "Z"


@dataclass(frozen=True)
class Due:
    """A fired timer: which lease or node, and how to acknowledge it."""

    kind: str  # "lease" | "node"
    id: str
    ack: Callable[[], None]


class Armed:
    """Timers being armed (`ControlLink.schedule_many_started`); `wait` until they are."""

    def __init__(self, future: concurrent.futures.Future[None] | None) -> None:
        self.future = future

    def wait(self, timeout: float = ARM_TIMEOUT_S) -> None:
        """Return once every timer is stored; raises the bus error that stopped it, or
        BusTimeout (the arming is then abandoned: the caller arms them again)."""
        if self.future is None:
            return
        try:
            self.future.result(timeout)
        except concurrent.futures.TimeoutError as e:
            self.future.cancel()
            raise BusTimeout(f"timers not armed in {timeout:g} s") from e


class ControlLink:
    """The control plane's side: send agent commands, set timers, take fired timers."""

    def __init__(self, url: str, *, runtime: BusRuntime | None = None) -> None:
        self.rt = runtime or get_runtime(url)
        self._consumers: set[str] = set()
        self._due_sub: Any = None
        self._kv: Any = None
        self._fetching: asyncio.Task[Any] | None = None  # the fired timers' fetch under way
        self._interrupted = False

    def ensure_streams(self, replicas: int = 1) -> None:
        async def go() -> None:
            await ensure_data_plane_streams(await self.rt.jetstream(), replicas=replicas)

        self.rt.run(go())

    def ensure_agent_consumer(self, node_id: str) -> None:
        """The durable consumer node `node_id`'s agent reads its commands from."""
        name = agent_consumer_name(node_id)
        if name in self._consumers:
            return

        async def go() -> None:
            await ensure_agent_queue(await self.rt.jetstream(), node_id)

        self.rt.run(go())
        self._consumers.add(name)

    def send(self, node_id: str, verb: str, body: bytes, *, msg_id: str,
             headers: dict[str, str] | None = None) -> None:
        """Publish one agent command durably (awaited ack); a repeated msg_id is a no-op."""
        self.ensure_agent_consumer(node_id)
        hdrs = {HDR_MSG_ID: msg_id, **(headers or {})}

        async def go() -> None:
            js = await self.rt.jetstream()
            await js.publish(f"pool.agent.{token(node_id)}.{verb}", body, headers=hdrs,
                             timeout=5)

        self.rt.run(go())

    def schedule(self, kind: str, ident: str, at: float, body: bytes = b"") -> None:
        """(Re)arm the timer for `kind`/`ident` to fire at unix time `at`."""
        self.schedule_many([(kind, ident, at)], body)

    def schedule_many(self, timers: list[tuple[str, str, float]], body: bytes = b"") -> None:
        """`schedule` each (kind, ident, at), acknowledged before this returns: one atomic
        batch per MAX_BATCH timers, a timer armed twice at its last time. Where the server
        refuses the batch (a timer stream from before atomic batches), one publish each."""
        if timers:
            self.rt.run(self._arm(timers, body))

    def schedule_many_started(self, timers: list[tuple[str, str, float]],
                              body: bytes = b"") -> Armed:
        """`schedule_many`, started and not waited for: the caller does other bus work (each
        stream stores its own batches) and then waits on what this returns."""
        return Armed(self.rt.submit(translated(self._arm, timers, body)) if timers else None)

    async def _arm(self, timers: list[tuple[str, str, float]], body: bytes) -> None:
        latest = {(kind, ident): at for kind, ident, at in timers}
        messages = [(f"pool.sched.{kind}.{token(ident)}", body or b"{}",
                     {HDR_SCHEDULE: f"@at {_rfc3339(at)}",
                      HDR_SCHEDULE_TARGET: f"pool.due.{kind}.{token(ident)}"})
                    for (kind, ident), at in latest.items()]
        nc = await self.rt.connection()
        for i in range(0, len(messages), MAX_BATCH):
            chunk = messages[i:i + MAX_BATCH]
            answer = await publish_atomic(nc, chunk, timeout=5)
            if answer.get("error"):
                log.info("timers armed one by one: %s", answer["error"])
                js = await self.rt.jetstream()
                await asyncio.gather(*(js.publish(subject, payload, timeout=5,
                                                  headers=dict(headers))
                                       for subject, payload, headers in chunk))

    def interrupt(self) -> None:
        """End a wait for fired timers now, and any later one at once: the process stops (its
        reconciler's thread would otherwise sit out the fetch's whole timeout)."""

        def cancel() -> None:
            self._interrupted = True
            if self._fetching is not None:
                self._fetching.cancel()

        with contextlib.suppress(RuntimeError):  # the loop is closed already
            self.rt.loop.call_soon_threadsafe(cancel)

    def fetch_due(self, batch: int = 100, timeout: float = 1.0) -> list[Due]:
        """Fired timers, waiting up to `timeout` for the first; each must be acked."""

        async def go() -> list[Due]:
            js = await self.rt.jetstream()
            if self._due_sub is None:
                self._due_sub = await js.pull_subscribe_bind(RECONCILER_CONSUMER, SCHEDULE_STREAM)
            if self._interrupted:
                return []
            self._fetching = asyncio.current_task()
            try:
                msgs = await self._due_sub.fetch(batch, timeout=timeout)
            except TimeoutError:  # nats' TimeoutError is one too
                return []
            except asyncio.CancelledError:
                if not self._interrupted:
                    raise
                return []  # interrupt(): the process stops, no timer was taken
            finally:
                self._fetching = None
            out = []
            for m in msgs:
                parts = m.subject.split(".")
                if len(parts) != 4:
                    # no timer's subject (pool.due.<kind>.<id>): a server's answer some client
                    # aimed here as its reply subject. Taken off the queue, counted
                    junk_values().report(int(m.metadata.sequence.stream), m.subject)
                    await m.ack()
                    continue
                out.append(Due(kind=parts[2], id=parts[3], ack=self._acker(m)))
            return out

        try:
            return self.rt.run(go(), timeout=timeout + 5)
        except BusTimeout:
            return []

    def _acker(self, msg: Any) -> Callable[[], None]:
        def ack() -> None:
            self.rt.run(msg.ack())

        return ack

    def close(self) -> None:
        """Drop the timer subscription, so the shared connection can drain promptly."""
        sub, self._due_sub = self._due_sub, None
        if sub is None or self.rt.closed:
            return
        with contextlib.suppress(Exception):  # closing is best effort
            self.rt.run(sub.unsubscribe(), timeout=5)

    # -- a small durable position for followers of the log (the dispatcher) ------------------

    def load_position(self, name: str) -> int:
        async def go() -> int:
            kv = await self._bucket()
            try:
                entry = await kv.get(name)
            except Exception:  # noqa: BLE001 - absent key: start from the beginning
                return 0
            # junk a client aimed at the key counts as an absent key
            at = int_value(entry.value, entry.revision, f"$KV.{POSITIONS_BUCKET}.{name}")
            return 0 if at is None else at

        return self.rt.run(go())

    def save_position(self, name: str, position: int) -> None:
        async def go() -> None:
            kv = await self._bucket()
            await kv.put(name, str(position).encode())

        self.rt.run(go())

    async def _bucket(self) -> Any:
        if self._kv is None:
            js = await self.rt.jetstream()
            try:
                self._kv = await js.key_value(POSITIONS_BUCKET)
            except Exception:  # noqa: BLE001 - not created yet
                self._kv = await js.create_key_value(bucket=POSITIONS_BUCKET, history=1)
        return self._kv


@dataclass(frozen=True)
class AgentCommand:
    """One command taken from the node's work queue; `ack()` once it took effect."""

    verb: str
    body: bytes
    headers: dict[str, str]
    delivered: int
    ack: Callable[[], None]
    nak: Callable[[float], None]


class _Link:
    """What the agent's and the fleet's links share: one loop thread, one NATS connection."""

    run_timeout = 30.0
    ack_sync = True  # wait for the server to confirm each ack

    def __init__(self, url: str, loop_name: str) -> None:
        self.url = url
        self._loop = LoopThread(loop_name)
        self._nc: Any = None

    def _run(self, coro: Any, timeout: float | None = None) -> Any:
        try:
            return self._loop.run(coro, self.run_timeout if timeout is None else timeout)
        except (NatsError, OSError) as e:
            raise BusUnavailable(f"NATS: {e!r}") from e

    def _command(self, m: Any) -> AgentCommand:
        """A work-queue message as the command the agent runs."""
        if self.ack_sync:
            ack: Callable[[], None] = lambda: self._run(m.ack_sync(timeout=5))
        else:
            ack = lambda: self._run(m.ack())
        return AgentCommand(
            verb=m.subject.rsplit(".", 1)[-1], body=bytes(m.data),
            headers=dict(m.headers or {}), delivered=int(m.metadata.num_delivered),
            ack=ack, nak=lambda delay: self._run(m.nak(delay=delay)))

    def publish(self, subject: str, body: bytes, headers: dict[str, str] | None = None) -> None:
        """A fire-and-forget core publish (telemetry); a bus hiccup is logged, not raised."""

        async def go() -> None:
            await self._nc.publish(subject, body, headers=headers)

        try:
            self._run(go(), 5)
        except Exception as e:  # noqa: BLE001 - telemetry must never stop an agent
            log.warning("telemetry publish failed: %r", e)

    def send(self, subject: str, body: bytes) -> None:
        """A core publish that must not be lost silently (a session's frames): BusUnavailable
        when it cannot be handed to the connection."""
        self._run(self._publish(subject, body), 5)

    def send_soon(self, subject: str, body: bytes) -> concurrent.futures.Future[None]:
        """`send` without waiting: what it returns says when it was handed over (or why not).
        Sends from one thread keep their order (the loop starts them in turn)."""
        return self._loop.submit(self._publish(subject, body))

    async def _publish(self, subject: str, body: bytes) -> None:
        try:
            await self._nc.publish(subject, body)
        except (NatsError, OSError) as e:
            raise BusUnavailable(f"NATS: {e!r}") from e

    def subscribe(self, subject: str, on_data: Callable[[str, bytes], None]) -> Callable[[], None]:
        """Call `on_data(subject, data)` (on the link's loop thread: it must not block) for each
        message on `subject`; returns what ends the subscription."""

        async def cb(msg: Any) -> None:
            if live_answer(msg.headers, msg.subject):
                return  # a direct get's answer aimed here: the asker's bytes, not the tenant's
            on_data(msg.subject, bytes(msg.data))

        async def go() -> Any:
            return await self._nc.subscribe(subject, cb=cb,
                                            pending_bytes_limit=256 * 1024 * 1024)

        sub = self._run(go(), 5)

        def end() -> None:
            if self._nc is None or self._nc.is_closed:
                return  # the link closed first: the subscription went with it

            async def stop() -> None:
                await sub.unsubscribe()

            with contextlib.suppress(Exception):  # ending is best effort
                self._run(stop(), 5)

        return end

    def files(self) -> FileStore:
        """The tenants' file buckets over this link's connection (bus.objects)."""
        return FileStore(self._nc, self._loop.run)

    def close(self) -> None:
        async def go() -> None:
            if self._nc is not None and not self._nc.is_closed:
                with contextlib.suppress(Exception):  # best effort
                    await asyncio.wait_for(self._nc.close(), 3)
            # nats-py leaves reader/flusher tasks behind: finish them before the loop stops
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        with contextlib.suppress(Exception):  # closing is best effort
            self._run(go(), 10)
        self._loop.close()


class AgentLink(_Link):
    """The node agent's side, connected as the node's own NATS user (its inbox prefix is
    `_INBOX.n.<node>`, the only inbox its permissions allow)."""

    def __init__(self, url: str, node_id: str) -> None:
        self.node = token(node_id)
        super().__init__(url, f"pool-agent-{self.node}")
        self._sub: Any = None

    def connect(self) -> AgentLink:
        async def go() -> None:
            self._nc = await connect(self.url, inbox_prefix=node_inbox(self.node))

        try:
            self._run(go())
        except NatsError as e:
            raise BusUnavailable(f"cannot reach NATS at {self.url}: {e}") from e
        return self

    def request(self, suffix: str, body: bytes, *, timeout: float = 5.0,
                headers: dict[str, str] | None = None) -> bytes:
        """Request/reply on `pool.node.<node>.<suffix>` (register, heartbeat, lease reports)."""

        async def go() -> bytes:
            msg = await self._nc.request(f"pool.node.{self.node}.{suffix}", body,
                                         timeout=timeout, headers=headers)
            return bytes(msg.data)

        try:
            return self._run(go(), timeout + 5)  # type: ignore[no-any-return]
        except NatsTimeout as e:
            raise BusTimeout(f"no answer on pool.node.{self.node}.{suffix}") from e
        except nats.errors.NoRespondersError as e:
            raise BusUnavailable("no control plane answers node reports") from e

    def fetch(self, batch: int = 16, timeout: float = 1.0) -> list[AgentCommand]:
        """Commands waiting for this node, blocking up to `timeout` for the first one."""

        async def go() -> list[AgentCommand]:
            if self._sub is None:
                self._sub = await self._nc.jetstream().pull_subscribe_bind(
                    agent_consumer_name(self.node), AGENT_STREAM,
                    inbox_prefix=f"{node_inbox(self.node)}.pull".encode())
            try:
                msgs = await self._sub.fetch(batch, timeout=timeout)
            except TimeoutError:  # nats' TimeoutError is one too
                return []
            except (NotFoundError, ServiceUnavailableError):
                # the node's queue is created when it registers: until then, nothing to take
                await asyncio.sleep(min(timeout, 0.5))
                return []
            return [self._command(m) for m in msgs]

        try:
            return self._run(go(), timeout + 10)  # type: ignore[no-any-return]
        except BusTimeout:
            return []


class FleetLink(_Link):
    """Many simulated nodes over ONE connection (the service user): each node still reads its
    own durable consumer and reports on its own `pool.node.<node>.…` subjects, exactly as a
    real agent does; only the connection is shared. For `pool agent simulate` and the demo."""

    run_timeout = 60.0
    ack_sync = False  # a simulated fleet acks thousands of commands a round
    PULL_SECONDS = 5.0  # how long a node's pull waits at the server for a command

    def __init__(self, url: str) -> None:
        super().__init__(url, "pool-fleet")
        self._js: Any = None
        self._subs: dict[str, Any] = {}
        self._pulls: dict[str, asyncio.Task[None]] = {}  # per node, its pull in flight
        self._arrived: dict[str, list[Any]] = {}  # commands pulled since the last round

    def connect(self, nodes: list[str]) -> FleetLink:
        async def go() -> None:
            self._nc = await connect(self.url)
            self._js = self._nc.jetstream()
            await ensure_data_plane_streams(self._js)
            for node in nodes:
                await ensure_agent_queue(self._js, node)
                self._subs[node] = await through_reloads(self._js.pull_subscribe_bind)(
                    agent_consumer_name(node), AGENT_STREAM)

        self._run(go(), 120)
        return self

    def fetch_many(self, nodes: list[str], timeout: float = 0.2) -> dict[str, list[AgentCommand]]:
        """The listed nodes' commands that arrived by the end of `timeout`. Each listed node
        keeps one pull in flight, as an idle agent's long fetch does, renewed every
        `PULL_SECONDS` and at once after each command; a node left out stops pulling."""

        async def pull(node: str) -> None:
            sub = self._subs[node]
            while True:
                try:
                    # one at a time: a pull for more would hold the first until it is full
                    msgs = await sub.fetch(1, timeout=self.PULL_SECONDS)
                except (TimeoutError, NotFoundError):  # nats' TimeoutError is one too
                    continue
                except NatsError as e:  # the connection's trouble: the round sees it too
                    if self._nc is None or self._nc.is_closed:
                        return
                    log.debug("fleet pull for %s: %r", node, e)
                    await asyncio.sleep(0.5)
                    continue
                self._arrived.setdefault(node, []).extend(msgs)

        async def go() -> dict[str, list[Any]]:
            wanted = {n for n in nodes if n in self._subs}
            for node in [n for n in self._pulls if n not in wanted]:
                self._pulls.pop(node).cancel()
            loop = asyncio.get_running_loop()
            for node in wanted - self._pulls.keys():
                self._pulls[node] = loop.create_task(pull(node))
            await asyncio.sleep(timeout)
            got, self._arrived = self._arrived, {}
            return got

        return {node: [self._command(m) for m in msgs]
                for node, msgs in self._run(go(), timeout + 30).items()}

    def request(self, node: str, suffix: str, body: bytes, *, timeout: float = 5.0,
                headers: dict[str, str] | None = None) -> bytes:
        # the service answers a node's report only under that node's inbox, and one connection
        # speaks for many nodes here: so each report gets a reply subject of its own node's
        return self._request(f"pool.node.{token(node)}.{suffix}", node_inbox(node), body,
                             timeout=timeout, headers=headers)

    def admin(self, path: str, body: bytes, *, timeout: float = 10.0) -> bytes:
        """An operator's command `pool.admin.<path>` (the fleet enrolls the nodes it runs)."""
        return self._request(f"pool.admin.{path}", admin_inbox("fleet"), body, timeout=timeout)

    def _request(self, subject: str, inbox_prefix: str, body: bytes, *, timeout: float,
                 headers: dict[str, str] | None = None) -> bytes:
        async def go() -> bytes:
            inbox = f"{inbox_prefix}.{self._nc.new_inbox().rsplit('.', 1)[-1]}"
            sub = await self._nc.subscribe(inbox, max_msgs=1)
            try:
                await self._nc.publish(subject, body, reply=inbox, headers=headers)
                msg = await sub.next_msg(timeout=timeout)
            finally:
                with contextlib.suppress(NatsError):
                    await sub.unsubscribe()
            if (msg.headers or {}).get("Status") == "503":
                raise nats.errors.NoRespondersError
            return bytes(msg.data)

        try:
            return self._run(go(), timeout + 5)  # type: ignore[no-any-return]
        except NatsTimeout as e:
            raise BusTimeout(f"no answer on {subject}") from e
        except nats.errors.NoRespondersError as e:
            raise BusUnavailable(f"no control plane answers {subject}") from e

    def node(self, node_id: str) -> NodeLink:
        return NodeLink(self, node_id)

    def close(self) -> None:
        """The nodes' pulls end first, so the connection closes without a thousand of them
        in flight."""

        async def end_pulls() -> None:
            pulls = list(self._pulls.values())
            self._pulls.clear()
            for task in pulls:
                task.cancel()
            await asyncio.gather(*pulls, return_exceptions=True)

        with contextlib.suppress(Exception):  # closing is best effort
            self._run(end_pulls(), 10)
        super().close()


class NodeLink:
    """One simulated node's view of a FleetLink, shaped like AgentLink for the Agent class;
    its commands are handed to it by the fleet's round (`fetch` returns what was given)."""

    def __init__(self, fleet: FleetLink, node_id: str) -> None:
        self.fleet = fleet
        self.node = token(node_id)
        self.inbox: list[AgentCommand] = []

    def fetch(self, batch: int = 16, timeout: float = 0.0) -> list[AgentCommand]:
        got, self.inbox = self.inbox, []
        return got

    def request(self, suffix: str, body: bytes, *, timeout: float = 5.0,
                headers: dict[str, str] | None = None) -> bytes:
        return self.fleet.request(self.node, suffix, body, timeout=timeout, headers=headers)

    def publish(self, subject: str, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.fleet.publish(subject, body, headers)
