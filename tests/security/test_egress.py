"""A sandbox with egress reaches the internet but not private ranges, link-local (the cloud
metadata address) or the host's own addresses. The "internet" and the private hosts are test
hosts of this test's own (tests/security/testhosts.py)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from agents.runtimes.contract import WorkloadError, WorkloadSpec
from agents.runtimes.egress import allowed, ruleset
from agents.runtimes.process import ProcessRuntime
from tests.security.testhosts import PORT, Hosts, egress_hosts

if ProcessRuntime(Path("/tmp")).available() is not None:
    pytest.skip("process runtime unavailable (bubblewrap)", allow_module_level=True)


@pytest.fixture()
def hosts() -> Iterator[Hosts]:
    with egress_hosts() as found:
        yield found


def _reach(tmp_path: Path, targets: list[tuple[str, int]], allow: tuple[str, ...] = ()) -> str:
    rt = ProcessRuntime(tmp_path / "state")
    if rt.network_egress() == "none":
        pytest.skip(f"no egress from the sandbox here: {rt.limitations()}")
    script = (
        "import os, socket\n"
        "out = open(os.environ['POOL_CHECKPOINT_DIR'] + '/net', 'w')\n"
        f"for host, port in {targets!r}:\n"
        "    try:\n"
        "        c = socket.create_connection((host, port), timeout=3)\n"
        "        out.write(('REACHED ' if c.recv(6) == b'hello\\n' else 'silent ') + host + '\\n')\n"
        "        c.close()\n"
        "    except OSError as e:\n"
        "        out.write('refused ' + host + ' ' + type(e).__name__ + '\\n')\n"
    )
    checkpoint = tmp_path / "ck"
    spec = WorkloadSpec(lease_id=f"l{uuid.uuid4().hex[:12]}", epoch=1, job_number=1,
                        command=("python3", "-c", script), memory_mib=64,
                        checkpoint_dir=str(checkpoint), network_egress="open",
                        egress_allow=allow)
    h = rt.start(spec)
    try:
        deadline = time.monotonic() + 30
        while rt.poll(h) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rt.poll(h) == 0, rt.read_output(h, 0, 4096)
    finally:
        rt.stop(h, 0)
        rt.forget(h)
    return (checkpoint / "net").read_text()


def test_egress_reaches_a_public_host_but_no_private_link_local_or_own_address(
        hosts: Hosts, tmp_path: Path) -> None:
    seen = _reach(tmp_path, [(hosts.public, PORT), (hosts.private, PORT),
                             (hosts.link_local, PORT), (hosts.own, hosts.own_port)])
    assert f"REACHED {hosts.public}\n" in seen, seen  # the egress works
    for denied in (hosts.private, hosts.link_local, hosts.own):
        assert f"refused {denied} " in seen, seen


def test_the_pools_allow_list_opens_a_private_network_and_nothing_else(
        hosts: Hosts, tmp_path: Path) -> None:
    seen = _reach(tmp_path, [(hosts.private, PORT), (hosts.link_local, PORT)],
                  allow=(f"{hosts.private}/32",))
    assert f"REACHED {hosts.private}\n" in seen, seen
    assert f"refused {hosts.link_local} " in seen, seen


def test_an_allow_list_that_is_not_ipv4_networks_is_refused() -> None:
    assert allowed(["10.9.0.0/16"], ("192.168.4.7", "10.9.0.0/16")) == \
        ["10.9.0.0/16", "192.168.4.7/32"]
    for bad in ("10.0.0.0/33", "fd00::/8", "metadata"):
        with pytest.raises(WorkloadError) as e:
            allowed([], (bad,))
        assert e.value.code == "egress_allow_invalid"


def test_the_filter_refuses_the_metadata_address_and_keeps_the_resolver() -> None:
    rules = ruleset(["192.0.2.7", "127.0.0.1"], ["10.9.0.0/16"])
    lines = rules.splitlines()
    assert "-A OUTPUT -d 169.254.0.0/16 -j REJECT --reject-with icmp-admin-prohibited" in lines
    assert "-A OUTPUT -d 192.0.2.7/32 -j REJECT --reject-with icmp-admin-prohibited" in lines
    # an operator's exception comes before the ranges it cuts out of; the resolver too
    assert lines.index("-A OUTPUT -d 10.9.0.0/16 -j ACCEPT") < \
        lines.index("-A OUTPUT -d 10.0.0.0/8 -j REJECT --reject-with icmp-admin-prohibited")
    assert "-A OUTPUT -d 10.0.2.3/32 -p udp --dport 53 -j ACCEPT" in lines
    assert not any("127.0.0.1/32" in line for line in lines)  # loopback: the sandbox's own


def test_a_bad_allow_list_gives_no_egress_at_all(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POOL_EGRESS_ALLOW", "10.0.0.0/8,not-a-network")
    rt = ProcessRuntime(tmp_path / "state")
    assert rt.network_egress() == "none"
    assert any("POOL_EGRESS_ALLOW" in line for line in rt.limitations())
    spec = WorkloadSpec(lease_id="l1", epoch=1, job_number=1, command=("true",),
                        network_egress="open")
    with pytest.raises(WorkloadError) as e:
        rt.start(spec)
    assert e.value.code == "egress_unavailable"
