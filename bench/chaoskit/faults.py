"""The faults on the loopback fleet: each injects itself and says what it did (run.Injected).

Patroni's two faults are in chaoskit.patroni; they need a fleet on a
replicated store.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import time
from pathlib import Path
from typing import Any

import openai

from chaoskit.fleet import Fleet
from chaoskit.load import Load, Worker
from chaoskit.models import COLD, FETCHED
from chaoskit.procs import connections_in, engine_children, engine_on_port, kill_all, wait_gone
from chaoskit.run import OUTAGE_WATCH_S, Frame, Injected, gateway_in_flight, gateway_metric
from chaoskit.verdict import Kill
from llmgw.control.state import UNREACHABLE_AFTER_S


async def holder(fleet: Fleet, model: str, *, avoid: set[str] | None = None) -> dict[str, Any]:
    """A ready replica of ``model`` (one on a node not in ``avoid`` if there is one)."""
    ready = [r for r in await fleet.replicas(model) if r["state"] == "ready"]
    if not ready:
        raise RuntimeError(f"no ready replica of {model}: {await fleet.replicas(model)}")
    preferred = [r for r in ready if not set(r["nodes"]) & (avoid or set())]
    return (preferred or ready)[0]


def _engine_of(replica: dict[str, Any]) -> Any:
    engine = engine_on_port(int(replica["port"]))
    if engine is None:
        raise RuntimeError(f"no engine process on port {replica['port']} for {replica['id']}")
    return engine


# -- engine_kill ---------------------------------------------------------------------


async def engine_kill(frame: Frame, load: Load, model: str) -> Injected:
    """kill -9 of one replica's engine; its agent reports it failed and it is replaced."""
    replica = await holder(frame.fleet, model)
    engine = _engine_of(replica)
    retries = await gateway_metric(frame.fleet, RETRIES, model) or 0.0
    held = connections_in(engine, int(replica["port"]))
    at = time.monotonic()
    kill_all([engine])
    in_flight = _in_flight(load, model, at)
    injected = Injected(ended=at, kills=[Kill(at, model, replica["id"], held)],
                        gone={replica["id"]}, notes=[
        f"killed the {model} engine of replica {replica['id']} on {replica['nodes'][0]}"
        f" with {in_flight} request(s) of {model} in flight, at most {held} of them there"])

    async def restore() -> None:
        after = await gateway_metric(frame.fleet, RETRIES, model) or 0.0
        injected.notes.append(f"the gateway retried {after - retries:.0f} request(s) of {model}"
                              " on another replica")

    injected.restore = restore
    return injected


RETRIES = "llmgw_gateway_upstream_retries_total"


def _in_flight(load: Load, model: str, at: float) -> int:
    return sum(1 for r in load.records
               if r.model == model and r.sent <= at and (not r.done or r.done >= at))


# -- node_kill -------------------------------------------------------------------------


async def node_kill(frame: Frame, load: Load, node: str, model: str) -> Injected:
    """The agent of ``node`` and its engines killed together (the machine died).

    ``model``'s only replica is there; the fleet has room for it elsewhere.
    """
    fleet = frame.fleet
    agent = fleet.agents[node]
    on_node = [r for r in await fleet.replicas() if node in r["nodes"] and r["port"]]
    engines = engine_children(agent.pid) + [
        e for r in on_node if (e := engine_on_port(int(r["port"]))) is not None]
    held = {r["id"]: connections_in(e, int(r["port"])) for r in on_node
            if (e := engine_on_port(int(r["port"]))) is not None}
    at = time.monotonic()
    agent.signal(signal.SIGKILL)
    pids = kill_all(engines)
    await asyncio.to_thread(wait_gone, [agent.pid, *pids])
    killed_models = {r["model"] for r in on_node}

    async def restore() -> None:
        agent.start()
        await fleet.wait_nodes_ready({node}, timeout_s=60)
        if await fleet.wait_whole(120) is None:
            raise RuntimeError(f"not whole after {node} came back:\n{fleet.logs()}")

    kills = [Kill(at, r["model"], r["id"], held.get(r["id"], 0)) for r in on_node]
    injected = Injected(ended=at, kills=kills, dead={node},
                        gone={r["id"] for r in on_node}, restore=restore)
    first = await _first_answer(load, model, at, timeout_s=frame.recovery_timeout_s)
    injected.figures["first_answer_s"] = None if first is None else round(first, 2)
    injected.notes.append(
        f"killed agent {node} and {len(pids)} engine(s) ({sorted(killed_models)});"
        f" first answer of {model} sent after the kill came "
        + (f"{first:.1f} s after it" if first is not None else "never"))
    return injected


