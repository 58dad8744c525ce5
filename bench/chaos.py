"""The chaos suite: each fault under steady load, and what a client and the store lost.

    python bench/chaos.py                 # every fault, longer windows (~10 min on 2 cores)
    python bench/chaos.py --quick         # every fault once, briefly (~7 min)
    python bench/chaos.py --quick --faults engine_kill,slow_clients

A fleet on loopback as an operator runs it, every part its own process:
two ``llmgw serve`` (leader and standby) on a fresh PostgreSQL database, a
standalone ``llmgw gateway`` following both, and ``llmgw agent`` processes
with CPU slots whose engines are real processes -- simulated ones (model
``chat``, two replicas; ``lazy``, on demand) and llama.cpp on the starter
model (``gemma``, two replicas). The load goes through the gateway with the
official ``openai`` client (closed loops, streamed and not, no client
retries). The Patroni faults run on a second fleet whose store is a real
Patroni cluster (tests/store_cluster.py; ``make setup`` installs etcd and
Patroni). ``disk_full`` needs root (it mounts a tmpfs as weights dirs).

Faults, with the production timings (30 s before a silent node is
unreachable):

* ``engine_kill``: kill -9 of a replica's engine (llama.cpp).
* ``node_kill``: kill -9 of an agent and its engines together; the node held
  the only replica of an on-demand model, and another node has room.
* ``agent_restart``: kill -9 of an agent, started again a second later.
* ``control_plane_leader_kill``: kill -9 of the leading ``llmgw serve``.
* ``patroni_switchover``, ``patroni_leader_kill``: a switchover; kill -9 of
  the leader member's Patroni and PostgreSQL together.
* ``agent_stopped``: SIGSTOP of an agent for 35 s, then SIGCONT.
* ``disk_full``: the weights disk fills up while a model's weights are being
  fetched (a tmpfs, filled by a file once the fetch has written 4 MiB).
* ``slow_clients``: slow readers, and clients that hang up mid-stream or
  before their answer.

Per fault: requests sent, failed, ``failed_unexcused`` (failures no kill of
the fault explains: a request in flight on a replica it killed, failing
within seconds of the kill, no more than that replica held; target 0), the
seconds from the end of the fault until the fleet is whole again (the
summary: every model satisfied, every replica ready, nothing parked, no node
unreachable but a killed one), and the store rows lost (catalog entries and
API keys acknowledged during the fault, events, and usage: requests the
gateway answered for the load's key missing from the usage rows; at most
one flush interval's worth). A fault passes (``ok``) when it ran, no failure
is unexcused, the fleet was whole again, requests sent after the fault were
answered, its own figures were measured and no row was lost beyond the
bound (chaoskit.verdict); ``failed_because`` says why not. The last line is
JSON: ``{"ok", "faults": {NAME: {"ok", "sent", "failed", "failed_unexcused",
"answered_after", "recovery_s", "rows_lost", ...}}}``. Exit code 0 only when
every fault asked for passed (a fault that could not run, ``disk_full``
without root say, fails the run: leave it out with ``--faults``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.store_cluster

from chaoskit import faults, patroni
from chaoskit.fleet import Fleet, create_database, drop_database
from chaoskit.load import Load, Worker
from chaoskit.models import CHAT, GEMMA, LAZY, write_weights_package
from chaoskit.run import Frame, Injected, Outcome

LOCAL = ["engine_kill", "agent_restart", "slow_clients", "control_plane_leader_kill",
         "agent_stopped", "disk_full", "node_kill"]
PATRONI = ["patroni_switchover", "patroni_leader_kill"]
FAULTS = [*LOCAL, *PATRONI]
PG_URL = os.environ.get("LLMGW_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")


@dataclass(frozen=True)
class Mode:
    settle_s: float
    after_s: float
    slow_clients_s: float
    chat_workers: int

    @staticmethod
    def of(quick: bool) -> Mode:
        return Mode(2.0, 2.0, 4.0, 3) if quick else Mode(10.0, 10.0, 15.0, 6)


Inject = Callable[[Load], Awaitable[Injected]]


def _workers(mode: Mode, *, llamacpp: bool, lazy: bool) -> list[Worker]:
    workers = [Worker("chat") for _ in range(mode.chat_workers)]
    workers.append(Worker("chat", stream=True))
    if llamacpp:
        workers += [Worker("gemma", max_tokens=4, pause_s=0.3),
                    Worker("gemma", stream=True, max_tokens=4, pause_s=0.3)]
    if lazy:
        workers.append(Worker("lazy", pause_s=0.1))
    return workers


async def _run_each(frame: Frame, plan: list[tuple[str, Inject]],
                    outcomes: dict[str, Outcome]) -> None:
    for name, inject in plan:
        print(f"== {name}", flush=True)
        started = time.monotonic()
        try:
            outcome = await frame.run(name, inject)
        except Exception as exc:  # one fault's trouble must not hide the others' figures
            traceback.print_exc()
            outcome = Outcome(name, skipped=f"error: {exc}".splitlines()[0][:300])
        for note in outcome.notes:
            print(f"   {note}")
        if outcome.errors:
            print(f"   failures: {outcome.errors}")
        print(f"   {outcome.line()}  [{time.monotonic() - started:.0f} s]", flush=True)
        outcomes[name] = outcome


async def local_phase(names: list[str], mode: Mode, root: Path, *, llamacpp: bool,
                      pg_url: str) -> dict[str, Outcome]:
    outcomes: dict[str, Outcome] = {}
    can_mount = os.geteuid() == 0
    if "disk_full" in names and not can_mount:
        outcomes["disk_full"] = Outcome("disk_full", skipped="needs root (mounts a tmpfs)")
        names = [n for n in names if n != "disk_full"]
    if not names:
        return outcomes
    nodes = {"n0": 3, "n1": 3, "n2": 3}
    lazy = "node_kill" in names
    if lazy:
        nodes["n3"] = 1  # room for the lazy model's one replica only
    packages = write_weights_package(root / "packages")
    path = os.pathsep.join(p for p in (str(packages), os.environ.get("PYTHONPATH")) if p)
    tmpfs = {n: 512 for n in ("n0", "n1", "n2")} if "disk_full" in names else {}
    database = create_database(pg_url)
    fleet = Fleet(root / "local", database, nodes, weights_tmpfs_mib=tmpfs,
                  env={"PYTHONPATH": path})
    fleet.root.mkdir(parents=True)
    try:
        print(f"starting the fleet in {fleet.root} ...", flush=True)
        started = time.monotonic()
        await fleet.start()
        if lazy:  # n3 is kept for the lazy model's replica
            await fleet.api.call("POST", "/nodes/n3/cordon")
        await fleet.apply([CHAT, *([GEMMA] if llamacpp else [])])
        if await fleet.wait_whole(600) is None:
            raise RuntimeError(f"the fleet never became whole:\n{fleet.logs()}")
        if lazy:
            await _lazy_on(fleet, "n3", [n for n in nodes if n != "n3"])
        slow_key = await fleet.api.call("POST", "/keys", {"name": "slow clients"})
        print(f"fleet whole after {time.monotonic() - started:.0f} s", flush=True)
        frame = Frame(fleet, _workers(mode, llamacpp=llamacpp, lazy=lazy),
                      mode.settle_s, mode.after_s)
        victim = "gemma" if llamacpp else "chat"
        chat_node = (await faults.holder(fleet, "chat", avoid={"n3"}))["nodes"][0]
        plan: dict[str, Inject] = {
            "engine_kill": lambda load: faults.engine_kill(frame, load, victim),
            "agent_restart": lambda load: faults.agent_restart(frame, load, chat_node),
            "slow_clients": lambda load: faults.slow_clients(
                frame, load, slow_key.json()["secret"], "chat", mode.slow_clients_s),
            "control_plane_leader_kill": lambda load: faults.control_plane_leader_kill(
                frame, load),
            "agent_stopped": lambda load: faults.agent_stopped(frame, load, chat_node),
            "disk_full": lambda load: faults.disk_full(frame, load, list(tmpfs)),
            "node_kill": lambda load: faults.node_kill(frame, load, "n3", "lazy"),
        }
        await _run_each(frame, [(n, plan[n]) for n in LOCAL if n in names], outcomes)
    finally:
        await fleet.close()
        await asyncio.to_thread(drop_database, pg_url, database)
    return outcomes


async def _lazy_on(fleet: Fleet, node: str, others: list[str]) -> None:
    """The on-demand model's one replica on ``node``: the others cordoned while it is asked for."""
    assert fleet.creds is not None
    for name in others:
        await fleet.api.call("POST", f"/nodes/{name}/cordon")
    await fleet.api.call("POST", f"/nodes/{node}/uncordon")
    try:
        await fleet.apply([LAZY])
        load = Load(f"{fleet.gateway_url}/v1", fleet.creds.api_key, [Worker("lazy")])
        load.start()
        answered = await load.wait_answers(1, 0.0, 120)
        await load.stop()
        if not answered:
            raise RuntimeError(f"lazy never answered: {[r.error for r in load.records]}")
    finally:
        for name in others:
            await fleet.api.call("POST", f"/nodes/{name}/uncordon")
    if await fleet.wait_whole(60) is None:
        raise RuntimeError(f"not whole after placing lazy:\n{fleet.logs()}")


