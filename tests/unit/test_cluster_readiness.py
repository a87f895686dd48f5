"""When a local NATS cluster counts as ready: the meta leader must list every running server.

The monitoring endpoints are answered here from fixed bodies; the servers themselves run in
tests/faults/test_cluster.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bus.local import cluster as cluster_module
from bus.local.cluster import NatsCluster


def _answering(monkeypatch: pytest.MonkeyPatch, c: NatsCluster,
               peers_seen_by_leader: list[str]) -> None:
    """Every server healthy, n1 the meta leader, listing `peers_seen_by_leader` as current."""
    names = [s.server_name for s in c.servers]
    by_port = {s.http_port: s.server_name for s in c.servers}

    def get_json(url: str, timeout: float = 1.0) -> tuple[int, dict[str, Any]]:
        port = int(url.split(":")[2].split("/")[0])
        if url.endswith("/healthz"):
            return 200, {"status": "ok"}
        me = by_port[port]
        seen = peers_seen_by_leader if me == names[0] else [n for n in names if n != me]
        return 200, {"meta_cluster": {"leader": names[0], "replicas": [
            {"name": n, "current": True} for n in seen if n != me]}}

    monkeypatch.setattr(cluster_module, "_get_json", get_json)
    monkeypatch.setattr(c, "running", lambda: list(range(len(c.servers))))


def test_a_leader_that_lists_every_server_is_ready(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = NatsCluster(tmp_path, nodes=3, cluster_name="ready")
    _answering(monkeypatch, c, ["ready-n2", "ready-n3"])
    assert c.healthy() == (True, "meta leader ready-n1")


def test_a_running_server_the_leader_does_not_list_yet_is_not_ready(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream at three replicas created then is refused ("no suitable peers")."""
    c = NatsCluster(tmp_path, nodes=3, cluster_name="early")
    _answering(monkeypatch, c, ["early-n2"])
    ok, why = c.healthy()
    assert not ok and "early-n3" in why and "peers" in why
