"""Ports for engines: never two replicas on one port, also across agent restarts.

Allocations are remembered by replica id and seeded at start-up from the
on-disk engine records, so an agent that restarts while its engines run does
not hand their ports out again. A port is also proven free by binding it,
because something outside llmgw (or another agent on the same machine, as in
the simulated fleet) may hold it.

The default range sits below Linux's ephemeral range (32768-60999): outgoing
connections then never take a port between its allocation and the engine's
bind. The scan starts at a random offset so that several agents on one
machine rarely race for the same port.
"""

from __future__ import annotations

import random
import socket

from llmgw.errors import EngineError

DEFAULT_RANGE = (20000, 29999)


def port_is_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


class PortAllocator:
    def __init__(self, host: str, port_range: tuple[int, int] = DEFAULT_RANGE) -> None:
        low, high = port_range
        if not 0 < low <= high < 65536:
            raise EngineError(f"port range {low}-{high} is not within 1-65535")
        self.host = host
        self.low = low
        self.high = high
        self._taken: dict[str, int] = {}

    def restore(self, replica_id: str, port: int) -> None:
        """Keep the port of an engine found running (or recorded) at start-up."""
        self._taken[replica_id] = port

    def allocate(self, replica_id: str) -> int:
        if replica_id in self._taken:
            return self._taken[replica_id]
        used = set(self._taken.values())
        size = self.high - self.low + 1
        start = random.randrange(size)
        for step in range(size):
            port = self.low + (start + step) % size
            if port not in used and port_is_free(self.host, port):
                self._taken[replica_id] = port
                return port
        raise EngineError(f"no free port in {self.low}-{self.high} on {self.host}")

    def release(self, replica_id: str) -> None:
        self._taken.pop(replica_id, None)

    def taken(self) -> dict[str, int]:
        return dict(self._taken)
