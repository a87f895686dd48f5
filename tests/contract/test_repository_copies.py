"""A cached aggregate is copied for a command while other threads fast-forward it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from uuid import UUID

import pytest
from eventsourcing.domain import Aggregate, event

from bus.local.server import NatsServer
from bus.runtime import close_runtime
from workers.application.core import Store


class Ledger(Aggregate):
    @event("Opened")
    def __init__(self) -> None:
        self.entries: dict[str, int] = {f"e{i}": i for i in range(20_000)}

    @event("Added")
    def add(self, key: str) -> None:
        self.entries[key] = len(self.entries)


class Ledgers(Store):
    pass


@pytest.fixture()
def apps(fresh_nats: NatsServer) -> Iterator[tuple[Ledgers, Ledgers]]:
    env = {"PERSISTENCE_MODULE": "bus.jetstream", "NATS_URL": fresh_nats.url,
           "NATS_STREAM": "COPY_T", "AGGREGATE_CACHE_MAXSIZE": "10"}
    reader, writer = Ledgers(env=env), Ledgers(env=env)
    yield reader, writer
    reader.close()
    writer.close()
    close_runtime(fresh_nats.url)


def test_loads_that_copy_a_cached_aggregate_while_others_fast_forward_it_all_succeed(
    apps: tuple[Ledgers, Ledgers],
) -> None:
    reader, writer = apps
    ledger = Ledger()
    writer.save(ledger)
    uid: UUID = ledger.id
    reader.repository.get(uid)  # cached in the reader
    errors: list[BaseException] = []
    stop = threading.Event()

    def write() -> None:
        i = 0
        while not stop.is_set():
            copy: Ledger = writer.repository.get(uid)
            for _ in range(20):
                copy.add(f"k{i}")
                i += 1
            writer.save(copy)

    def load() -> None:
        try:
            for _ in range(25):
                reader.repository.get(uid)
        except BaseException as e:  # noqa: BLE001 - what the test counts
            errors.append(e)

    w = threading.Thread(target=write)
    w.start()
    loaders = [threading.Thread(target=load) for _ in range(4)]
    for t in loaders:
        t.start()
    for t in loaders:
        t.join()
    stop.set()
    w.join()
    assert errors == []
    assert len(reader.repository.get(uid).entries) == len(writer.repository.get(uid).entries)