async def _first_answer(load: Load, model: str, since: float, timeout_s: float) -> float | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = [r.done for r in load.records
                if r.model == model and r.ok and r.sent > since and r.done]
        if done:
            return min(done) - since
        await asyncio.sleep(0.1)
    return None


# -- agent_restart ----------------------------------------------------------------------


async def agent_restart(frame: Frame, load: Load, node: str) -> Injected:
    """kill -9 of an agent, started again a second later: it adopts its running engines."""
    agent = frame.fleet.agents[node]
    before = {p.pid for p in engine_children(agent.pid)}
    agent.kill9()
    await asyncio.sleep(1.0)
    agent.start()
    at = time.monotonic()

    async def restore() -> None:
        # The same engine processes serve on: adopted, not restarted.
        alive = sum(1 for pid in before if _alive(pid))
        injected.notes.append(f"{alive} of its {len(before)} engine(s) adopted")

    injected = Injected(ended=at, resumed={node}, restore=restore,
                        notes=[f"killed agent {node}, started it again 1 s later"])
    return injected


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# -- agent_stopped -------------------------------------------------------------------------


async def agent_stopped(frame: Frame, load: Load, node: str) -> Injected:
    """SIGSTOP of an agent for longer than the unreachable grace, then SIGCONT.

    Its engines run on; the node turns unreachable (its replicas leave
    routing), then reports again and is whole.
    """
    agent = frame.fleet.agents[node]
    stop_s = UNREACHABLE_AFTER_S + 5.0
    agent.signal(signal.SIGSTOP)
    unreachable_at: float | None = None
    started = time.monotonic()
    while time.monotonic() - started < stop_s:
        if unreachable_at is None:
            views = await frame.fleet.node_views()
            if views.get(node, {}).get("state") == "unreachable":
                unreachable_at = time.monotonic() - started
        await asyncio.sleep(0.5)
    agent.signal(signal.SIGCONT)
    at = time.monotonic()
    seen = "never" if unreachable_at is None else f"after {unreachable_at:.1f} s"
    return Injected(ended=at, resumed={node},
                    notes=[f"agent {node} stopped {stop_s:.0f} s; shown unreachable {seen}"])


# -- control_plane_leader_kill ------------------------------------------------------------------


async def control_plane_leader_kill(frame: Frame, load: Load) -> Injected:
    """kill -9 of the leading ``llmgw serve``; the standby on the same database takes over.

    Right after the kill, requests start for an on-demand model nobody had
    asked for: the gateway's demand finds no leader, and the new one must
    start the model while they wait.
    """
    fleet = frame.fleet
    await fleet.apply([COLD])
    leader = await fleet.api.leader()
    assert leader is not None, "no leader before the fault"
    url, epoch = leader
    index = fleet.urls.index(url)
    fleet.serves[index].kill9()
    at = time.monotonic()
    load.add(Worker(COLD["name"], pause_s=0.2))
    injected = Injected(ended=at, hold_until=at + OUTAGE_WATCH_S)

    async def new_leader() -> bool:
        """The standby leads, and the model asked for meanwhile runs."""
        now = await fleet.api.leader()
        if now is None or now[1] <= epoch:
            return False
        if not injected.notes:
            injected.notes.append(f"killed serve{index} (epoch {epoch}); the standby led"
                                  f" (epoch {now[1]}) {time.monotonic() - at:.1f} s later")
        return any(r["state"] == "ready" for r in await fleet.replicas(COLD["name"]))

    async def restore() -> None:
        await fleet.restart_serve(index)  # back, as the standby now

    injected.also, injected.restore = new_leader, restore
    return injected


# -- slow_clients --------------------------------------------------------------------------


