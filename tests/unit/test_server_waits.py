"""The embedded nats-server's start and reload waits grow with its accounts' configuration
(ADR 028): a fleet of a few thousand real nodes must not time out where 1,000 took 5-9 s."""

from __future__ import annotations

from pathlib import Path

import pytest

from bus.local import server as srv
from bus.local.server import (
    RELOAD_SECONDS,
    START_SECONDS,
    NatsServer,
    config_bytes,
    wait_seconds,
)

MIB = 2**20


def test_the_waits_are_the_built_in_ones_for_a_small_configuration() -> None:
    assert wait_seconds(START_SECONDS, 0) == 15.0
    assert wait_seconds(RELOAD_SECONDS, 0) == 10.0
    assert wait_seconds(START_SECONDS, 64 * 1024) < 16  # a few tenants and nodes


def test_each_mib_of_configuration_adds_four_seconds() -> None:
    assert wait_seconds(RELOAD_SECONDS, 9 * MIB) == pytest.approx(10 + 36)
    assert wait_seconds(START_SECONDS, 2 * MIB) - wait_seconds(START_SECONDS, MIB) == \
        pytest.approx(4)
    # measured: 1,000 nodes and 10 tenants render 9 MB and took 5.5 s to start, 8.5 s to
    # reload; 3,000 such nodes (27 MB) are waited for four times as long as that rate
    assert wait_seconds(START_SECONDS, 27 * MIB) >= 4 * 27 * 8.5 / 9
    assert wait_seconds(RELOAD_SECONDS, 27 * MIB) >= 4 * 27 * 8.5 / 9


def test_the_configuration_s_size_counts_the_files_it_includes(tmp_path: Path) -> None:
    (tmp_path / "auth.conf").write_bytes(b"x" * 3 * MIB)
    conf = tmp_path / "pool.conf"
    conf.write_text('listen: "127.0.0.1:4222"\ninclude "auth.conf"\ninclude "gone.conf"\n')
    assert config_bytes(conf) == len(conf.read_bytes()) + 3 * MIB
    assert config_bytes(tmp_path / "none.conf") == 0


def test_a_start_and_a_reload_wait_as_long_as_their_configuration_needs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No timeout given: the server's start waits by its own configuration's size, and a
    reload by the configuration beside the server's log."""
    waited: list[float] = []
    monkeypatch.setattr(srv, "_wait_for_port", lambda _h, _p, _proc, t: waited.append(t))
    monkeypatch.setattr(srv.subprocess, "Popen", lambda *_a, **_k: None)
    (tmp_path / "auth.conf").write_bytes(b"x" * 5 * MIB)
    server = NatsServer(store_dir=tmp_path, port=4999, server_name="pool-w",
                        extra_config='include "auth.conf"')
    server.start()
    assert waited == [pytest.approx(START_SECONDS + 20, abs=0.1)]

    asked: list[tuple[float, int]] = []

    def recorded(base: float, size: int) -> float:
        asked.append((base, size))
        return wait_seconds(base, size)

    monkeypatch.setattr(srv, "wait_seconds", recorded)
    monkeypatch.setattr(srv.os, "kill", lambda *_a: None)
    server.log_path.unlink()  # no log: the signal alone, nothing waited
    srv.reload_server(1, server.log_path)
    assert asked == [(RELOAD_SECONDS, config_bytes(server.config_path))]
    assert asked[0][1] > 5 * MIB
