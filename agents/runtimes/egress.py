"""What a sandbox with egress may not reach: private ranges, link-local (the cloud metadata
address among them) and the host's own addresses, refused by a packet filter in the sandbox's
own network namespace before the job runs (docs/adr/009-sandbox-egress-and-limits.md).
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess

from agents.runtimes.contract import WorkloadError

# never reached from a sandbox, whatever the job asks: RFC 1918, shared (CGNAT), loopback,
# link-local (169.254.169.254: a cloud's metadata service), "this network", IETF protocol
# assignments, benchmarking, multicast and reserved
DENIED_RANGES: tuple[str, ...] = (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
    "172.16.0.0/12", "192.0.0.0/24", "192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/4",
    "240.0.0.0/4",
)
# slirp4netns's resolver inside the sandbox's network (it forwards to the host's)
SLIRP_DNS = "10.0.2.3"
ALLOW_ENV = "POOL_EGRESS_ALLOW"  # the node operator's own exceptions: CIDRs, comma-separated
_TIMEOUT_S = 10.0


def available() -> str | None:
    """The iptables-restore binary that installs the filter, or None (then no egress)."""
    return shutil.which("iptables-restore")


def host_addresses() -> list[str]:
    """This host's own IPv4 addresses now (the sandbox's traffic leaves from the host's
    network stack: each of them would be reachable as a neighbour)."""
    ip = shutil.which("ip")
    if ip is None:
        return []
    try:
        out = subprocess.run([ip, "-j", "-4", "addr", "show"], capture_output=True,
                             timeout=5, check=True).stdout
        links = json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError):
        return []
    found = []
    for link in links:
        for a in link.get("addr_info") or ():
            local = a.get("local")
            if a.get("family") == "inet" and isinstance(local, str):
                found.append(local)
    return found


def allowed_by_operator() -> list[str]:
    """The CIDRs in POOL_EGRESS_ALLOW (bad ones raise ValueError: the agent must not start)."""
    text = os.environ.get(ALLOW_ENV, "")
    return [str(ipaddress.ip_network(c.strip(), strict=False))
            for c in text.split(",") if c.strip()]


def allowed(node: list[str], pool: tuple[str, ...]) -> list[str]:
    """The node operator's CIDRs and a job's pool's, each an IPv4 network (the filter is
    IPv4's); WorkloadError egress_allow_invalid for any other, so nothing is opened by a
    typo."""
    out = list(node)
    for text in pool:
        try:
            net = ipaddress.ip_network(text.strip(), strict=False)
        except ValueError as e:
            raise WorkloadError(f"the pool's egress allow-list holds {text[:64]!r}: {e}",
                                code="egress_allow_invalid") from e
        if net.version != 4:
            raise WorkloadError(f"the pool's egress allow-list holds {text[:64]!r}: only IPv4 "
                                "networks can be allowed", code="egress_allow_invalid")
        if str(net) not in out:
            out.append(str(net))
    return out


def ruleset(hosts: list[str], allow: list[str]) -> str:
    """iptables-restore input for the sandbox's namespace: its loopback and slirp's resolver
    allowed, the operator's CIDRs allowed, every denied range and host address refused."""
    lines = ["*filter", ":INPUT ACCEPT [0:0]", ":FORWARD DROP [0:0]", ":OUTPUT ACCEPT [0:0]",
             "-A OUTPUT -o lo -j ACCEPT",
             f"-A OUTPUT -d {SLIRP_DNS}/32 -p udp --dport 53 -j ACCEPT",
             f"-A OUTPUT -d {SLIRP_DNS}/32 -p tcp --dport 53 -j ACCEPT"]
    lines += [f"-A OUTPUT -d {cidr} -j ACCEPT" for cidr in allow]
    denied = list(DENIED_RANGES) + [f"{h}/32" for h in hosts
                                    if not ipaddress.ip_address(h).is_loopback]
    lines += [f"-A OUTPUT -d {cidr} -j REJECT --reject-with icmp-admin-prohibited"
              for cidr in denied]
    lines.append("COMMIT")
    return "\n".join(lines) + "\n"


def install(restore: str, pid: int, rules: str) -> None:
    """Load `rules` into the network namespace of `pid` (the sandbox's supervisor, not yet
    letting the job run). Raises WorkloadError (egress_failed) when it cannot."""
    nsenter = shutil.which("nsenter") or "nsenter"
    try:
        r = subprocess.run([nsenter, f"--net=/proc/{pid}/ns/net", restore, "-w"],
                           input=rules.encode(), capture_output=True, timeout=_TIMEOUT_S,
                           check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise WorkloadError(f"could not filter the sandbox's egress: {e}",
                            code="egress_failed") from e
    if r.returncode != 0:
        raise WorkloadError("could not filter the sandbox's egress: "
                            + r.stderr.decode(errors="replace").strip()[:300],
                            code="egress_failed")
