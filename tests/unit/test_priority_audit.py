"""The priority audit alone: a placement that passed over a waiting higher class of the same
shape is named; aging, another shape, a too-recent request or an unpaid hold excuse it."""

from __future__ import annotations

from domain.resources import Resources
from projections.fair_share import Configured, Funds, Placed, Record, Requested
from projections.priority import check_priority

SHAPE = '{"resources": {"cpu_millis": 1000}}'
CLASSES = Configured({"low": 0, "high": 10}, 0.0)


def _story(*, wide: str = SHAPE, high_at: float = 0.0, aging: float = 0.0,
           extra: tuple[Record, ...] = ()) -> list[Record]:
    return [Configured(dict(CLASSES.ranks), aging), *extra,
            Requested("lo", "acme", SHAPE, 0.0, "low"),
            Requested("hi", "beta", wide, high_at, "high"),
            Placed("lo", Resources(cpu_millis=1000), 5.0)]


def test_a_lower_class_placed_past_a_waiting_higher_one_of_its_shape_is_named() -> None:
    report = check_priority(_story(), lag_seconds=1.0)
    assert report.placements == 1
    (line,) = report.violations
    assert line.startswith("lo (acme, class low, rank 0 aged) placed at 5.000 while hi (beta")


def test_a_placement_of_the_higher_class_first_is_sound() -> None:
    records = _story()[:-1] + [Placed("hi", Resources(cpu_millis=1000), 5.0),
                               Placed("lo", Resources(cpu_millis=1000), 6.0)]
    assert check_priority(records, lag_seconds=1.0).violations == []


def test_aging_backfill_lag_and_credits_excuse_a_lower_class() -> None:
    # aged: 5 s waited at one rank a 0.4 s lifts low past high's 10
    assert check_priority(_story(aging=0.4), lag_seconds=1.0).violations == []
    # another shape (it may not have fitted where the low one did: backfill)
    wide = '{"resources": {"cpu_millis": 9000}}'
    assert check_priority(_story(wide=wide), lag_seconds=1.0).violations == []
    # requested within the lag before the placement: the scheduler may not have seen it
    assert check_priority(_story(high_at=4.5), lag_seconds=1.0).violations == []
    # its tenant could not pay its hold
    broke = (Funds("beta", 0, 0.0),)
    assert check_priority(_story(extra=broke), lag_seconds=1.0,
                          holds={"hi": 5}).violations == []
    # a gang member's wait is its gang's
    assert check_priority(_story(), lag_seconds=1.0, exempt={"hi"}).violations == []
