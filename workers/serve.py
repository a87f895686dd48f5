"""One control-plane process: the command service, the scheduler and its `why` answers.

`pool serve` runs this; tests build the same `ControlPlane` and drive the scheduler by hand.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from bus.service import Service
from schemas.codec import SchemaError, decode_command, encode
from workers.app import PoolApp
from workers.commands import ADMIN_SUBJECTS, COMMAND_SUBJECTS, CommandHandler, failure, ok
from workers.scheduler import Scheduler

WHY_SUBJECT = "pool.cmd.*.lease.*.why"


def app_env(nats_url: str, **extra: str) -> dict[str, str]:
    return {"PERSISTENCE_MODULE": "bus.jetstream", "NATS_URL": nats_url, **extra}


def why_handler(scheduler: Scheduler) -> Callable[[str, bytes, dict[str, str]], bytes]:
    def handle(subject: str, body: bytes, headers: dict[str, str]) -> bytes:
        parts = subject.split(".")
        try:
            decode_command("lease.why", body)
        except SchemaError as e:
            return encode(e.to_envelope())
        answer = scheduler.why(parts[2], parts[4])
        if answer is None:
            return failure("lease_not_found", f"no lease {parts[4]!r} for tenant {parts[2]!r}")
        return ok(result=answer)

    return handle


class ControlPlane:
    """Commands + scheduler on one NATS server; `start()` serves, `stop()` drains."""

    def __init__(self, nats_url: str, *, clock: Callable[[], float] = time.time,
                 run_scheduler: bool = True) -> None:
        self.nats_url = nats_url
        self.app = PoolApp(env=app_env(nats_url), clock=clock)
        self.scheduler = Scheduler(PoolApp(env=app_env(nats_url), clock=clock), clock=clock)
        self.commands = Service(nats_url, COMMAND_SUBJECTS + ADMIN_SUBJECTS,
                                CommandHandler(self.app), queue="pool-commands")
        self.why = Service(nats_url, [WHY_SUBJECT], why_handler(self.scheduler),
                           queue="pool-scheduler", threads=2)
        self.run_scheduler = run_scheduler
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> ControlPlane:
        self.commands.start()
        self.why.start()
        if self.run_scheduler:
            self._thread = threading.Thread(target=self.scheduler.run, args=(self._stop,),
                                            name="pool-scheduler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self.commands.stop()
        self.why.stop()
        self.app.close()
        self.scheduler.app.close()
        from bus.runtime import close_runtime

        close_runtime(self.nats_url)  # the recorders' shared connection goes with them

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
