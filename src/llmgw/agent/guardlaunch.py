"""An engine's launch wrapped in its guard (agent.engineguard): the command the agent runs.

The engine's own launch is built for loopback (``LaunchContext.host``
127.0.0.1, a port of its own, no TLS); this puts the guard in front of it,
listening where the replica is advertised, with the node's certificate
where the fleet issues one. Everything the agent watches stays the
engine's: health and liveness paths, metrics, dialect (probed on the
engine's loopback port, past the guard). The engine's KV-cache events, where
it publishes them, are the guard's to relay (agent.kvrelay).
"""

from __future__ import annotations

import dataclasses
import sys

from llmgw.agent.engineguard import GUARD_KEY_ENV, GUARD_MODULE
from llmgw.agent.engines.base import EngineLaunch, EngineTls


def guarded_launch(
    engine: EngineLaunch,
    key: str,
    host: str,
    port: int,
    engine_port: int,
    tls: EngineTls | None,
    *,
    python: str | None = None,
    kv_events: str | None = None,
) -> EngineLaunch:
    """``engine`` started by its guard on ``host:port``, which wants ``key`` first.

    ``kv_events``: the ``ipc://`` endpoint the engine publishes its KV-cache
    events on, which the guard relays behind the key (agent.kvrelay).
    """
    argv = [python or sys.executable, "-m", GUARD_MODULE, "--host", host, "--port", str(port),
            "--engine-port", str(engine_port)]
    if kv_events is not None:
        argv += ["--kv-events", kv_events]
    if tls is not None:
        argv += ["--tls-cert", tls.cert_file, "--tls-key", tls.key_file]
    return dataclasses.replace(
        engine,
        argv=[*argv, "--", *engine.argv],
        env={**engine.env, GUARD_KEY_ENV: key},
        tls=tls is not None,
        guarded=True,
    )
