"""A read ahead asked of a recorder whose bus runtime has closed (a scheduler stopping while its
catch-up prefetches) is refused at once and leaves no coroutine behind unawaited."""

from __future__ import annotations

import gc
import warnings

import pytest

from bus.errors import BusUnavailable
from bus.local.server import NatsServer
from workers.application import PoolApp
from workers.bootstrap import app_env


def test_a_read_ahead_on_a_closed_runtime_leaves_no_coroutine_unawaited(
    nats_server: NatsServer,
) -> None:
    app = PoolApp(env=app_env(nats_server.url))
    recorder = app.recorder
    recorder.max_notification_id()  # connected
    recorder.runtime.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with pytest.raises(BusUnavailable):
                recorder.prefetch(1, 100)
            with pytest.raises(BusUnavailable):
                next(iter(recorder.read_records(1)))
        gc.collect()
    unawaited = [str(w.message) for w in caught if "never awaited" in str(w.message)]
    assert unawaited == []
    app.close()