async def patroni_phase(names: list[str], mode: Mode, root: Path) -> dict[str, Outcome]:
    if not names:
        return {}
    from tests.store_cluster import PatroniCluster

    cluster_root = Path(tempfile.mkdtemp(prefix="llmgw-chaos-patroni-"))
    os.chmod(cluster_root, 0o755)  # its members run as the postgres user
    cluster = PatroniCluster(cluster_root)
    outcomes: dict[str, Outcome] = {}
    fleet: Fleet | None = None
    try:
        print("starting a Patroni cluster ...", flush=True)
        # On this thread: the members die with the thread that started them.
        cluster.start()
        cluster.create_database("llmgw")
        fleet = Fleet(root / "patroni", cluster.database_url("llmgw"), {"n0": 2, "n1": 2},
                      control_planes=1, env={"LLMGW_PATRONI_URL": ",".join(cluster.api_urls)})
        fleet.root.mkdir(parents=True)
        await fleet.start()
        await fleet.apply([CHAT])
        if await fleet.wait_whole(120) is None:
            raise RuntimeError(f"the fleet never became whole:\n{fleet.logs()}")
        frame = Frame(fleet, _workers(mode, llamacpp=False, lazy=False),
                      mode.settle_s, mode.after_s)
        plan: dict[str, Inject] = {
            "patroni_switchover": lambda load: patroni.switchover(frame, load, cluster),
            "patroni_leader_kill": lambda load: patroni.leader_kill(frame, load, cluster),
        }
        await _run_each(frame, [(n, plan[n]) for n in PATRONI if n in names], outcomes)
    finally:
        if fleet is not None:
            await fleet.close()
        cluster.close()
    return outcomes


