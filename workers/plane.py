"""The runner of one control-plane process: the threads and services of a composition
(workers/bootstrap.py). `pool serve` runs it, whole or as some roles: docs/operations.md#scaling-out.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Self

from bus.service import Service
from workers.bootstrap import (
    SERVED,
    Composition,
    PlaneConfig,
    Role,
    app_env,
    build,
    holder_id,
    served,
)
from workers.dispatcher import run_loop
from workers.routes import subscriptions
from workers.scheduler.decisions import record_decisions
from workers.why import why_handler

if TYPE_CHECKING:
    from workers.metrics import MetricsServer

__all__ = ["ROLES", "ControlPlane", "app_env", "holder_id", "holder_pid", "parse_roles"]

log = logging.getLogger(__name__)

# what scheduler processes answer: `why` and queue positions, from their memory (or a pool's
# leader's, when pools are led apart)
SCHEDULER_SUBJECTS = subscriptions(["scheduler"])
# what `pool serve --role` names (each a group of the composition's roles: bootstrap.SERVED)
ROLES = tuple(SERVED)
# started planes per NATS URL in this process: they share its bus runtimes, which only the
# last one to stop may close
_live: Counter[str] = Counter()
_live_lock = threading.Lock()


def parse_roles(values: Iterable[str] | None) -> frozenset[str]:
    """`--role` values (repeated, comma-separated, or `all`) as a set of ROLES; None is all."""
    if values is None:
        return frozenset(ROLES)
    roles: set[str] = set()
    for value in values:
        for role in (r.strip() for r in value.split(",")):
            if role == "all":
                roles.update(ROLES)
            elif role in ROLES:
                roles.add(role)
            elif role:
                raise ValueError(f"unknown role {role!r}: choose from {', '.join(ROLES)} or all")
    if not roles:
        raise ValueError(f"no role given: choose from {', '.join(ROLES)} or all")
    return frozenset(roles)


def holder_pid(holder: str | None) -> int | None:
    """The pid a `holder_id` names, or None for a holder that is not one (an observer's)."""
    parts = (holder or "").rsplit("-", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


class ControlPlane:
    """Runs a composition: `start()` serves, `stop()` drains. Its parts are read through it
    (`plane.scheduler`, `plane.app`, …).

    Made from a composition (`ControlPlane(bootstrap.build(config, roles))`), or, for tests
    and tools, from a URL and PlaneConfig's fields with `roles` as `--role` names (default
    all) and `data_plane=False` for a plane that sends no orders and fires no timers."""

    def __init__(self, plane: Composition | PlaneConfig | str, /, *,
                 roles: Iterable[str] | None = None, data_plane: bool = True,
                 **settings: Any) -> None:
        if isinstance(plane, str):
            if settings.get("projector_views") is not None:
                settings["projector_views"] = tuple(settings["projector_views"])
            settings["role_urls"] = dict(settings.get("role_urls") or {})
            plane = PlaneConfig(plane, **settings)
        if isinstance(plane, PlaneConfig):
            plane = build(plane, served(parse_roles(roles), data_plane=data_plane))
        self.parts = plane
        self.metrics: MetricsServer | None = None
        self._stop = plane.halt
        self._workers: list[threading.Thread] = []
        self._thread: threading.Thread | None = None
        self._why_lock = threading.Lock()
        self.why: Service | None = None
        self.decisions: Any = None

    def __getattr__(self, name: str) -> Any:
        # the composition's parts and settings, read through the plane
        parts = self.__dict__.get("parts")
        if parts is None:
            raise AttributeError(name)
        return getattr(parts, name)

    def _serve_why(self, leading: bool) -> None:
        # without pool leaders only the active scheduler knows current reasons, so only it
        # answers `why`; with them, every running scheduler process does (see start)
        p = self.parts
        with self._why_lock:
            if leading and self.why is None:
                assert p.scheduler is not None
                self.why = Service(p.responder_url, SCHEDULER_SUBJECTS,
                                   why_handler(p.scheduler, p.desk, self.decisions),
                                   queue="pool-scheduler", threads=2).start()
            elif not leading and self.why is not None:
                self.why.stop()
                self.why = None

    def _schedule(self) -> None:
        p = self.parts
        election, scheduler = p.election, p.scheduler
        assert election is not None and scheduler is not None
        if p.pool_leadership is not None:
            # every process folds the log; each places only the pools it leads
            scheduler.leads = p.pool_leadership.leads
            while not self._stop.is_set():
                scheduler.run(self._stop, signal=p.scheduler_signal)
            self._serve_why(False)  # its memory no longer follows the log: the others answer
            return
        while not self._stop.is_set():
            if election.is_leader:
                scheduler.run(self._stop, until=lambda: not election.is_leader,
                              signal=p.scheduler_signal)
            else:
                with contextlib.suppress(Exception):  # the bus may be down; keep standing by
                    scheduler.catch_up()  # stay warm for a fast takeover
                self._stop.wait(0.2)

    def _dispatch(self) -> None:
        p = self.parts
        dispatcher, election = p.dispatcher, p.election
        assert dispatcher is not None
        while not self._stop.is_set():
            if election is not None and not election.is_leader:
                self._stop.wait(0.2)  # only the active scheduler's plane sends orders
                continue
            run_loop(dispatcher.step, self._stop, name="dispatcher",
                     until=(lambda: election is not None and not election.is_leader),
                     signal=p.dispatcher_signal)

    def _urls(self) -> set[str]:
        return {self.parts.nats_url, *self.parts.role_urls.values()}

    def start(self) -> Self:
        p = self.parts
        with _live_lock:
            _live.update(self._urls())
            self._counted = True
        if p.projector is not None:
            p.projector.start()
        if p.config.metrics_port is not None:
            self.metrics = self._serve_metrics(p.config.metrics_host, p.config.metrics_port)
        from bus.local.auth import speaks_as_role

        for link, role in ((p.link, "scheduler"), (p.reconciler_link, "reconciler")):
            if link is not None and not speaks_as_role(p.role_urls.get(role, p.nats_url)):
                link.ensure_streams()  # a role's user may not: the operator made them
        if (p.checkpoint_store is not None
                and not speaks_as_role(p.role_urls.get("scheduler", p.nats_url))):
            p.checkpoint_store.ensure()
        # its cycles (run here, or by hand) record changed wait reasons in their own stream
        self.decisions = (record_decisions(p.scheduler)
                          if p.scheduler is not None and Role.SCHEDULER in p.roles else None)
        self._start_workers()
        if not p.serve_why:
            pass  # `why` is answered by the processes that run a scheduler
        elif p.election is None:
            self._serve_why(True)
        else:
            if p.pool_leadership is not None:
                # pools led apart: every scheduler process answers `why`, asking a pool's
                # leader where it is not that leader
                self._serve_why(True)
                p.election.start()
                p.pool_leadership.start()
            else:
                p.election.start(on_change=self._serve_why)
            self._thread = threading.Thread(target=self._schedule, name="pool-scheduler",
                                            daemon=True)
            self._thread.start()
        return self

    def _start_workers(self) -> None:
        """The dispatcher's and reconciler's threads, the deliverer and the command lanes."""
        p = self.parts
        if p.dispatcher is not None:
            self._workers.append(threading.Thread(target=self._dispatch,
                                                  name="pool-dispatcher", daemon=True))
        if p.reconciler is not None:
            self._workers.append(threading.Thread(
                target=run_loop, name="pool-reconciler", daemon=True,
                args=(p.reconciler.step, self._stop),
                kwargs={"idle": 0.0, "name": "reconciler"}))
        for t in self._workers:
            t.start()
        if p.deliverer is not None:
            p.deliverer.start()
        for lane in p.lanes:
            lane.start()

    def _serve_metrics(self, host: str, port: int) -> MetricsServer:
        from workers.metrics import MetricsServer, registry_for

        app = self.parts.app
        assert app is not None

        def head() -> int | None:
            return app.recorder.max_notification_id()

        return MetricsServer(registry_for(log_head=head, database_url=self.parts.database_url),
                             port, host)

    def stop(self) -> None:
        p = self.parts
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None
        self._stop.set()
        if p.reconciler_link is not None:
            p.reconciler_link.interrupt()  # its thread waits on fired timers: not a whole fetch
        for signal in (p.scheduler_signal, p.dispatcher_signal):
            if signal is not None:
                signal.close()  # wakes its waiter; drops the interest while the bus answers
        if self._thread is not None:
            self._thread.join(10)
        for t in self._workers:
            t.join(10)
        if p.deliverer is not None:
            p.deliverer.stop()
        for link in (p.link, p.reconciler_link):
            if link is not None:
                link.close()
        if p.election is not None:
            p.election.stop(release=True)
        if p.pool_leadership is not None:
            p.pool_leadership.stop(release=True)
        for lane in p.lanes:
            lane.stop()
        self._serve_why(False)
        if p.desk is not None:
            p.desk.close()
        if p.projector is not None:
            p.projector.stop()
        p.close()
        from bus.runtime import close_runtime

        with _live_lock:
            if getattr(self, "_counted", False):
                _live.subtract(self._urls())
                self._counted = False
            last = [url for url in self._urls() if _live[url] <= 0]
            for url in last:
                del _live[url]
        for url in last:  # the recorders' shared connections go with the last plane on them
            close_runtime(url)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
