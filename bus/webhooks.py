"""The webhook deliverer's side of the bus: its durable consumer on the tenants' lease feed and
the delivery states in KV bucket `pool_webhooks` (`<tenant>.<endpoint>.<feed seq>`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import BadRequestError, KeyNotFoundError

from bus.errors import BusTimeout
from bus.junk import junk_values
from bus.runtime import BusRuntime, get_runtime
from bus.streams import ensure_kv_bucket
from bus.subjects import FEED_PREFIX, FEED_STREAM, WEBHOOK_BUCKET, token

log = logging.getLogger(__name__)

WEBHOOK_CONSUMER = "webhooks"
DELIVERIES_BUCKET = WEBHOOK_BUCKET
DELIVERIES_TTL_S = 7 * 24 * 3600.0  # a delivery's state is kept a week after its last change
# feed records handed out and not yet acked (fanned out): a record is acked once its
# deliveries are stored, so this bounds only the deliverer's read-ahead
MAX_ACK_PENDING = 1000


async def ensure_webhook_consumer(js: Any, *, replicas: int = 1) -> None:
    """The deliveries bucket and the deliverer's durable consumer on POOL_FEED (the operator
    makes them: `pool up`, `pool cluster init`)."""
    await ensure_kv_bucket(js, DELIVERIES_BUCKET, replicas=replicas,
                           ttl_seconds=DELIVERIES_TTL_S)
    with contextlib.suppress(BadRequestError):  # exists with this config already
        await js.add_consumer(FEED_STREAM, ConsumerConfig(
            durable_name=WEBHOOK_CONSUMER, filter_subject=f"{FEED_PREFIX}.>",
            ack_policy=AckPolicy.EXPLICIT, ack_wait=60, deliver_policy=DeliverPolicy.ALL,
            max_ack_pending=MAX_ACK_PENDING))


@dataclass(frozen=True)
class FeedMessage:
    """One stored feed record as the deliverer's consumer hands it out: its feed sequence,
    body, and what settles it (`ack`: fanned out; `nak(delay)`: hand it out again later)."""

    seq: int
    subject: str
    body: bytes
    ack: Callable[[], None]
    nak: Callable[[float], None]


class WebhookBus:
    """A synchronous facade on a bus runtime: the feed consumer and the deliveries bucket."""

    def __init__(self, url: str, *, runtime: BusRuntime | None = None) -> None:
        self.rt = runtime or get_runtime(url)
        self._sub: Any = None
        self._kv: Any = None

    def ensure(self) -> None:
        async def go() -> None:
            await ensure_webhook_consumer(await self.rt.jetstream())

        self.rt.run(go())

    def fetch(self, batch: int = 100, timeout: float = 0.5) -> list[FeedMessage]:
        """Feed records not yet fanned out, waiting up to `timeout` for the first."""

        async def go() -> list[FeedMessage]:
            if self._sub is None:
                js = await self.rt.jetstream()
                self._sub = await js.pull_subscribe_bind(WEBHOOK_CONSUMER, FEED_STREAM)
            try:
                msgs = await self._sub.fetch(batch, timeout=timeout)
            except TimeoutError:  # nats' TimeoutError is one too
                return []
            return [FeedMessage(int(m.metadata.sequence.stream), m.subject, m.data,
                                self._ack(m), self._nak(m)) for m in msgs]

        try:
            return self.rt.run(go(), timeout=timeout + 5)
        except BusTimeout:
            return []

    def _ack(self, msg: Any) -> Callable[[], None]:
        def ack() -> None:
            self.rt.run(msg.ack())

        return ack

    def _nak(self, msg: Any) -> Callable[[float], None]:
        def nak(delay: float) -> None:
            self.rt.run(msg.nak(delay=delay))

        return nak

    async def _bucket(self) -> Any:
        if self._kv is None:
            js = await self.rt.jetstream()
            self._kv = await js.key_value(DELIVERIES_BUCKET)
        return self._kv

    def put(self, key: str, state: dict[str, Any]) -> None:
        """Store a delivery's state under `key` (delivery_key)."""

        async def go() -> None:
            kv = await self._bucket()
            await kv.put(key, msgspec.json.encode(state))

        self.rt.run(go())

    def states(self, prefix: str, *, limit: int | None = None) -> list[dict[str, Any]]:
        """The stored states whose keys start with `prefix` (`<tenant>.>`, or everything with
        `>`), the most recent sequences last; at most the last `limit`."""

        async def go() -> list[dict[str, Any]]:
            kv = await self._bucket()
            # a watcher of the keys under `prefix` (KeyValue.keys filters by substring)
            watcher = await kv.watch(prefix, ignore_deletes=True, meta_only=True)
            keys: list[str] = []
            try:
                async for entry in watcher:
                    if entry is None:
                        break
                    keys.append(entry.key)
            finally:
                await watcher.stop()
            keys.sort(key=lambda k: int(k.rsplit(".", 1)[-1]) if k.rsplit(".", 1)[-1].isdigit()
                      else 0)
            if limit is not None:
                keys = keys[-limit:]
            out: list[dict[str, Any]] = []
            for key in keys:
                with contextlib.suppress(KeyNotFoundError):  # aged out meanwhile
                    entry = await kv.get(key)
                    if entry.value:
                        state = _state(entry.value)
                        if state is None:  # a server's answer aimed at the key: skipped
                            junk_values().report(entry.revision or 0,
                                                 f"$KV.{DELIVERIES_BUCKET}.{key}")
                        else:
                            out.append(state)
            return out

        return self.rt.run(go(), timeout=60)

    def close(self) -> None:
        sub, self._sub = self._sub, None
        if sub is None or self.rt.closed:
            return
        with contextlib.suppress(Exception):  # closing is best effort
            self.rt.run(sub.unsubscribe(), timeout=5)


def _state(value: bytes) -> dict[str, Any] | None:
    """A delivery's stored state; None when `value` is no state the deliverer could have put
    (a server's answer some client aimed at the key as its reply subject)."""
    try:
        state = msgspec.json.decode(value)
    except msgspec.DecodeError:
        return None
    if not isinstance(state, dict) or not {"tenant", "endpoint_id", "seq"} <= state.keys():
        return None
    return state


def delivery_key(tenant: str, endpoint_id: str, seq: int) -> str:
    return f"{token(tenant)}.{token(endpoint_id)}.{seq}"


def tenant_filter(tenant: str, endpoint_id: str | None = None) -> str:
    return f"{token(tenant)}.{token(endpoint_id) if endpoint_id else '*'}.*"


__all__ = ["DELIVERIES_BUCKET", "WEBHOOK_CONSUMER", "FeedMessage", "WebhookBus",
           "delivery_key", "ensure_webhook_consumer", "tenant_filter"]
