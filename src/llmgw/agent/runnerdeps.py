"""What every replica runner shares with the agent that made it (agent.replicas).

One instance per agent: the process control, the weights cache, the ports,
the state file, the HTTP sessions, and how engines are started and watched.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from llmgw.agent.engines.base import EngineTls
from llmgw.agent.engineuser import EngineUser
from llmgw.agent.liveness import Liveness
from llmgw.agent.memguard import MemoryGuard
from llmgw.agent.ports import PortAllocator
from llmgw.agent.state import StateStore
from llmgw.agent.supervisor import ProcessControl
from llmgw.agent.weights import WeightsCache


@dataclass
class RunnerDeps:
    """What every runner shares with the agent; one instance per agent."""

    supervisor: ProcessControl
    weights: WeightsCache
    ports: PortAllocator
    state: StateStore
    session: aiohttp.ClientSession
    host: str  # where engines listen
    on_change: Callable[[], None]  # a state changed: report soon
    peers: Callable[[str], list[str]]  # model -> peer agent URLs
    peer_token: Callable[[], str | None]
    stop_grace_s: float = 15.0
    # How often a starting engine is probed: every probe that finds it not
    # yet answering costs whatever of this interval is left when it comes up,
    # and that wait is the request's, held at the gateway (an on-demand cold
    # start spent 140-200 ms of it at 0.25 s, measured by bench/coldstart.py).
    # A refused connection or a 503 costs the engine nothing.
    poll_s: float = 0.02
    monitor_s: float = 1.0
    liveness: Liveness = field(default_factory=Liveness)
    # Holds engines to their memory budgets (agent.memguard); None: nothing
    # is enforced (fake process controls, whose pids are not real engines).
    memory: MemoryGuard | None = None
    # For copies from peers: verifies their servers against the CA that signs
    # node certificates (agent.nodecert) where the fleet runs TLS; None: ``session``.
    peer_session: aiohttp.ClientSession | None = None
    # The node's certificate for engines to listen with (agent.nodecert),
    # asked at each launch; None: engines are plain http.
    engine_tls: Callable[[], EngineTls | None] = lambda: None
    # Verifies engines that listen with TLS when the agent probes them.
    engine_probe_ssl: ssl.SSLContext | None = None
    # Engines run under this user (agent.engineuser): each launch makes the
    # weights it loads readable to it. None: the agent's own user.
    engine_user: EngineUser | None = None
