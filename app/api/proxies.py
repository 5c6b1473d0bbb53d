"""Which connections are a trusted proxy's: the HTTP protocol never pauses those after a
refusal (`api/shedding_protocol.py`), as they carry other clients' requests too. Pure."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence

# Headers a proxy adds (the shipped Envoy adds x-forwarded-for and x-envoy-*).
_PROXY_HEADERS = frozenset({b"forwarded", b"via", b"x-forwarded-for", b"x-forwarded-proto"})

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def trusted_networks(addresses: Iterable[str]) -> tuple[Network, ...]:
    """`STEADY_TRUSTED_PROXIES` (addresses or CIDR blocks, already validated by `Settings`)
    as networks; a bare address is a network of one."""
    return tuple(ipaddress.ip_network(address) for address in addresses)


def came_through_a_proxy(
    peer: str | None, headers: Sequence[tuple[bytes, bytes]], trusted: Sequence[Network]
) -> bool:
    """Whether a request arrived through a proxy: its connection comes from a trusted
    proxy's address (`peer`: the socket's, None for a Unix socket) and it carries a header a
    proxy adds. A proxy's upstream connection carries many clients' requests one after
    another, so it is never paused: a refusal must not stall the next client's request; the
    proxy sheds its own clients (Envoy's circuit breakers, deploy/envoy). The headers alone
    prove nothing: any client can send `Via:` to dodge the pause. Pure; any thread."""
    if not trusted or peer is None:
        return False
    if not any(name in _PROXY_HEADERS or name.startswith(b"x-envoy-") for name, _ in headers):
        return False
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # an IPv4 peer on a dual-stack socket
    return any(address in network for network in trusted)
