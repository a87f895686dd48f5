"""What a process without the views' database reports of the log (projections.metrics)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, generate_latest

from projections.metrics import LogHead, ViewsCollector, views_or_head


def _text(head: Callable[[], int | None]) -> str:
    registry = CollectorRegistry(auto_describe=False)
    collector = views_or_head(None, log_head=head)
    assert isinstance(collector, LogHead)
    registry.register(collector)
    return generate_latest(registry).decode()


def test_without_a_database_only_the_logs_head_is_reported() -> None:
    assert "pool_log_sequence 42.0" in _text(lambda: 42)


def test_a_bus_that_does_not_answer_reports_nothing_this_scrape() -> None:
    def away() -> int:
        raise TimeoutError("no bus")

    assert "pool_log_sequence" not in _text(away)
    assert "pool_log_sequence" not in _text(lambda: None)


def test_with_a_database_the_views_report_and_with_neither_nothing_does() -> None:
    assert isinstance(views_or_head("postgresql://nowhere/x", log_head=lambda: 1), ViewsCollector)
    assert views_or_head(None) is None
    assert views_or_head("") is None
