"""A scheduler killed after a checkpoint: its successor starts from that checkpoint, folds what
came after, and places the next request where the log says there is room, never twice."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bus.checkpoints import KEY_ENV, CheckpointStore
from bus.local.server import NatsServer
from client.api import PoolClient
from projections.decisions import check_placements
from tests.control_plane import lease_body, node_body, setup_pool
from workers.application import PoolApp
from workers.bootstrap import app_env
from workers.plane import ControlPlane

KEY = "a-secret-only-the-schedulers-hold"


def _wait(pred: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False


def _checkpointed_at(store: CheckpointStore) -> int:
    got = store.get()
    return int(json.loads(got[0])["position"]) if got is not None else 0


def test_a_scheduler_killed_after_a_checkpoint_restarts_from_it_and_places_correctly(
        fresh_nats: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = fresh_nats.url
    monkeypatch.setenv(KEY_ENV, KEY)
    commands = ControlPlane(url, run_scheduler=False, data_plane=False).start()
    store = CheckpointStore(url)
    store.ensure()
    env = {**os.environ, "POOL_HOME": str(tmp_path / "home"), "POOL_DATABASE_URL": ""}
    first = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "serve", "--role", "scheduler", "--nats-url", url,
         "--leader-ttl", "1", "--checkpoint-every", "1", "--checkpoint-seconds", "0.2"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    second: ControlPlane | None = None
    app = PoolApp(env=app_env(url))
    try:
        with PoolClient(url) as admin, PoolClient(url, "alpha") as alpha:
            setup_pool(admin)
            assert admin.admin("node.register", node_body("n1", cpu_millis=8000))["ok"]
            before = alpha.request_lease(lease_body("before", cpu_millis=4000))["lease"]
            assert _wait(lambda: alpha.lease(before["lease_id"], "get")["lease"]["state"]
                         == "reserved")
            # its checkpoint holds everything up to its own placement
            end = app.recorder.max_notification_id() or 0
            assert _wait(lambda: _checkpointed_at(store) >= end), (_checkpointed_at(store), end)
            at = _checkpointed_at(store)
            first.send_signal(signal.SIGKILL)
            first.wait(10)
            # while no scheduler runs: one request fits beside the first, one does not
            fits = alpha.request_lease(lease_body("fits", cpu_millis=4000))["lease"]["lease_id"]
            waits = alpha.request_lease(lease_body("waits", cpu_millis=4000))["lease"]["lease_id"]
            second = ControlPlane(url, roles=["scheduler"], leader_ttl_seconds=1.0,
                                  data_plane=False).start()
            assert _wait(lambda: alpha.lease(fits, "get")["lease"]["state"] == "reserved")
            checkpoints = second.scheduler.checkpoints
            assert checkpoints is not None and checkpoints.restored_at == at
            assert alpha.lease(waits, "get")["lease"]["state"] == "queued"
            assert alpha.lease(before["lease_id"], "get")["lease"]["state"] == "reserved"
        report = check_placements(app)
        assert not report.over_allocations and not report.double_holds, report
        assert report.placements == 2, report
    finally:
        with contextlib.suppress(ProcessLookupError):
            first.kill()
        if second is not None:
            second.stop()
        commands.stop()
        app.close()
