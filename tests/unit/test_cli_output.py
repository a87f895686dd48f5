"""How the `pool` command shows values to people: shapes, credits, times (`--json` keeps the
raw values)."""

from __future__ import annotations

from cli.output import ago, credits_text, shape_text, value_text


def test_a_shape_reads_as_people_say_it() -> None:
    assert shape_text({"cpu_millis": 8000, "memory_mib": 32768, "gpu_count": 1,
                       "gpu_model": "a100", "gpu_memory_gib_min": 40}) \
        == "8 CPU · 32 GiB · 1×A100-40GB"
    assert shape_text({"cpu_millis": 500, "memory_mib": 256}) == "0.5 CPU · 256 MiB"
    assert shape_text({"cpu_millis": 1000, "memory_mib": 1536, "gpu_count": 2,
                       "gpu_partition": "1g.10gb"}) == "1 CPU · 1.5 GiB · 2×1G.10GB"
    # as the views store it: amounts under `resources`
    assert shape_text({"resources": {"cpu_millis": 1000, "memory_mib": 512, "gpu_count": 0},
                       "gpu_partition": "none", "gpu_model": None}) == "1 CPU · 512 MiB"


def test_credits_have_thousands_separators() -> None:
    assert credits_text(1_000_000_000) == "1,000,000,000"
    assert value_text("available_microcredits", 53760) == "53,760"


def test_times_say_how_long_ago_or_until() -> None:
    assert ago(1000.0, 1190.0) == "3m ago"
    assert ago(1000.0 + 7300, 1000.0) == "in 2h"
    assert ago(1000.0, 1000.2) == "now"
    assert value_text("started_at", 0.0).endswith("ago)")
    assert value_text("exit_code", 3) == "3" and value_text("end_reason", None) == "-"
