"""The scheduler's catch-up past messages of the log stream that are not its events (an
aggregate's snapshot, as logs kept them before POOL_SNAPSHOTS; a stray) lying just before one
of its own acknowledged batches."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bus.local.server import NatsServer
from bus.runtime import BusRuntime
from client.api import PoolClient
from tests.control_plane import FakeClock, lease_body, node_body, setup_pool, start


def test_a_snapshot_just_before_the_schedulers_own_batch_does_not_stop_its_catch_up(
        fresh_nats: NatsServer) -> None:
    clock = FakeClock()
    cp = start(fresh_nats.url, clock)
    admin = PoolClient(fresh_nats.url)
    rt = BusRuntime(fresh_nats.url)
    try:
        setup_pool(admin, tenants={"alpha": 1.0})
        assert admin.admin("node.register", node_body("n1"))["ok"]
        scheduler = cp.scheduler
        catch_up: Callable[..., int] = scheduler.catch_up

        async def snapshot() -> None:
            # as an older snapshot thread's save landed in the log between the scheduler's read
            # and its own save
            js = await rt.jetstream()
            await js.publish("pool.evt.pool_snapshots.00000000-0000-0000-0000-000000000001",
                             b"{}", headers={"Pool-Topic": "domain.snapshots:StateSnapshot"})

        def catch_up_then_snapshot(**kw: Any) -> int:
            n = catch_up(**kw)
            rt.run(snapshot())
            return n

        with PoolClient(fresh_nats.url, "alpha") as alpha:
            first = alpha.request_lease(lease_body("a"))["lease"]["lease_id"]
            scheduler.catch_up = catch_up_then_snapshot  # type: ignore[method-assign]
            assert scheduler.cycle().placed == 1
            scheduler.catch_up = catch_up  # type: ignore[method-assign]
            assert alpha.lease(first, "get")["lease"]["state"] == "reserved"
            second = alpha.request_lease(lease_body("b"))["lease"]["lease_id"]
            assert scheduler.cycle().placed == 1  # it read past the snapshot and its own batch
            assert alpha.lease(second, "get")["lease"]["state"] == "reserved"
            scheduler.catch_up()  # steps over its own batch
            assert scheduler.position == scheduler.app.recorder.max_notification_id()
    finally:
        rt.close()
        admin.close()
        cp.stop()
