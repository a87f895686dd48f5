"""The route table: one list drives subscriptions, decoding, dispatch and the AsyncAPI export."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from schemas import v1
from schemas.codec import SchemaError
from schemas.export import asyncapi
from schemas.feed import FeedReplay
from workers.errors import UnknownSubject
from workers.routes import ROUTES, Router, asyncapi_channels, subscriptions

ROOT = Path(__file__).resolve().parents[2]


class _Recorder:
    """A Context whose application records the call it was given."""

    webhooks = secrets = None  # no desks: their routes are refused as unavailable

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        outer = self

        class App:
            def __getattr__(self, name: str) -> Any:
                def call(*args: Any, **kw: Any) -> Any:
                    outer.calls.append((name, args))
                    return {"called": name}

                return call

        self._app = App()

    @property
    def app(self) -> Any:
        return self._app

    def why(self, tenant: str, lease_id: str, at: float | None = None) -> v1.Envelope:
        return v1.Envelope.success(result={"why": [tenant, lease_id]})

    def query_view(self, tenant: str, view: str, q: v1.Query) -> v1.Envelope:
        return v1.Envelope.success(result={"view": view, "tenant": tenant})

    def telemetry_replay(self, tenant: str, q: v1.TelemetryReplay) -> v1.Envelope:
        return v1.Envelope.success(result={"tenant": tenant})

    def feed_replay(self, tenant: str, q: FeedReplay) -> v1.Envelope:
        return v1.Envelope.success(result={"tenant": tenant})


def test_each_subject_pattern_appears_once() -> None:
    subjects = [r.subject for r in ROUTES]
    assert len(subjects) == len(set(subjects))
    assert len({r.operation for r in ROUTES}) == len(ROUTES)


def test_the_command_service_subscribes_to_what_the_table_serves() -> None:
    subs = subscriptions(["commands"])
    assert "pool.cmd.*.lease.request" in subs
    assert "pool.node.*.lease.*.stopped" in subs
    assert subs.count("pool.admin.>") == 1  # admin routes share one wide subscription
    assert "pool.cmd.*.lease.*.why" not in subs  # the scheduler answers `why`
    # the scheduler answers `why`, queue positions and the operator's fair shares, from its
    # memory; the operator's question outside `pool.admin.>`, which the command service answers
    assert subscriptions(["scheduler"]) == ["pool.cmd.*.lease.*.why", "pool.cmd.*.queue",
                                            "pool.ops.pool.shares"]
    assert not any(s.startswith("pool.admin.") for s in subscriptions(["scheduler"]))
    assert subscriptions(["queries"]) == ["pool.cmd.*.query.*"]


class _Served:
    """A Context over a real application kept in memory."""

    def __init__(self) -> None:
        from workers.application import PoolApp

        self.app = PoolApp(env={"PERSISTENCE_MODULE": "eventsourcing.popo"},
                           clock=lambda: 1_700_000_000.0)

    def why(self, tenant: str, lease_id: str, at: float | None = None) -> v1.Envelope:
        raise UnknownSubject("not here")

    query_view = telemetry_replay = feed_replay = why  # type: ignore[assignment]


def test_a_request_and_a_lease_verb_go_through_the_table_to_the_application() -> None:
    ctx, router = _Served(), Router()
    router.dispatch(ctx, "pool.admin.pool.set", b'{"pool_id": "p1"}')
    body = (b'{"pool_id": "p1", "shape": {"cpu_millis": 1000, "memory_mib": 512},'
            b' "maximum_runtime_seconds": 60, "idempotency_key": "k1"}')
    made = router.dispatch(ctx, "pool.cmd.acme.lease.request", body)
    assert made.ok and made.lease is not None and made.lease["state"] == "queued"
    got = router.dispatch(ctx, f"pool.cmd.acme.lease.{made.lease['lease_id']}.get", b"")
    assert got.lease == made.lease
    cancelled = router.dispatch(ctx, f"pool.cmd.acme.lease.{made.lease['lease_id']}.cancel",
                                b'{"reason": "done"}')
    assert cancelled.lease is not None and cancelled.lease["state"] == "cancelled"


def test_an_admin_node_verb_outside_the_vocabulary_is_an_unknown_command() -> None:
    router = Router()
    _, params = router.match("pool.admin.node.n1.cordon")
    assert params == {"node": "n1", "verb": "cordon"}
    with pytest.raises(UnknownSubject):
        router.match("pool.admin.node.n1.explode")


@pytest.mark.parametrize("subject", ["pool.cmd.ACME.lease.request",
                                     "pool.node.n\u00e9.register",
                                     "pool.cmd.acme.lease.x%y.get"])
def test_a_parameter_that_is_not_a_subject_token_is_refused(subject: str) -> None:
    with pytest.raises(UnknownSubject) as e:
        Router().match(subject)
    assert e.value.code == "unknown_command"


def test_a_body_that_does_not_decode_is_refused_before_any_handler_runs() -> None:
    ctx = _Recorder()
    with pytest.raises(SchemaError) as e:
        Router().dispatch(ctx, "pool.cmd.acme.lease.l-1.renew", b'{"extend_seconds": "x"}')
    assert e.value.code == "invalid_field" and ctx.calls == []


def test_the_scheduler_router_answers_only_why() -> None:
    router = Router(served_by=("scheduler",))
    env = router.dispatch(_Recorder(), "pool.cmd.acme.lease.l-1.why", b"")
    assert env.result == {"why": ["acme", "l-1"]}
    with pytest.raises(UnknownSubject):
        router.match("pool.cmd.acme.lease.l-1.get")


def test_the_asyncapi_document_has_one_channel_per_route() -> None:
    doc = asyncapi(asyncapi_channels())
    addresses = {c["address"] for c in doc["channels"].values()} - {None}
    assert addresses == {r.subject for r in ROUTES}
    for r in ROUTES:
        op = doc["operations"][r.operation]
        assert op["summary"] == r.summary
        assert ("reply" in op) == r.replies


def test_importing_the_route_table_connects_to_nothing() -> None:
    code = ("import sys, workers.routes;"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('nats', 'psycopg')"
            " or m in ('workers.application', 'bus.runtime')];"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
