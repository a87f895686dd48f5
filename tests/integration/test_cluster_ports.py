"""A cluster whose chosen port another process takes before its server binds still starts:
the servers are given new ports (a CI run once failed on `address already in use`)."""

from __future__ import annotations

import socket
from pathlib import Path

from bus.local.cluster import NatsCluster


def test_a_cluster_starts_on_new_ports_when_one_was_taken(tmp_path: Path) -> None:
    cluster = NatsCluster(tmp_path / "cluster", nodes=3, cluster_name="ports-taken")
    taken = cluster.servers[1].cluster_port
    assert taken
    with socket.socket() as squatter:  # the race, won by someone else
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        with cluster:
            assert len(cluster.running()) == 3
            assert taken not in [s.cluster_port for s in cluster.servers]
