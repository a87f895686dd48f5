"""The rules of volumes without a server: a job names a pool's volume and a place in the
sandbox, the pool decides which of its nodes' trust levels may mount it."""

from __future__ import annotations

import pytest

from domain.errors import VolumeNotAllowed, VolumeUnknown
from domain.poolconfig import PoolConfig
from domain.volumes import Volume, admit_volumes, target_problem

OFFERED = (Volume("datasets", "/srv/datasets"),
           Volume("market", "/srv/m", read_only=False, trust_levels=("marketplace",)))


def test_a_volume_is_mounted_on_nodes_of_the_trust_levels_it_names() -> None:
    admit_volumes(OFFERED, [("datasets", "/data")], "trusted", pool_id="p1")
    admit_volumes(OFFERED, [("market", "/m")], "marketplace", pool_id="p1")
    with pytest.raises(VolumeNotAllowed) as e:
        admit_volumes(OFFERED, [("market", "/m")], "trusted", pool_id="p1")
    assert e.value.reasons == ("market",) and "marketplace" in e.value.message


def test_an_unknown_volume_is_refused_naming_it_and_what_the_pool_offers() -> None:
    with pytest.raises(VolumeUnknown) as e:
        admit_volumes(OFFERED, [("datasets", "/d"), ("nope", "/n")], "trusted", pool_id="p1")
    assert e.value.code == "volume_unknown" and e.value.reasons == ("nope",)
    assert "datasets, market" in e.value.message


@pytest.mark.parametrize("target", ["/", "data", "/data/../etc", "/usr/x", "/tmp", "/work/a",
                                    "/run/secrets", "/run", "/data//x", "/proc/1"])
def test_a_target_the_sandbox_provides_is_refused(target: str) -> None:
    assert target_problem(target) is not None


@pytest.mark.parametrize("target", ["/data", "/mnt/datasets", "/run/data", "/scratch/x"])
def test_a_target_of_its_own_is_taken(target: str) -> None:
    assert target_problem(target) is None


def test_a_pools_volumes_round_trip_and_a_pool_without_records_what_it_did() -> None:
    cfg = PoolConfig(volumes=OFFERED)
    assert PoolConfig.from_dict(cfg.to_dict()) == cfg
    assert "volumes" not in PoolConfig().to_dict()
    assert PoolConfig(volumes=(Volume("x", "relative/path"),)).problems()
