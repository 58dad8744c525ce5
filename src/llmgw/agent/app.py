"""The agent: report what the node has and runs, converge on what the control plane answers.

The loop is declarative (DESIGN.md §1): every report carries the inventory
and the state of every replica; every answer carries the complete set of
replicas this node must run. Convergence starts what is missing, stops what
is no longer asked for and replaces a replica whose generation changed. A
lost report or answer costs one interval, nothing more, and the loop itself
never dies on a failed step: each is caught, logged and retried.

The agent reports early when a replica changes state (ready, failed), so the
gateway learns of a new endpoint in well under a report interval.

Usable in-process (``llmgw up``) or alone (``llmgw agent``)::

    agent = Agent(AgentConfig(control_plane=url, data_dir=d, name="n1", join_token=t))
    task = asyncio.create_task(agent.run())
    ...
    await agent.shutdown(stop_engines=True)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from llmgw import __version__ as _llmgw_version
from llmgw.agent.client import ControlPlaneClient
from llmgw.agent.discoverer import Discoverer
from llmgw.agent.engines import EngineCommands, default_adapters
from llmgw.agent.engines.base import EngineAdapter
from llmgw.agent.engines.cpudtype import native_bf16
from llmgw.agent.engines.nodeargs import NodeFlagsAllowed
from llmgw.agent.engines.nodeenv import NodeEnvAllowed
from llmgw.agent.engineuser import EngineUser
from llmgw.agent.identity import Identity, agent_key, load_identity, save_identity
from llmgw.agent.liveness import Liveness
from llmgw.agent.memguard import GuardMode, MemoryGuard, agent_tag, node_memory_mib
from llmgw.agent.metrics import AgentMetrics
from llmgw.agent.nodecert import NodeCertificate
from llmgw.agent.ports import DEFAULT_RANGE, PortAllocator
from llmgw.agent.replicas import ReplicaRunner
from llmgw.agent.replicaset import ReplicaSet
from llmgw.agent.runnerdeps import RunnerDeps
from llmgw.agent.server import WeightsServer
from llmgw.agent.state import StateStore
from llmgw.agent.supervisor import ProcessControl, Supervisor
from llmgw.agent.tlsmode import TlsMode
from llmgw.agent.weights import DiskReserve, WeightsCache
from llmgw.backoff import Backoff
from llmgw.config import ensure_data_dir
from llmgw.errors import AuthError, ConfigError, ControlPlaneUnavailable, ValidationError
from llmgw.failover import parse_control_plane_urls
from llmgw.secrets import hash_secret
from llmgw.tls import (
    CA_CERT,
    ClientTrust,
    is_loopback,
    parse_fingerprint,
    split_join_token,
)
from llmgw.wire import (
    AgentRegistration,
    AgentReport,
    AgentReportAnswer,
    EngineKind,
    NodeInventory,
)

log = logging.getLogger("llmgw.agent")

MIN_REPORT_GAP_S = 0.05
MAX_BACKOFF_S = 30.0


@dataclass
class AgentConfig:
    # One URL, or several comma-separated (a leader and its standbys): reports
    # go to whichever leads (llmgw.failover).
    control_plane: str
    data_dir: Path
    name: str
    join_token: str | None = None
    fabrics: list[str] = field(default_factory=list)
    # Where the gateway and peer agents reach this node's engines and server.
    address: str = "127.0.0.1"
    # Where engines and the weights server listen; None: ``address``.
    bind_host: str | None = None
    cpu_slots: int = 1
    class_overrides: dict[str, str] = field(default_factory=dict)
    serve_weights: bool = True
    server_port: int = 0
    report_interval_s: float = 5.0  # until the control plane says otherwise
    stop_grace_s: float = 15.0
    # When a ready engine that stops answering its health probe is killed.
    liveness: Liveness = field(default_factory=Liveness)
    port_range: tuple[int, int] = DEFAULT_RANGE
    hf_endpoint: str | None = None
    # Disk space a weights fetch leaves free (llmgw.agent.diskroom).
    weights_reserve: DiskReserve = field(default_factory=DiskReserve)
    # Xids that leave a GPU healthy; None: LLMGW_IGNORED_XIDS, else the default.
    ignored_xids: frozenset[int] | None = None
    # How engines are held to their memory budgets (agent.memguard): "auto"
    # takes a cgroup where the agent can make one, else watches RSS.
    memory_guard: GuardMode = "auto"
    # Asked of scrapers of the agent's /metrics (llmgw.agent.metrics); None: open.
    metrics_token: str | None = None
    # The fleet's CA for an https:// control plane (llmgw.tls); without it the
    # CA is fetched once with the fingerprint the join token carries (or this
    # one) and kept in the data dir as ca.pem.
    ca_file: Path | None = None
    ca_fingerprint: str | None = None
    # --insecure-http: on a TLS fleet whose control plane signs no node
    # certificates, this node's server may still listen in plain HTTP on an
    # address that is not loopback (it carries the peer token).
    insecure_http: bool = False
    # Catalog env names this node's admin allows beyond each engine's own
    # settings (llmgw.engine_env, agent.engines.nodeenv); reported to the
    # control plane, which then accepts them in a catalog.
    engine_env_allow: frozenset[str] = frozenset()
    # Engine flags that run a model's own code which this node's admin allows
    # (--engine-flag-allow; agent.engines.nodeargs): refused everywhere else.
    engine_flag_allow: frozenset[str] = frozenset()
    # Run engines under this user (--engine-user; agent.engineuser): they
    # cannot read the agent's secrets then. Needs the agent to run as root.
    engine_user: str | None = None
    # Where each engine is (--engine NAME=PATH, LLMGW_ENGINE_*; agent.engines.commands).
    engines: EngineCommands = field(default_factory=EngineCommands)


InventoryProvider = Callable[[], NodeInventory]


class RegistrationRefused(AuthError):
    """The join token was refused: fatal, since retrying cannot fix it."""


class Agent:
    def __init__(
        self,
        config: AgentConfig,
        *,
        inventory_provider: InventoryProvider | None = None,
        adapters: Mapping[EngineKind, EngineAdapter] | None = None,
        supervisor: ProcessControl | None = None,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.config = config
        # Checked here so a malformed list fails before anything starts.
        self._control_plane_urls = parse_control_plane_urls(config.control_plane)
        self.data_dir = config.data_dir
        self.bind_host = config.bind_host or config.address
        # The discoverer's Xid watch runs while the agent does.
        self._discoverer: Discoverer | None = None
        if isinstance(inventory_provider, Discoverer):
            self._discoverer = inventory_provider
        elif inventory_provider is None:
            self._discoverer = inventory_provider = Discoverer(
                config.cpu_slots, config.class_overrides, ignored_xids=config.ignored_xids
            )
        self._inventory_provider = inventory_provider
        self.adapters = dict(
            adapters if adapters is not None else default_adapters(config.engines)
        )
        if config.engine_env_allow:
            self.adapters = {
                kind: NodeEnvAllowed(adapter, config.engine_env_allow)
                for kind, adapter in self.adapters.items()
            }
        if config.engine_flag_allow:
            self.adapters = {
                kind: NodeFlagsAllowed(adapter, config.engine_flag_allow)
                for kind, adapter in self.adapters.items()
            }
        self.engine_user = EngineUser.resolve(config.engine_user) if config.engine_user else None
        self.supervisor: ProcessControl = supervisor or Supervisor(
            self.data_dir / "logs", engine_user=self.engine_user)
        self.weights = WeightsCache(
            self.data_dir / "weights",
            hf_endpoint=config.hf_endpoint,
            reserve=config.weights_reserve,
        )
        self.state = StateStore(self.data_dir / "engines.json")
        self.ports = PortAllocator(self.bind_host, config.port_range)
        self.replicas = ReplicaSet(self.adapters)
        self.inventory: NodeInventory | None = None
        self.identity: Identity | None = None
        self._agent_key_hash: str | None = None
        self.server: WeightsServer | None = None
        self.reports_sent = 0
        self._interval = config.report_interval_s
        self._peer_token: str | None = None
        self._weight_peers: dict[str, list[str]] = {}
        self._changed = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None
        # A simulated fleet runs hundreds of agents in one process: one shared
        # session (one connection pool) instead of hundreds; the owner closes it.
        self._shared_session = session
        self._client: ControlPlaneClient | None = None
        self._deps: RunnerDeps | None = None
        self._opened = False
        self._run_task: asyncio.Task[None] | None = None
        self._host_facts: dict[str, object] | None = None  # read once: RAM and CPU stay
        self.node_cert = NodeCertificate(self.data_dir / "tls", config.name)
        fleet_tls = any(url.startswith("https://") for url in self._control_plane_urls)
        self.tls = TlsMode(
            self.node_cert,
            fleet_tls=fleet_tls,
            address=config.address,
            plain_allowed=not fleet_tls or config.insecure_http or is_loopback(self.bind_host),
        )
        # Where the fleet runs TLS, peers are checked against its CA.
        self._peer_session: aiohttp.ClientSession | None = None

    @property
    def runners(self) -> dict[str, ReplicaRunner]:
        return self.replicas.runners

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        """Prepare everything local: data dir, identity, adopted engines, server."""
        if self._opened:
            return
        self._opened = True
        ensure_data_dir(self.data_dir)
        if self.engine_user is not None:
            await asyncio.to_thread(self.engine_user.prepare, self.data_dir)
        self.identity = load_identity(self.data_dir, self.config.name)
        self._agent_key_hash = await asyncio.to_thread(self._read_agent_key_hash)
        await asyncio.to_thread(self.weights.clean_partial)
        if self._discoverer is not None:
            await asyncio.to_thread(self._discoverer.start_watching)
        self._session = self._shared_session or aiohttp.ClientSession()
        if self.tls.fleet_tls and self._shared_session is None:
            # (A simulated fleet's agents share one session and copy no weights.)
            self._peer_session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self.node_cert.peer_context))
        self._client = ControlPlaneClient(self._control_plane_urls, self._session,
                                          trust=self._trust())
        guard = None
        # Only engines this agent really spawned get a guard: a fake process
        # control's pids may name unrelated processes.
        if isinstance(self.supervisor, Supervisor) and self.config.memory_guard != "off":
            tag = agent_tag(self.data_dir)
            guard = await asyncio.to_thread(MemoryGuard, tag, self.config.memory_guard)
            log.info("engines' memory budgets enforced by %s", guard.kind)
        self._deps = RunnerDeps(
            supervisor=self.supervisor,
            weights=self.weights,
            ports=self.ports,
            state=self.state,
            session=self._session,
            host=self.bind_host,
            on_change=self._changed.set,
            peers=lambda model: list(self._weight_peers.get(model, [])),
            peer_token=lambda: self._peer_token,
            stop_grace_s=self.config.stop_grace_s,
            liveness=self.config.liveness,
            memory=guard,
            peer_session=self._peer_session,
            engine_tls=self.tls.engine_tls,
            engine_probe_ssl=self.node_cert.engine_probe_context,
            engine_user=self.engine_user,
        )
        self.replicas.adopt(self.state.load(), self._deps)
        if self.config.serve_weights:
            self.server = WeightsServer(
                self.weights,
                lambda: self._peer_token,
                host=self.bind_host,
                port=self.config.server_port,
                node=self.config.name,
                on_nudge=self._changed.set,
                metrics=AgentMetrics(self).render,
                metrics_token=self.config.metrics_token,
            )
            await self.tls.open(self.server)

    async def run(self) -> None:
        """Report and converge until cancelled (or until ``shutdown``)."""
        self._run_task = asyncio.current_task()
        await self.start()
        backoff = Backoff(first_s=1.0, most_s=MAX_BACKOFF_S)
        while True:
            try:
                answer = await self.report_once()
            except (RegistrationRefused, ConfigError):
                # A wrong join token does not heal by retrying, nor does a
                # missing node token: a person must act.
                raise
            except Exception as exc:
                self._report_failed(exc, backoff)
                await self._wait_for_change(backoff.failed())
                continue
            backoff.succeeded()
            try:
                self.converge(answer)
            except Exception:  # never let one bad answer end the loop
                log.exception("cannot apply the control plane's answer")
            await self._wait_for_change(self._interval)

    def _report_failed(self, exc: Exception, backoff: Backoff) -> None:
        """Say why a report failed; forget a node token the control plane refused."""
        if isinstance(exc, ControlPlaneUnavailable):
            if exc.standby_answered:
                # A standby answered: a leader is being elected on a live
                # store. A new leader counts a node's silence from its
                # takeover, so a report held back 30 s would reach it at
                # the edge of the unreachable grace; the report interval
                # keeps the node well inside it.
                backoff.cap(self._interval)
            log.warning("%s; retrying in %.0f s", exc, backoff.next_s)
        elif isinstance(exc, AuthError):
            if self.identity is not None and self.config.join_token:
                log.warning("node token refused (%s); registering again", exc)
                self.identity = None
            else:
                log.error("%s", exc)
        elif isinstance(exc, ValidationError):
            log.error("%s", exc)
        else:
            # A bug must not end the loop: engines keep running unwatched
            # and the node would go unreachable for no good reason.
            log.exception("agent report failed")

    async def shutdown(self, stop_engines: bool = True) -> None:
        """End the loop; stop the engines, or leave them running for the next agent."""
        task, self._run_task = self._run_task, None
        if task is not None and task is not asyncio.current_task() and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.replicas.close(stop_engines)
        if self.server is not None:
            await self.server.stop()
            self.server = None
        if self._peer_session is not None:
            await self._peer_session.close()
            self._peer_session = None
        if self._session is not None:
            if self._session is not self._shared_session:
                await self._session.close()
            self._session = None
        if self._discoverer is not None:
            await asyncio.to_thread(self._discoverer.stop_watching)
        self._opened = False

    # -- one exchange ------------------------------------------------------------

    async def report_once(self) -> AgentReportAnswer:
        await self.start()
        client = self._require_client()
        self.inventory = await self._read_inventory()
        if self.identity is None:
            await self._register(client, self.inventory)
        identity = self.identity
        if identity is None:  # _register either sets it or raises
            raise AuthError("no node token")
        report = self.build_report(self.inventory)
        self._changed.clear()
        answer = await client.report(identity.node_token, report)
        self.reports_sent += 1
        if answer.node != self.config.name:
            raise ValidationError(f"answer is for node {answer.node!r}, not {self.config.name!r}")
        self._interval = max(0.2, answer.report_interval_s)
        self._peer_token = answer.peer_token
        self._weight_peers = dict(answer.weight_peers)
        self.weights.trust(answer.weight_digests)
        if await self.tls.take(answer, self.server):
            self._changed.set()
        return answer

    def _read_agent_key_hash(self) -> str | None:
        """The hash of this data dir's agent key (made now if missing), for reports.

        A node registered before agent keys learns its key from these. A key
        file that cannot be read must not stop a registered node's reports:
        it is said once, and the node keeps reporting without it.
        """
        try:
            return hash_secret(agent_key(self.data_dir))
        except ConfigError as exc:  # the message never holds the key
            log.warning("%s; reports go without the agent key's hash", exc)
            return None

    async def _register(self, client: ControlPlaneClient, inventory: NodeInventory) -> None:
        if not self.config.join_token:
            raise ConfigError(
                f"node {self.config.name!r} has no node token in {self.data_dir} and no join"
                " token was given (--join-token)"
            )
        # On disk before the registration leaves: if its answer is lost, the
        # next try sends the same key and the control plane lets it in again.
        key = await asyncio.to_thread(agent_key, self.data_dir)
        try:
            answer = await client.register(
                AgentRegistration(node=self.config.name, inventory=inventory, agent_key=key),
                split_join_token(self.config.join_token)[0],
            )
        except AuthError as exc:
            raise RegistrationRefused(
                f"the control plane refused the join token of node {self.config.name!r} ({exc})"
            ) from None
        if answer.node != self.config.name:
            raise AuthError(f"registered as {answer.node!r}, asked for {self.config.name!r}")
        self.identity = Identity(
            node=answer.node,
            node_token=answer.node_token,
            control_plane=self.config.control_plane,
        )
        save_identity(self.data_dir, self.identity)
        log.info("registered node %s with %s", answer.node, client.base_url)

    async def _read_inventory(self) -> NodeInventory:
        """This node's inventory; when discovery fails, the last one, with the failure."""
        try:
            inventory = await asyncio.to_thread(self._inventory_provider)
        except Exception as exc:
            message = f"discovery failed: {exc}"
            log.error("%s", message)
            last = self.inventory or NodeInventory(hostname=socket.gethostname())
            return last.model_copy(update={"warnings": [message]})
        # This machine's RAM and CPU, for placing CPU replicas (llmgw.memory);
        # only with real discovery: a fake inventory describes another machine.
        if inventory.memory_total_mib is None and self._discoverer is not None:
            if self._host_facts is None:
                ram, bf16 = await asyncio.to_thread(lambda: (node_memory_mib(), native_bf16()))
                self._host_facts = {"memory_total_mib": ram, "cpu_bf16": bf16}
            inventory = inventory.model_copy(update=self._host_facts)
        if self.config.engine_env_allow:
            allowed = sorted(self.config.engine_env_allow)
            inventory = inventory.model_copy(update={"engine_env_allow": allowed})
        return inventory

    def build_report(self, inventory: NodeInventory) -> AgentReport:
        return AgentReport(
            node=self.config.name,
            agent_version=_llmgw_version,
            address=self.config.address,
            fabrics=list(self.config.fabrics),
            inventory=inventory,
            replicas=[r.status() for r in self.runners.values()],
            weights=self.weights.report(),
            agent_port=self.server.port if self.server and self.server.running else None,
            refused=dict(self.replicas.refused),
            agent_key_hash=self._agent_key_hash,
            weights_refused=self.weights.take_refusals(),
            csr=self.tls.csr() if self.server is not None else None,
        )

    # -- convergence ---------------------------------------------------------------

    def converge(self, answer: AgentReportAnswer) -> None:
        """Run what the answer asks of this node (agent.replicaset)."""
        inventory = self.inventory or NodeInventory(hostname="unknown")
        self.replicas.prefetch.want(answer.prefetch, self._require_deps())
        if self.replicas.converge(answer.assignments, node=self.config.name,
                                  inventory=inventory, deps=self._require_deps()):
            self._changed.set()

    # -- helpers -------------------------------------------------------------------

    async def _wait_for_change(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        await asyncio.sleep(MIN_REPORT_GAP_S)  # a burst of changes makes one report
        remaining = deadline - time.monotonic()
        if remaining > 0:
            # asyncio.timeout: wait_for (3.11) can swallow a stop's cancel.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._changed.wait()

    def _trust(self) -> ClientTrust:
        """How this agent comes to trust an https:// control plane (llmgw.tls)."""
        carried = split_join_token(self.config.join_token)[1] if self.config.join_token else None
        given = self.config.ca_fingerprint
        return ClientTrust(
            ca_file=self.config.ca_file,
            ca_fingerprint=parse_fingerprint(given) if given else carried,
            store=self.data_dir / CA_CERT,
        )

    def _require_client(self) -> ControlPlaneClient:
        if self._client is None:
            raise ConfigError("agent not started")
        return self._client

    def _require_deps(self) -> RunnerDeps:
        if self._deps is None:
            raise ConfigError("agent not started")
        return self._deps

