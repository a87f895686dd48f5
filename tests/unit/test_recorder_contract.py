"""The log's recorder is one contract (bus.recorders.LogRecorder): bus.jetstream's recorder
implements it, any other is given the plain path, and no product module asks a recorder what
it has (`getattr(recorder, "prefetch", None)` and the like), nor a fold what the checkpoint
needs of it (workers.scheduler.checkpoint.Checkpointed)."""

from __future__ import annotations

import inspect
import uuid
from pathlib import Path
from typing import Any

import pytest
from eventsourcing.persistence import IntegrityError, StoredEvent
from eventsourcing.popo import POPOApplicationRecorder

from bus.jetstream import JetStreamApplicationRecorder
from bus.recorders import LogRecorder, PlainLogRecorder, log_recorder
from bus.runtime import BusRuntime
from tests.probes import probes
from workers.scheduler.checkpoint import Checkpointed

ROOT = Path(__file__).resolve().parents[2]
# the product (tooling, bench/ chaos/ sim/, may do as it likes)
PRODUCT = ("domain", "schemas", "bus", "workers", "projections", "agents", "client", "cli",
           "local", "gateway", "computepool")
MEMBERS = frozenset(
    {n for n in vars(LogRecorder) if not n.startswith("_")} | set(LogRecorder.__annotations__))
METHODS = sorted(n for n in MEMBERS if callable(getattr(LogRecorder, n, None)))
# what a checkpointed fold gives (its `_lock` was asked for before `checkpoint_lock`)
FOLD_MEMBERS = frozenset({"checkpoint_state", "restore_checkpoint", "checkpoint_lock", "_lock"})


def _probes(source: str, where: str = "<string>") -> list[str]:
    """Each `getattr`/`hasattr` of a recorder, or of anything for one of the contracts'
    members, in `source`."""
    return probes(source, where, of_target=lambda text: text.endswith("recorder"),
                  members=MEMBERS | FOLD_MEMBERS)


def test_the_probe_check_sees_the_probing_it_forbids() -> None:
    probing = """
prefetch = getattr(recorder, "prefetch", None)
timeout = float(getattr(self.app.recorder, "timeout", 10.0))
watch = getattr(self.store.log_recorder, name)
ok = hasattr(rec, "read_records")
own = getattr(s, "checkpoint_state", None)
fine = getattr(lease, "gang", None)
"""
    assert len(_probes(probing)) == 5


def test_no_product_module_probes_a_recorder_or_a_fold_for_a_capability() -> None:
    found = [probe for package in PRODUCT for path in sorted((ROOT / package).rglob("*.py"))
             for probe in _probes(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, ("call the member of bus.recorders.LogRecorder or "
                       "workers.scheduler.checkpoint.Checkpointed:\n" + "\n".join(found))


def test_the_checkpointed_folds_are_the_contract() -> None:
    from workers.dispatcher import Dispatcher
    from workers.scheduler import Scheduler

    for fold in (Scheduler, Dispatcher):
        for name in ("checkpoint_state", "restore_checkpoint", "checkpoint_lock"):
            assert name in dir(fold) and name in dir(Checkpointed), (fold, name)


@pytest.fixture()
def jetstream_recorder() -> Any:
    runtime = BusRuntime("nats://127.0.0.1:1")  # never connected: nothing here asks the bus
    yield JetStreamApplicationRecorder(runtime, stream="POOL_EVENTS", kind="pool",
                                       tracking_owner="pool", timeout=3.0)
    runtime.close()


def test_the_jetstream_recorder_is_the_contract_as_it_is(jetstream_recorder: Any) -> None:
    assert isinstance(jetstream_recorder, LogRecorder)
    assert log_recorder(jetstream_recorder) is jetstream_recorder
    assert jetstream_recorder.reads_ahead and jetstream_recorder.awaits_on_loop
    assert jetstream_recorder.timeout == 3.0


@pytest.mark.parametrize("implementation", [JetStreamApplicationRecorder, PlainLogRecorder])
def test_each_implementation_takes_the_contracts_arguments(implementation: type) -> None:
    """Names and kinds of every method's parameters as the protocol has them (mypy checks the
    types in bus.recorders.log_recorder)."""
    for name in METHODS:
        want = inspect.signature(getattr(LogRecorder, name)).parameters
        got = inspect.signature(getattr(implementation, name)).parameters
        assert [(p.name, p.kind) for p in got.values()] == [
            (p.name, p.kind) for p in want.values()], name


def _stored(oid: uuid.UUID, version: int) -> StoredEvent:
    return StoredEvent(originator_id=oid, originator_version=version,
                       topic="tests:Thing.Happened", state=b"{}")


def test_any_other_recorder_is_given_the_plain_path() -> None:
    popo = POPOApplicationRecorder()
    assert not isinstance(popo, LogRecorder)
    plain = log_recorder(popo)
    assert isinstance(plain, PlainLogRecorder) and isinstance(plain, LogRecorder)
    assert log_recorder(plain) is plain
    assert not plain.reads_ahead and not plain.awaits_on_loop and plain.timeout == 10.0
    a, b = uuid.uuid4(), uuid.uuid4()
    assert plain.insert_events_nowait([_stored(a, 1), _stored(b, 1)]).result(0) == [1, 2]
    refused = plain.insert_events_nowait([_stored(a, 1)])  # a version taken: the save's error
    assert isinstance(refused.exception(0), IntegrityError)
    plain.insert_events([_stored(a, n) for n in range(2, 6)])
    # exact pages, read now; as bare records, page after page to `stop`
    assert [n.id for n in plain.prefetch(2, 3).result(0)] == [2, 3, 4]
    assert [n.id for n in plain.prefetch(5, 9, stop=5).result(0)] == [5]
    assert [[r[0] for r in page] for page in plain.read_records(2, 5, page_size=2)] == [
        [2, 3], [4, 5]]
    assert next(r for page in plain.read_records(1) for r in page) == (
        1, str(a), True, 1, "tests:Thing.Happened", b"{}")
    # what it cannot do it says, or does nothing
    assert plain.watch_appends(a, lambda: None) is None
    assert plain.last_topics([a]) is None
    plain.watch(lambda: None)()
    plain.forget(a)
    plain.remember_ends({a: (5, 6)})
    assert plain.max_notification_id() == 6
