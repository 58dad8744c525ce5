"""Open connections per client address, capped: one address cannot take every slot of a server.

A server's connection limit counts all clients together, so one address
that keeps thousands of slow connections open (each a byte every few
seconds, never finishing a request) made every other client's request fail,
``/healthz`` included. Each llmgw server counts its open connections per
client address here and refuses a new one from an address already at
``LLMGW_MAX_CONNECTIONS_PER_ADDRESS`` (default :data:`MAX_PER_ADDRESS`),
before reading anything from it. An IPv6 client is counted by its /64 (one
host holds a whole /64); loopback addresses each count on their own, so
127.0.0.1 and 127.0.0.2 are different clients.
"""

from __future__ import annotations

import functools
import ipaddress
import os

from llmgw.errors import ConfigError

# A load balancer or NAT in front of a server puts many clients behind one
# address: raise it there.
MAX_PER_ADDRESS = 512
ENV = "LLMGW_MAX_CONNECTIONS_PER_ADDRESS"


@functools.cache
def max_per_address_from_env() -> int:
    """``LLMGW_MAX_CONNECTIONS_PER_ADDRESS``, or the default; 0 turns the cap off.

    Read once per process; a server's settings read it at start, so a bad
    value stops the start with this error rather than failing each connection.
    """
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return MAX_PER_ADDRESS
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{ENV} must be a whole number, not {raw!r}") from None
    if value < 0:
        raise ConfigError(f"{ENV} must be 0 (no cap) or more, not {value}")
    return value


def address_key(host: str) -> str:
    """What one client's connections are counted under: its IPv4 address, its IPv6 /64."""
    if ":" not in host:
        return host
    try:
        address = ipaddress.IPv6Address(host.split("%", 1)[0])
    except ValueError:
        return host
    mapped = address.ipv4_mapped
    if mapped is not None:
        return str(mapped)
    if address.is_loopback:
        return host
    return str(ipaddress.IPv6Network((int(address) >> 64 << 64, 64)))


class AddressCounts:
    """One server's open connections per client address."""

    def __init__(self, cap: int) -> None:
        self.cap = cap  # 0: no cap
        self.counts: dict[str, int] = {}

    def take(self, host: str) -> str | None:
        """Count a new connection from ``host``; its key, or None when the address is at the cap."""
        key = address_key(host)
        held = self.counts.get(key, 0)
        if self.cap and held >= self.cap:
            return None
        self.counts[key] = held + 1
        return key

    def give(self, key: str) -> None:
        """A connection counted under ``key`` closed."""
        left = self.counts.get(key, 1) - 1
        if left > 0:
            self.counts[key] = left
        else:
            self.counts.pop(key, None)