async def run(names: list[str], mode: Mode, root: Path, *, llamacpp: bool,
              pg_url: str) -> dict[str, Outcome]:
    outcomes = await local_phase([n for n in names if n in LOCAL], mode, root,
                                 llamacpp=llamacpp, pg_url=pg_url)
    outcomes.update(await patroni_phase([n for n in names if n in PATRONI], mode, root))
    return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="every fault once, briefly")
    parser.add_argument("--faults", default=",".join(FAULTS),
                        help=f"comma-separated, of: {', '.join(FAULTS)}")
    parser.add_argument("--no-llamacpp", action="store_true",
                        help="simulated engines only (engine_kill kills a simulated one)")
    parser.add_argument("--pg-url", default=PG_URL, help="PostgreSQL to make the database on")
    parser.add_argument("--keep", action="store_true", help="keep the logs and data dirs")
    args = parser.parse_args()
    names = [n.strip() for n in args.faults.split(",") if n.strip()]
    unknown = sorted(set(names) - set(FAULTS))
    if unknown:
        parser.error(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
    root = Path(tempfile.mkdtemp(prefix="llmgw-chaos-"))
    started = time.monotonic()
    try:
        outcomes = asyncio.run(run(names, Mode.of(args.quick), root,
                                   llamacpp=not args.no_llamacpp, pg_url=args.pg_url))
    finally:
        if args.keep:
            print(f"logs and data dirs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\n== chaos suite ({'quick' if args.quick else 'full'}),"
          f" {time.monotonic() - started:.0f} s")
    for name in FAULTS:
        if name in outcomes:
            print(outcomes[name].line())
    return verdict(names, outcomes)


def verdict(names: list[str], outcomes: dict[str, Outcome]) -> int:
    """Print the JSON line; the exit code: 0 when every fault asked for ran and passed."""
    missing = [n for n in names if n not in outcomes]
    failed = [n for n in names if n in outcomes and outcomes[n].reasons]
    ok = not missing and not failed
    print(json.dumps({"ok": ok, "faults": {n: outcomes[n].as_json()
                                           for n in FAULTS if n in outcomes}}))
    if not ok:
        print(f"chaos suite FAILED: {', '.join(failed + [f'{n} (no outcome)' for n in missing])}",
              file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
