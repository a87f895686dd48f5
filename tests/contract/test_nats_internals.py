"""The nats-py internals behind the fast lane (bus/jetstream/natsfast.py) and its public twin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bus.jetstream import natsfast
from bus.local.server import NatsServer

ROOT = Path(__file__).resolve().parents[2]


def test_the_nats_py_internals_of_the_fast_lane_are_present() -> None:
    # a new nats-py release that moved one of them fails here, by name, instead of silently
    # in the recorder; until the adapter is updated the public path runs (FAST is False)
    changed = natsfast.internals_changed()
    assert changed is None, f"nats-py changed an internal the fast lane uses: {changed}"
    assert natsfast.FAST or os.environ.get("POOL_NATS_PUBLIC_ONLY") not in (None, "", "0")


def test_an_untested_nats_py_release_turns_the_fast_lane_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(natsfast, "version", lambda _name: "99.1.0")
    assert natsfast.internals_changed() == "nats-py 99.1 is not a tested release (2.16)"


def test_a_missing_client_internal_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import nats.aio.client

    real = nats.aio.client.Client.__init__

    def without_pending(self: nats.aio.client.Client) -> None:
        real(self)
        del self._pending

    monkeypatch.setattr(nats.aio.client.Client, "__init__", without_pending)
    assert natsfast.internals_changed() == "nats.aio.client.Client._pending"


@pytest.mark.parametrize("fast", [True, False], ids=["fast lane", "public path"])
def test_requests_sent_in_one_write_each_get_their_own_answer(
        fresh_nats: NatsServer, monkeypatch: pytest.MonkeyPatch, fast: bool) -> None:
    """Three requests in one call: two stored by a stream, each answered with its own
    sequence, in the order sent; one to a subject nobody answers gets no-responders."""
    import asyncio
    import json

    import nats
    import nats.errors

    if fast and not natsfast.FAST:
        pytest.skip("the fast lane is off in this run (POOL_NATS_PUBLIC_ONLY)")
    monkeypatch.setattr(natsfast, "FAST", fast)

    async def run() -> list[object]:
        nc = await nats.connect(fresh_nats.url)
        try:
            js = nc.jetstream()
            await js.add_stream(name="EACH", subjects=["each.>"])
            return await natsfast.request_each(nc, [
                ("each.a", b"1", "K: a\r\n"), ("nobody.home", b"2", ""),
                ("each.b", b"3", "K: b\r\n")], timeout=5)
        finally:
            await nc.close()

    first, nobody, last = asyncio.run(run())
    assert isinstance(nobody, nats.errors.NoRespondersError)
    acks = [json.loads(m.data) for m in (first, last)]  # type: ignore[attr-defined]
    assert [a["seq"] for a in acks] == [1, 2] and {a["stream"] for a in acks} == {"EACH"}


@pytest.mark.slow
def test_the_recorders_keep_their_contract_on_the_public_path(tmp_path: Path) -> None:
    env = {**os.environ, "POOL_NATS_PUBLIC_ONLY": "1"}
    # its own base temp: the inner session must not prune the outer sessions' directories
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"--basetemp={tmp_path / 'inner'}",
         "tests/contract/test_jetstream_recorder_contract.py",
         "tests/contract/test_jetstream_atomic.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
