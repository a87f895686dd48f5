"""A docker job's network: a bridge of its own per workload, never the engine's default one,
and the host's packet filter keeping it off private, link-local and the host's own addresses.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

import docker
import docker.errors
import requests.exceptions

from agents.runtimes import egress
from agents.runtimes.contract import WorkloadError

_TIMEOUT_S = 10.0
# the engine's own chain for its users' rules, consulted first on every forwarded packet
# (the engine re-links it on its restarts and never empties it)
FORWARD_CHAIN = "DOCKER-USER"
_REJECT = "-j REJECT --reject-with icmp-admin-prohibited"


@dataclass(frozen=True)
class Net:
    """One workload's network: its engine name, its bridge and the filter's two chains."""

    name: str

    @property
    def _tag(self) -> str:
        return hashlib.sha256(self.name.encode()).hexdigest()[:12]

    @property
    def bridge(self) -> str:
        """The bridge's interface name, chosen here (≤ 15 characters) so that the filter is in
        place before the engine creates the bridge: no packet of it ever goes unfiltered."""
        return f"cp{self._tag}"

    @property
    def forward_chain(self) -> str:
        return f"CPO-{self._tag}"

    @property
    def input_chain(self) -> str:
        return f"CPI-{self._tag}"


def ruleset(net: Net, allow: list[str]) -> str:
    """iptables-restore input (with --noflush) for the host: forwarded packets from the bridge
    to a denied range are refused (other tenants' bridges lie in private ranges too), and
    every packet from it to the host itself is (each of its addresses, the bridge's own
    gateway among them: its services are not the job's); the operator's CIDRs are let by."""
    i, o, br = net.input_chain, net.forward_chain, net.bridge
    # the replies of the host's own connections to the job (the test's, an operator's) pass
    lines = ["*filter", f":{o} - [0:0]", f":{i} - [0:0]",
             f"-A {i} -m conntrack --ctstate ESTABLISHED,RELATED -j RETURN"]
    for chain in (o, i):
        lines += [f"-A {chain} -d {cidr} -j RETURN" for cidr in allow]
    lines += [f"-A {o} -d {cidr} {_REJECT}" for cidr in egress.DENIED_RANGES]
    lines += [f"-A {i} {_REJECT}",
              f"-I {FORWARD_CHAIN} -i {br} -j {o}", f"-I INPUT -i {br} -j {i}", "COMMIT"]
    return "\n".join(lines) + "\n"


class Filter:
    """The host's packet filter, through the same iptables the engine uses."""

    def __init__(self) -> None:
        self.iptables = shutil.which("iptables")
        self.restore = shutil.which("iptables-restore")

    def unavailable(self) -> str | None:
        """None when a network's filter can be installed here, else why not."""
        if self.iptables is None or self.restore is None:
            return "no iptables on this host to filter docker jobs' egress"
        r = self._run([self.iptables, "-w", "-n", "-L", FORWARD_CHAIN])
        if r is None or r.returncode != 0:
            return f"no {FORWARD_CHAIN} chain of the engine's in the host's filter"
        return None

    def install(self, net: Net, allow: list[str]) -> None:
        """Load the network's chains; WorkloadError egress_failed when it cannot."""
        assert self.restore is not None
        if self._exists(net.forward_chain) or self._exists(net.input_chain):
            self.remove(net)  # a leftover of a start that died half-way
        r = self._run([self.restore, "-w", "--noflush"], ruleset(net, allow))
        if r is None or r.returncode != 0:
            why = r.stderr.decode(errors="replace").strip()[:300] if r is not None else "timeout"
            raise WorkloadError(f"could not filter the job's network: {why}",
                                code="egress_failed")

    def _exists(self, chain: str) -> bool:
        assert self.iptables is not None
        r = self._run([self.iptables, "-w", "-n", "-L", chain])
        return r is None or r.returncode == 0  # not known: taken as there

    def remove(self, net: Net) -> None:
        """Unlink and drop the network's chains; what is not there is left alone."""
        if self.iptables is None:
            return
        for parent, chain in ((FORWARD_CHAIN, net.forward_chain), ("INPUT", net.input_chain)):
            for _ in range(8):  # one link each, but a crash between installs may leave two
                r = self._run([self.iptables, "-w", "-D", parent, "-i", net.bridge, "-j", chain])
                if r is None or r.returncode != 0:
                    break
            self._run([self.iptables, "-w", "-F", chain])
            self._run([self.iptables, "-w", "-X", chain])

    @staticmethod
    def _run(argv: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[bytes] | None:
        try:
            return subprocess.run(argv, input=stdin.encode() if stdin is not None else None,
                                  capture_output=True, timeout=_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None


class Networks:
    """Creates and removes the per-workload networks on the engine, with their filters."""

    def __init__(self, client: docker.DockerClient, mine: list[str],
                 filter_: Filter | None = None) -> None:
        self.client = client
        self.mine = mine  # label filters naming this runtime's networks (and no other's)
        self.filter = filter_ or Filter()

    def create(self, name: str, labels: dict[str, str], allow: list[str]) -> Net:
        """The filter first, then the bridge it names; WorkloadError egress_failed."""
        net = Net(name)
        self.filter.install(net, allow)
        try:
            self.client.networks.create(
                name, driver="bridge", check_duplicate=True,
                labels=labels,
                options={"com.docker.network.bridge.name": net.bridge,
                         "com.docker.network.bridge.enable_icc": "false"})
        except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
            self.filter.remove(net)
            if isinstance(e, docker.errors.APIError) and e.status_code == 409:
                raise WorkloadError(f"network {name} exists already",
                                    code="already_started") from e
            raise WorkloadError(f"could not create the job's network: {e}",
                                code="egress_failed") from e
        return net

    def remove(self, name: str) -> None:
        """The network (once no container is on it) and its filter."""
        try:
            self.client.networks.get(name).remove()
        except docker.errors.NotFound:
            pass
        except (docker.errors.DockerException, requests.exceptions.RequestException):
            return  # in use or the engine is away: the next sweep tries again
        self.filter.remove(Net(name))

    def sweep(self, keep: set[str]) -> None:
        """Remove this node's networks no kept workload uses (an agent died in between)."""
        try:
            found: list[Any] = self.client.networks.list(filters={"label": self.mine})
        except (docker.errors.DockerException, requests.exceptions.RequestException):
            return
        for network in found:
            if network.name not in keep:
                self.remove(str(network.name))
