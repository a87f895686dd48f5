"""Leader election on JetStream KV against a real nats-server (one per test, ttl ~1 s)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

import nats
import pytest

from bus.leader import LeaderBucketMismatch, LeaderElection
from bus.local.server import NatsServer
from bus.runtime import BusRuntime

TTL = 1.0


@pytest.fixture()
def runtimes(fresh_nats: NatsServer) -> Iterator[Callable[[], BusRuntime]]:
    """A factory of independent runtimes (one connection each, as separate processes would have)."""
    made: list[BusRuntime] = []

    def make() -> BusRuntime:
        rt = BusRuntime(fresh_nats.url)
        made.append(rt)
        return rt

    yield make
    for rt in made:
        rt.close()
        _finish_loop(rt.loop)


def _finish_loop(loop: asyncio.AbstractEventLoop) -> None:
    """BusRuntime.close stops its loop with nats-py's subscription tasks still pending; finish
    them here so a garbage-collected loop does not warn in some later test."""
    if loop.is_running() or loop.is_closed():
        return
    pending = asyncio.all_tasks(loop)
    for t in pending:
        t.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


def candidate(
    make: Callable[[], BusRuntime], holder: str, ttl: float = TTL, bucket: str = "pool_leaders"
) -> LeaderElection:
    return LeaderElection(make(), name="pool-a", holder_id=holder, ttl_seconds=ttl, bucket=bucket)


def wait_for(pred: Callable[[], bool], timeout: float, step: float = 0.01) -> float:
    """Seconds until pred() held; fails the test after `timeout`."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"condition not met within {timeout}s")
        time.sleep(step)
    return time.monotonic() - t0


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[bool, float]] = []
        self.lock = threading.Lock()

    def __call__(self, leading: bool) -> None:
        with self.lock:
            self.events.append((leading, time.monotonic()))

    @property
    def states(self) -> list[bool]:
        with self.lock:
            return [e[0] for e in self.events]


def rival_put(url: str, bucket: str, key: str, value: bytes) -> None:
    """Overwrite the key behind the holder's back (a writer the CAS must detect)."""

    async def go() -> None:
        nc = await nats.connect(url)
        kv = await nc.jetstream().key_value(bucket)
        await kv.put(key, value)
        await nc.close()

    asyncio.run(go())


def test_only_one_of_two_leads(runtimes: Callable[[], BusRuntime]) -> None:
    a, b = candidate(runtimes, "a"), candidate(runtimes, "b")
    assert a.try_acquire() is True
    assert b.try_acquire() is False
    assert a.is_leader and not b.is_leader
    assert isinstance(a.epoch, int) and b.epoch is None
    rec = a.current_leader()
    assert rec is not None and rec["holder"] == "a" and rec["epoch"] == a.epoch
    # renewals keep the lease (and the epoch) well past one TTL; the standby keeps losing
    epoch = a.epoch
    for _ in range(4):  # > one TTL in all
        time.sleep(TTL / 3)
        assert a.try_acquire() is True
        assert b.try_acquire() is False
    assert a.epoch == epoch and not b.is_leader


def test_standby_takes_over_when_leader_dies(runtimes: Callable[[], BusRuntime]) -> None:
    a, b = candidate(runtimes, "a"), candidate(runtimes, "b")
    ra, rb = Recorder(), Recorder()
    a.start(ra)
    wait_for(lambda: a.is_leader, 2.0)
    b.start(rb)
    time.sleep(TTL / 2)
    assert not b.is_leader
    old_epoch = a.epoch
    assert old_epoch is not None

    a.stop()  # dies: no release, the key is left to expire
    t_dead = time.monotonic()
    assert not a.is_leader and ra.states == [True, False]
    took = wait_for(lambda: b.is_leader, 2 * TTL + 0.5)
    print(f"\ntakeover after leader death: {took:.3f}s (ttl {TTL}s)")
    assert took < 2 * TTL
    assert b.epoch is not None and b.epoch > old_epoch
    wait_for(lambda: bool(rb.states), 0.5)  # the keeper reports just after is_leader flips
    assert rb.states == [True] and rb.events[0][1] - t_dead < 2 * TTL
    b.stop(release=True)


def test_observed_staleness_when_bucket_ttl_is_longer(runtimes: Callable[[], BusRuntime]) -> None:
    """The bucket keeps keys for 30 s; standbys still take over once the holder's TTL has passed
    without renewals -- judged by the holder's declared TTL when it is longer than theirs."""
    candidate(runtimes, "setup", ttl=30.0, bucket="long_leaders").current_leader()  # makes bucket
    old = candidate(runtimes, "old", ttl=2 * TTL, bucket="long_leaders")
    assert old.try_acquire() is True  # then dies at once (never renews); its TTL is 2 s
    t_dead = time.monotonic()
    a = candidate(runtimes, "a", bucket="long_leaders")
    b = candidate(runtimes, "b", bucket="long_leaders")
    a.start()
    b.start()
    time.sleep(1.4 * TTL)
    assert not a.is_leader and not b.is_leader  # old's 2 s lease is respected despite their 1 s
    wait_for(lambda: a.is_leader or b.is_leader, 3 * TTL)
    took = time.monotonic() - t_dead
    assert 2 * TTL <= took < 2 * TTL + 1.0
    time.sleep(TTL / 2)
    assert a.is_leader != b.is_leader
    leader, standby = (a, b) if a.is_leader else (b, a)
    leader.stop()  # dies
    took = wait_for(lambda: standby.is_leader, 3 * TTL)
    print(f"\ntakeover by observed staleness (bucket max_age 30 s): {took:.3f}s")
    assert took < 2 * TTL
    standby.stop(release=True)