async def slow_clients(frame: Frame, load: Load, key: str, model: str,
                       duration_s: float) -> Injected:
    """Slow readers, and clients that hang up mid-stream or before their answer.

    The slow readers' requests count with the steady load's (they must all
    be answered in full); the clients that hang up chose to, and are not
    counted. Whole again also needs the gateway to have let go of what they
    left: its requests in flight upstream back to no more than the steady
    load's.
    """
    fleet = frame.fleet
    slow = Load(f"{fleet.gateway_url}/v1", key,
                [Worker(model, stream=True, max_tokens=200, pause_s=0.2)] * 4)
    slow.read_pause_s = 0.02
    slow.start()
    client = openai.AsyncOpenAI(base_url=f"{fleet.gateway_url}/v1", api_key=key, max_retries=0)
    left = {"mid_stream": 0, "before_answer": 0}

    async def hang_up_mid_stream() -> None:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "a long one, please"}],
            max_tokens=400, stream=True)
        async for _ in stream:
            if _ is not None:
                break
        await stream.close()
        left["mid_stream"] += 1

    async def hang_up_before_answer() -> None:
        with contextlib.suppress(openai.APITimeoutError, openai.APIConnectionError):
            await client.with_options(timeout=0.05).chat.completions.create(
                model=model, messages=[{"role": "user", "content": "never mind"}],
                max_tokens=400)
        left["before_answer"] += 1

    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline:
        await asyncio.gather(*(hang_up_mid_stream() for _ in range(3)),
                             *(hang_up_before_answer() for _ in range(3)),
                             return_exceptions=True)
        await asyncio.sleep(0.1)
    await client.close()
    at = time.monotonic()
    steady = sum(1 for w in frame.workers if w.model == model)
    slow_count = len(slow.workers)

    async def let_go() -> bool:
        in_flight = await gateway_in_flight(fleet, model)
        return in_flight is not None and in_flight <= steady + slow_count

    return Injected(ended=at, also=let_go, extra_loads=[slow], notes=[
        f"{left['mid_stream']} streams left after the first chunk, {left['before_answer']}"
        f" requests left before their answer, {slow_count} slow readers"])


# -- disk_full ---------------------------------------------------------------------------


async def disk_full(frame: Frame, load: Load, nodes: list[str]) -> Injected:
    """The disk of the node downloading a model's weights fills up half way.

    The weights dirs of ``nodes`` are tmpfs mounts; once the fetch has
    written a few MiB, a file takes every free byte of that filesystem, and
    stays there: the download fails with ENOSPC, and the model must be
    started elsewhere while requests for it wait.
    """
    fleet = frame.fleet
    await fleet.apply([FETCHED])
    load.add(Worker(FETCHED["name"], pause_s=0.2))
    node, staged = await _download_under_way(fleet, nodes, timeout_s=60)
    filler = fleet.weights_dir(node) / "chaos-filler"
    size = await asyncio.to_thread(_fill, filler)
    at = time.monotonic()

    async def restore() -> None:
        filler.unlink(missing_ok=True)

    return Injected(ended=at, restore=restore, notes=[
        f"{node}'s weights disk filled ({size >> 20} MiB) when its download of"
        f" {FETCHED['name']} had {staged >> 20} MiB"])


async def _download_under_way(fleet: Fleet, nodes: list[str],
                              timeout_s: float) -> tuple[str, int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for node in nodes:
            staging = fleet.weights_dir(node) / ".tmp"
            for path in staging.glob(f"{FETCHED['name']}*/**/*"):
                with contextlib.suppress(OSError):
                    if path.is_file() and path.stat().st_size >= 4 << 20:
                        return node, path.stat().st_size
        await asyncio.sleep(0.01)
    raise RuntimeError(f"no download of {FETCHED['name']} seen:\n{fleet.logs()}")


def _fill(path: Path) -> int:
    """Take every free byte of ``path``'s filesystem; returns how many it took.

    The fetch writes on meanwhile, so the last bytes are raced for: the bulk
    is allocated at once, the rest written until the filesystem says ENOSPC.
    """
    stats = os.statvfs(path.parent)
    free = stats.f_bavail * stats.f_frsize
    taken = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        bulk = free - (16 << 20)
        if bulk > 0:
            os.posix_fallocate(fd, 0, bulk)
            taken = bulk
            os.lseek(fd, bulk, os.SEEK_SET)
        for block in (1 << 20, 4096):
            chunk = b"\0" * block
            while True:
                try:
                    taken += os.write(fd, chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    return taken
