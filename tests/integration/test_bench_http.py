"""`pool bench http` runs both paths against one plane and reports each (figures not asserted:
they are the machine's)."""

from __future__ import annotations

from bench.http import run_http_bench


def test_the_http_bench_measures_both_paths_in_one_run() -> None:
    # half a second a path: hundreds of requests each on this machine, enough for a p99
    result = run_http_bench(quick=True, seconds=0.5)
    for path in ("nats", "http"):
        figures = result[path]
        assert figures["accepted"] > 0 and figures["errors"] == {}, (path, figures)
        assert figures["reply_p50_ms"] is not None
        assert figures["reply_p99_ms"] >= figures["reply_p50_ms"]
    assert "HTTP cost" in result["table"] and "machine:" in result["table"]
