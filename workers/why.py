"""What a scheduler process answers from memory: `why`, queue positions and a pool's fair
shares, its own or asked of the pool's leader (`pool.lead.<pool>.…`), and `why` at a past time."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from bus.decisions import DecisionReader
from bus.lead import LeadDesk
from schemas import v1
from schemas.codec import SchemaError, encode
from schemas.feed import FeedReplay
from workers.application import PoolApp
from workers.commands import failure
from workers.errors import ServiceError, UnknownSubject
from workers.quotas import fair_shares
from workers.routes import ROUTES, Router
from workers.scheduler import Scheduler
from workers.scheduler.decisions import why_at


class _WhyContext:
    """The route table's Context for the scheduler's routes: `why` and queue positions, from
    its reasons, or for a pool another process leads, from that leader's (`desk`)."""

    webhooks = secrets = None  # the command service's desks: not served here

    def __init__(self, app: PoolApp, scheduler: Scheduler, desk: LeadDesk | None = None,
                 decisions: DecisionReader | None = None) -> None:
        self.app = app
        self.scheduler = scheduler
        self.desk = desk
        self.decisions = decisions

    def why(self, tenant: str, lease_id: str, at: float | None = None) -> v1.Envelope:
        if at is not None:  # what was recorded then (workers.scheduler.decisions)
            return why_at(self.app, self.decisions, tenant, lease_id, at)
        pool = self.scheduler.pool_of(tenant, lease_id)
        stale = False
        if self.desk is not None and pool is not None and not self.scheduler.leads(pool):
            # only the pool's leader runs its placement, so only it knows current reasons
            asked = self.desk.ask(pool, "why", json.dumps(
                {"tenant": tenant, "lease_id": lease_id}).encode())
            led = _led_result(asked)
            if isinstance(led, dict):
                return v1.Envelope.success(result=led)
            stale = True  # no leader answered in time: this process's own, maybe old, reasons
        answer = self.scheduler.why(tenant, lease_id)
        if answer is None:
            return v1.Envelope.failure("lease_not_found",
                                       f"no lease {lease_id!r} for tenant {tenant!r}")
        if stale:
            answer["stale"] = True
        return v1.Envelope.success(result=answer)

    def queue_positions(self, tenant: str) -> v1.Envelope:
        rows = self.scheduler.queue_positions(tenant)
        if self.desk is not None:
            rows = self._positions_from_leaders(self.desk, tenant, rows)
        return v1.Envelope.success(result={"leases": rows})

    def _positions_from_leaders(self, desk: LeadDesk, tenant: str,
                                rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`rows` with each pool this process does not lead replaced by its leader's rows, or
        kept and marked stale when that leader does not answer; the leaders asked at once."""
        pools = sorted({str(r["pool"]) for r in rows})
        asked = [pool for pool in pools if not self.scheduler.leads(pool)]
        answers = dict(zip(asked, desk.ask_all(asked, "queue", json.dumps(
            {"tenant": tenant}).encode()), strict=True))
        out: list[dict[str, Any]] = []
        for pool in pools:
            mine = [r for r in rows if r["pool"] == pool]
            if pool not in answers:
                out += mine
                continue
            led = _led_result(answers[pool])
            if isinstance(led, list) and all(isinstance(r, dict) for r in led):
                out += led
            else:
                out += [{**r, "stale": True} for r in mine]
        return out

    def pool_shares(self, pool_id: str) -> v1.Envelope:
        """The pool's fair shares (`pool shares`): the leader's, or this process's own marked
        stale when that leader does not answer in time."""
        if pool_id not in self.scheduler.pools:  # every scheduler process folds every pool
            return v1.Envelope.failure("unknown_pool", f"no pool named {pool_id!r}")
        stale = False
        if self.desk is not None and not self.scheduler.leads(pool_id):
            led = _led_result(self.desk.ask(pool_id, "shares", b"{}"))
            if isinstance(led, dict):
                return v1.Envelope.success(result=led)
            stale = True
        answer = shares_now(self.scheduler, pool_id)
        if answer is None:
            return v1.Envelope.failure("unknown_pool", f"no pool named {pool_id!r}")
        if stale:
            answer["stale"] = True
        return v1.Envelope.success(result=answer)

    def query_view(self, tenant: str, view: str, q: v1.Query) -> v1.Envelope:
        raise UnknownSubject("queries are answered by the command service")

    def telemetry_replay(self, tenant: str, q: v1.TelemetryReplay) -> v1.Envelope:
        raise UnknownSubject("telemetry is replayed by the command service")

    def feed_replay(self, tenant: str, q: FeedReplay) -> v1.Envelope:
        raise UnknownSubject("the feed is replayed by the command service")


def _led_result(reply: bytes | None) -> Any:
    """The result in a leader's reply (None: no usable answer, including none)."""
    try:
        answer = json.loads(reply) if reply is not None else None
    except ValueError:
        return None
    return answer.get("result") if isinstance(answer, dict) else None


def shares_now(scheduler: Scheduler, pool_id: str) -> dict[str, Any] | None:
    """The pool's fair shares as `scheduler` holds them now (None: it knows no such pool);
    read under its lock, so never half way through a cycle."""
    with scheduler._lock:  # the fold's one lock, as the scheduler's own answers take it
        ps = scheduler.pools.get(pool_id)
        if ps is None or ps.queue is None:
            return None
        ps.refresh_totals()
        return fair_shares(ps, scheduler.clock())


def lead_answers(scheduler: Scheduler) -> Callable[[str, str, bytes], bytes]:
    """What a pool's leader answers on `pool.lead.<pool>.{why,queue,shares}` (bus.lead): its
    own reasons, the tenant's rows of that pool's queue, or the pool's fair shares, as
    `{"result": …}` (null: no such lease or pool); a question it cannot read gets an error."""

    def answer(pool: str, verb: str, body: bytes) -> bytes:
        try:
            q = json.loads(body)
        except ValueError:
            q = None
        tenant = q.get("tenant") if isinstance(q, dict) else None
        lease_id = q.get("lease_id") if isinstance(q, dict) else None
        result: Any
        if verb == "why" and isinstance(tenant, str) and isinstance(lease_id, str):
            result = scheduler.why(tenant, lease_id)
        elif verb == "queue" and isinstance(tenant, str):
            result = [r for r in scheduler.queue_positions(tenant) if r["pool"] == pool]
        elif verb == "shares":
            result = shares_now(scheduler, pool)
        else:
            return json.dumps({"error": {"code": "bad_question"}}).encode()
        return json.dumps({"result": result}).encode()

    return answer


def why_handler(scheduler: Scheduler, desk: LeadDesk | None = None,
                decisions: DecisionReader | None = None,
                ) -> Callable[[str, bytes, dict[str, str]], bytes]:
    router = Router(ROUTES, served_by=("scheduler",))
    ctx = _WhyContext(scheduler.app, scheduler, desk, decisions)

    def handle(subject: str, body: bytes, headers: dict[str, str]) -> bytes:
        try:
            return encode(router.dispatch(ctx, subject, body))
        except SchemaError as e:
            return encode(e.to_envelope())
        except ServiceError as e:
            return failure(e.code, e.message, e.reasons)

    return handle
