"""How a replica's engine is launched and reached: behind a guard where it needs one.

An engine with a key that serves HTTP listens on loopback only, started by
its guard on the replica's advertised port (:mod:`llmgw.agent.engineguard`):
engines guard only some of their routes with their key. The agent's own
probes go past the guard, to the engine on loopback. An engine that publishes
its KV-cache events does so on the node only, for its guard to relay.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import tempfile
from collections.abc import Callable, Sequence

from llmgw import memory
from llmgw.agent.engineprobe import EngineEndpoint
from llmgw.agent.engines.base import EngineAdapter, EngineLaunch, LaunchContext
from llmgw.agent.engines.cpudtype import native_bf16, weights_copies
from llmgw.agent.guardlaunch import guarded_launch
from llmgw.agent.ports import PortAllocator
from llmgw.agent.runnerdeps import RunnerDeps
from llmgw.agent.weights import Progress, weights_size
from llmgw.wire import CPU_CLASS, Device, EngineKind, ModelSpec, ReplicaAssignment

# Where an engine behind a guard listens: reachable from this node only.
LOOPBACK = "127.0.0.1"


def engine_port_id(replica_id: str) -> str:
    """The port allocator's name for the loopback port of a guarded engine."""
    return f"{replica_id}@engine"


def kv_events_endpoint(replica_id: str) -> str:
    """Where a replica's engine publishes its KV-cache events: an ``ipc://`` socket
    in a directory its guard creates owner-only (agent.kvrelay).

    Under the temporary directory, not the data dir: a socket's path must fit
    in 107 bytes. The random part is what makes the guard's exclusive mkdir
    meaningful: nobody can make the directory first, for a name they cannot
    guess, to read the socket inside it.
    """
    name = f"llmgw-kv-{replica_id}-{secrets.token_hex(4)}"
    return f"ipc://{os.path.join(tempfile.gettempdir(), name, 'events')}"


def publishes_kv_events(assignment: ReplicaAssignment) -> bool:
    """Whether the replica's engine is started publishing its KV-cache events: the
    catalog asked (ModelSpec.kv_events), the engine is vLLM, this is the rank that
    serves the API (its scheduler is the one that publishes), and it has a key, so a
    guard stands in front of it to relay them (without one they would reach nobody)."""
    spec = assignment.model
    return (spec.kv_events and spec.engine == EngineKind.VLLM and assignment.shard.rank == 0
            and assignment.engine_key is not None)  # fmt: skip


def restore_ports(ports: PortAllocator, replica_id: str, engine: int | None) -> None:
    """An adopted engine's own port taken again: its guarded loopback one."""
    if engine is not None:
        ports.restore(engine_port_id(replica_id), engine)


def release_ports(ports: PortAllocator, replica_id: str) -> None:
    """A stopped engine's ports given back: the advertised one and its own."""
    for name in (replica_id, engine_port_id(replica_id)):
        ports.release(name)


async def fetch_weights(deps: RunnerDeps, spec: ModelSpec, progress: Progress) -> str | None:
    """The model's weights in the node's cache: from its peers where they hold them."""
    return await deps.weights.ensure(
        spec,
        progress=progress,
        peers=deps.peers(spec.name),
        peer_token=deps.peer_token(),
        session=deps.peer_session or deps.session,
    )


async def launch_context(
    assignment: ReplicaAssignment,
    devices: Sequence[Device],
    deps: RunnerDeps,
    weights_path: str | None,
    port: int,
    adapters: tuple[tuple[str, str], ...] = (),
) -> tuple[LaunchContext, int]:
    """What the adapter builds a launch from, once the weights are fetched and the
    port allocated; and the engine's memory budget (MiB), which it sizes to."""
    weights_bytes = await asyncio.to_thread(weights_size, weights_path)
    gpus = sum(1 for d in devices if d.gpu_class != CPU_CLASS)
    # vLLM computing in float32 on this CPU holds a bfloat16 checkpoint twice
    # over: counted once, a model past ~3.5 GiB outgrows its budget (the KV
    # cache sized to it is at its floor already), and the agent stops it.
    copies = weights_copies(assignment.model, devices, native_bf16())
    budget = memory.need_mib(assignment.model, weights_bytes, gpus, copies)
    ctx = LaunchContext(
        assignment=assignment,
        weights_path=weights_path,
        host=deps.host,
        port=port,
        devices=devices,
        memory_budget_mib=budget,
        weights_bytes=weights_bytes,
        tls=deps.engine_tls(),
        adapters=adapters,
        kv_events=(
            kv_events_endpoint(assignment.replica_id) if publishes_kv_events(assignment) else None
        ),
    )  # fmt: skip
    return ctx, budget


def engine_launch(
    adapter: EngineAdapter, ctx: LaunchContext, engine_port: Callable[[], int]
) -> tuple[EngineLaunch, int | None]:
    """The launch for ``ctx``, and the engine's own loopback port where a guard starts it.

    ``engine_port`` allocates that port; it is called only for a guarded engine.
    """
    launch = adapter.build(ctx)
    key = ctx.assignment.engine_key
    if key is None or not _wants_guard(adapter, launch):
        return launch, None
    # The same engine on loopback in plain HTTP, started by its guard,
    # which takes the advertised port, and TLS with it.
    port = engine_port()
    inner = adapter.build(dataclasses.replace(ctx, host=LOOPBACK, port=port, tls=None))
    launch = guarded_launch(inner, key, ctx.host, ctx.port, port, ctx.tls, kv_events=ctx.kv_events)
    return launch, port


def _wants_guard(adapter: EngineAdapter, launch: EngineLaunch) -> bool:
    """Whether this engine serves HTTP that it does not hold every route of to its key."""
    if launch.health_path is None:
        return False
    return not adapter.guards_every_route


def engine_endpoint(
    deps: RunnerDeps, key: str | None, port: int | None, engine_port: int | None, tls: bool
) -> EngineEndpoint:
    """Where the agent probes and scrapes a replica's engine.

    ``port``: the advertised one; ``engine_port``: a guarded engine's own, on
    loopback in plain HTTP, reached past the guard.
    """
    if engine_port is not None:
        return EngineEndpoint(deps.session, LOOPBACK, engine_port, key=key)
    return EngineEndpoint(
        deps.session, deps.host, port, tls=tls, key=key, probe_ssl=deps.engine_probe_ssl
    )
