"""When an agent's next heartbeat is due: a fixed rate that keeps each agent's phase."""

from __future__ import annotations

from agents.agent import next_beat


def test_a_beat_on_time_is_followed_one_interval_after_it_was_due() -> None:
    assert next_beat(100.0, 100.01, 10.0) == 110.0


def test_agents_held_up_together_do_not_beat_together_afterwards() -> None:
    # beats due at 100 and 103, both sent at 108 after a stall: their next ones keep apart
    assert (next_beat(100.0, 108.0, 10.0), next_beat(103.0, 108.0, 10.0)) == (110.0, 113.0)


def test_a_beat_late_by_a_whole_interval_starts_a_phase_of_its_own() -> None:
    got = {next_beat(100.0, 112.0, 10.0) for _ in range(200)}
    assert all(117.0 <= t <= 122.0 for t in got)
    assert len(got) > 100  # drawn, not one value for every agent that was held up


def test_the_next_beat_is_never_more_than_an_interval_away() -> None:
    assert next_beat(200.0, 100.0, 10.0) == 110.0  # a beat sent before it was due
    assert 1005.0 <= next_beat(0.0, 1000.0, 10.0) <= 1010.0  # the first beat