def test_bucket_with_shorter_ttl_is_refused(runtimes: Callable[[], BusRuntime]) -> None:
    assert candidate(runtimes, "a", ttl=TTL).try_acquire() is True
    with pytest.raises(LeaderBucketMismatch):
        candidate(runtimes, "b", ttl=3 * TTL).try_acquire()
    # same TTL: the bucket is reused idempotently
    assert candidate(runtimes, "c", ttl=TTL).try_acquire() is False


def test_clean_release_hands_over_at_once(runtimes: Callable[[], BusRuntime]) -> None:
    a, b = candidate(runtimes, "a"), candidate(runtimes, "b")
    a.start()
    wait_for(lambda: a.is_leader, 2.0)
    b.start()
    time.sleep(TTL / 2)
    assert not b.is_leader
    old_epoch = a.epoch
    assert old_epoch is not None
    t0 = time.monotonic()
    a.stop(release=True)
    took = wait_for(lambda: b.is_leader, 2 * TTL)
    print(f"\nhandover after clean release: {took:.3f}s")
    assert took < TTL * 0.75  # one keeper interval (ttl/3) plus slack, long before any expiry
    assert time.monotonic() - t0 < TTL
    assert b.epoch is not None and b.epoch > old_epoch
    # a direct try_acquire after release also works immediately (no keeper involved)
    b.stop(release=True)
    assert a.try_acquire() is True
    assert a.release() is True
    assert a.release() is False  # nothing left to release


def test_release_does_not_delete_someone_elses_key(runtimes: Callable[[], BusRuntime]) -> None:
    a, b = candidate(runtimes, "a"), candidate(runtimes, "b")
    assert a.try_acquire()
    a._deadline += 100  # a stalled holder that still believes it leads
    time.sleep(TTL + 0.6)  # its key expires on the server
    assert b.try_acquire() is True
    assert a.release() is False  # revision check: b's key survives
    assert b.try_acquire() is True and b.current_leader()["holder"] == "b"  # type: ignore[index]


def test_stale_holder_whose_cas_fails_steps_down(
    runtimes: Callable[[], BusRuntime], fresh_nats: NatsServer
) -> None:
    a, b = candidate(runtimes, "a"), candidate(runtimes, "b")
    # (1) a paused holder: its key expired, b took over, a wakes up and renews
    assert a.try_acquire()
    a._deadline += 100  # simulate a process paused past its lease that still believes it leads
    time.sleep(TTL + 0.6)
    assert b.try_acquire() is True
    assert a.is_leader  # (its local belief)
    assert a.try_acquire() is False  # CAS against its old revision fails
    assert not a.is_leader and a.epoch is None
    assert b.is_leader
    b.release()

    # (2) with the keeper: someone else writes the key; the keeper's next renewal loses the CAS
    ra = Recorder()
    a.start(ra)
    wait_for(lambda: a.is_leader, 2.0)
    rival_put(fresh_nats.url, "pool_leaders", "pool-a", b'{"holder": "rival"}')
    t0 = time.monotonic()
    wait_for(lambda: False in ra.states, 2 * TTL)
    assert time.monotonic() - t0 < TTL / 3 + 0.3  # at the next renewal
    assert not a.is_leader
    assert ra.states[:2] == [True, False]
    a.stop()


def test_leader_steps_down_when_server_unreachable(
    runtimes: Callable[[], BusRuntime], fresh_nats: NatsServer
) -> None:
    a = candidate(runtimes, "a")
    ra = Recorder()
    a.start(ra)
    wait_for(lambda: a.is_leader, 2.0)
    time.sleep(0.1)
    fresh_nats.kill()
    t_kill = time.monotonic()
    wait_for(lambda: not a.is_leader, 2 * TTL)
    stepped = time.monotonic() - t_kill
    assert stepped <= TTL + 0.05  # never beyond the lease's deadline
    wait_for(lambda: False in ra.states, 0.5)
    print(f"\nstep-down with server gone: {stepped:.3f}s (ttl {TTL}s)")
    fresh_nats.start()  # back, so the connections close quickly
    a.stop()


def test_concurrent_candidates_yield_exactly_one_leader(runtimes: Callable[[], BusRuntime]) -> None:
    cands = [candidate(runtimes, f"c{i}") for i in range(5)]
    for c in cands:  # connect and open the bucket first, so the race is on the key itself
        c.current_leader()
    for round_ in range(3):
        barrier = threading.Barrier(len(cands))
        results: dict[str, bool] = {}

        def race(c: LeaderElection, barrier: threading.Barrier, results: dict[str, bool]) -> None:
            barrier.wait()
            results[c.holder_id] = c.try_acquire()

        threads = [threading.Thread(target=race, args=(c, barrier, results)) for c in cands]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        winners = [h for h, won in results.items() if won]
        assert len(results) == 5 and len(winners) == 1, (round_, results)
        assert sum(c.is_leader for c in cands) == 1
        winner = next(c for c in cands if c.is_leader)
        assert winner.current_leader()["holder"] == winner.holder_id  # type: ignore[index]
        assert winner.release() is True


def test_concurrent_candidates_from_a_cold_start(runtimes: Callable[[], BusRuntime]) -> None:
    """Bucket creation races too: 5 fresh candidates, no bucket yet, exactly one leader."""
    cands = [candidate(runtimes, f"c{i}") for i in range(5)]
    barrier = threading.Barrier(len(cands))
    results: dict[str, bool] = {}

    def race(c: LeaderElection) -> None:
        barrier.wait()
        results[c.holder_id] = c.try_acquire()

    threads = [threading.Thread(target=race, args=(c,)) for c in cands]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(results) == 5 and sum(results.values()) == 1, results
