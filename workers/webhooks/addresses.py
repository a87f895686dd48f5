"""Where the plane may POST: an endpoint's host is resolved and refused when any address is
loopback, private, link-local or otherwise not global, unless the operator allows its network."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit

from workers.errors import WebhookAddressRefused

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


AddressRefused = WebhookAddressRefused


def networks(text: str | Iterable[str]) -> tuple[Network, ...]:
    """CIDRs (or single addresses) from a comma list or an iterable; ValueError on a bad one."""
    items = text.split(",") if isinstance(text, str) else list(text)
    return tuple(ipaddress.ip_network(i.strip(), strict=False) for i in items if i.strip())


def _forbidden(ip: Address) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return _forbidden(ip.ipv4_mapped)
    return not ip.is_global or ip.is_multicast or ip.is_reserved or ip.is_unspecified


def resolve(url: str, allowed: Iterable[Network] = ()) -> tuple[str, int, list[str]]:
    """(host, port, addresses) of `url`, every address checked: AddressRefused when one is
    not global and no allowed network holds it, or when the host does not resolve."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise AddressRefused(f"{host!r} does not resolve: {e}") from None
    found = list(dict.fromkeys(str(info[4][0]) for info in infos))
    allow = tuple(allowed)
    for text in found:
        ip = ipaddress.ip_address(text.split("%")[0])
        if _forbidden(ip) and not any(ip in net for net in allow):
            raise AddressRefused(
                f"{host!r} resolves to {ip}, a loopback, private, link-local or reserved "
                "address: the plane does not POST there unless its operator allows it "
                "(POOL_WEBHOOK_ALLOW)")
    if not found:
        raise AddressRefused(f"{host!r} has no address")
    return host, port, found
