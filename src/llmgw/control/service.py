"""The control plane's operations, shared by its HTTP APIs and by ``llmgw up``.

Everything that changes fleet state goes through :class:`ControlPlane`: agent
reports, gateway load and demand, catalog and node operations, credentials.
Each method updates the in-memory :class:`FleetState` and writes what must
survive a restart to the store, so the HTTP layers stay thin and the same
rules hold whichever API a change came through.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from llmgw import secrets
from llmgw.control import approval, external
from llmgw.control.catalog import engine_changed
from llmgw.control.enginekeys import EngineKeys
from llmgw.control.inflight import InFlightBook, StoredActivity
from llmgw.control.jointokens import DEFAULT_TTL_S as DEFAULT_JOIN_TTL_S
from llmgw.control.jointokens import SETTING as JOIN_TOKENS
from llmgw.control.jointokens import JoinToken, JoinTokens
from llmgw.control.leader import Leadership
from llmgw.control.metrics import ControlMetrics
from llmgw.control.nodecerts import Issued, NodeCertificates
from llmgw.control.reconciler import unpark
from llmgw.control.registration import agent_key_hash, check_registering_again
from llmgw.control.reports import apply_report, assignments_for, weight_peers
from llmgw.control.rows import (
    gpu_rows,
    key_from_row,
    model_from_row,
    model_row,
    node_from_row,
    node_row,
    replica_from_row,
    replica_row,
)
from llmgw.control.scheduler.decisions import Policy
from llmgw.control.standby import LeaderHint
from llmgw.control.state import (
    UNREACHABLE_AFTER_S,
    FleetState,
    ModelRecord,
    NodeRecord,
    ReplicaRecord,
)
from llmgw.control.store.repo import Row, Store
from llmgw.control.weightdigests import SETTING as WEIGHT_DIGESTS
from llmgw.control.weightdigests import DigestBook
from llmgw.control.writes import FencedWrites
from llmgw.errors import AuthError, NotFoundError, StandbyError, ValidationError
from llmgw.wire import (
    AgentRegistration,
    AgentRegistrationAnswer,
    AgentReport,
    AgentReportAnswer,
    ApiKeyInfo,
    Endpoint,
    EngineKind,
    GatewayConfig,
    GatewayLoadReport,
    ModelRoute,
    ModelSpec,
    NodeState,
    ReplicaLoad,
    ReplicaState,
    RoutingTable,
    UsageRecord,
    host_in_url,
)

log = logging.getLogger(__name__)

ADMIN_HASH = "admin_token_hash"
JOIN_HASH = "join_token_hash"
GATEWAY_HASH = "gateway_token_hash"

# Heartbeats are written in batches: 2,000 agents reporting every 5 s would
# otherwise be 400 write transactions a second for a value only read after a
# restart. Losing a few seconds of last_seen in a crash is harmless.
HEARTBEAT_FLUSH_S = 5.0
REPORT_INTERVAL_S = 5.0
# Mean requests in flight per ready replica above which the gateway's load
# asks for one more replica (bounded by the model's max_replicas).
SCALE_UP_IN_FLIGHT = 8.0


def _same(before: list[Endpoint], now: list[Endpoint]) -> bool:
    """The same endpoint objects, in the same order."""
    return len(before) == len(now) and all(a is b for a, b in zip(before, now, strict=True))


def served_name(spec: ModelSpec) -> str:
    """The name the upstream knows the model by: what the gateway puts in request bodies."""
    if spec.external is not None and spec.external.model:
        return spec.external.model
    return spec.name


@dataclass
class NewCredentials:
    """Secrets created on first start; shown once, stored only as hashes."""

    admin_token: str | None = None
    join_token: str | None = None
    gateway_token: str | None = None
    api_key: str | None = None
    api_key_id: str | None = None


class ControlPlane:
    def __init__(
        self, store: Store, state: FleetState | None = None, leadership: Leadership | None = None
    ) -> None:
        self.store = store  # reads; every write goes through self.writes
        # Leads (and its writes carry no epoch) until an election owns this:
        # a control plane with no election (tests, benchmarks, embedding) is
        # the only instance. ControlPlaneRuntime hands it to its election,
        # which makes it a standby until it wins.
        self.leadership = leadership or Leadership()
        self.writes = FencedWrites(store, self.leadership)
        self.state = state or FleetState()
        # The reconciler's knobs (scheduler.decisions.Policy): the runtime's
        # reconciler and the admin plan read this one object, so a plan
        # parks and backs off as the passes it predicts do.
        self.policy = Policy()
        self._pending_heartbeats: dict[str, float] = {}
        self._keys: dict[str, ApiKeyInfo] = {}
        self._gateway_config: GatewayConfig | None = None
        self._gateway_config_version = -1
        # The last table's endpoints and routes with what they were built
        # from, by replica id and model name (gateway_config reuses them).
        self._endpoints: dict[str, tuple[tuple[object, ...], Endpoint]] = {}
        self._routes: dict[str, tuple[tuple[object, ...], ModelRoute]] = {}
        # watch_config holds a new table until then (monotonic).
        self._config_quiet_until = 0.0
        self._reconcile_wakeup = asyncio.Event()
        self._admin_hash: str | None = None
        self.join_tokens = JoinTokens()
        # serve --approve-nodes: new nodes wait for an operator (llmgw.control.approval).
        self.approve_nodes = False
        # serve --trust-reported-fabrics: a report's fabrics are used unless
        # pinned; without it they are only a proposal (reports.apply_report).
        self.trust_reported_fabrics = False
        # The expiry of join tokens made without one (the first one, rotations).
        self.join_token_ttl_s: float | None = DEFAULT_JOIN_TTL_S
        self._gateway_hash: str | None = None
        self._node_by_token_hash: dict[str, str] = {}
        # Nodes unreachable at the last look (note_reachability); None before it.
        self._unreachable: frozenset[str] | None = None
        # Requests in flight per replica and gateway (memory only, re-learnt).
        self._in_flight = InFlightBook()
        # What the store holds of each replica's use, so a standby's views
        # see busy replicas busy (flush_activity).
        self._stored_activity = StoredActivity()
        # The last set of other nodes' replica ids each node reported on.
        self._foreign_reported: dict[str, list[str]] = {}
        # What each model's weights must be (llmgw.control.weightdigests).
        self.digests = DigestBook(
            lambda document: self.writes.set_setting(WEIGHT_DIGESTS, document),
            self.event,
        )
        # The secret agents present to each other when copying weights. Kept
        # in memory only and handed out with every report: a restart rotates
        # it, and agents pick the new one up on their next report.
        self.peer_token = secrets.new_secret("llmgw-peer-")
        # Each replica's engine key (control.enginekeys); the stored seed
        # replaces this one in load().
        self.engine_keys = EngineKeys()
        # Certificates for agents' servers (control.nodecerts); serve gives
        # it the fleet CA's key where the fleet runs TLS.
        self.node_certs = NodeCertificates()
        # The last refusal of a certificate per node, so each is an event once.
        self._certificate_refused: dict[str, str] = {}
        self.leader_hint = LeaderHint(store)
        # Counted here and rendered on scrape (llmgw.control.metrics).
        self.metrics = ControlMetrics()
        # External models' endpoint ids (control.external), per routing version.
        self._external_index: dict[str, tuple[str, str]] = {}
        self._external_index_version = -1

    # -- start-up ------------------------------------------------------------

    async def load(self, *, leading: bool = False) -> None:
        """Read the durable state into memory (at start and on becoming leader).

        ``leading``: this instance is taking over. Requests in flight are then
        learnt again from the gateways' reports, not from the store: a count
        its predecessor stored just before dying would otherwise pin a
        replica as busy until some gateway reported it. And a node's silence
        counts from now at the earliest: nobody could hear it meanwhile.
        """
        state = self.state
        state.nodes.clear()
        state.models.clear()
        state.replicas.clear()
        for row in await self.store.list_nodes():
            state.nodes[row["name"]] = node_from_row(row)
        for row in await self.store.list_models():
            record = model_from_row(row)
            state.models[record.name] = record
        for row in await self.store.list_replicas():
            replica = replica_from_row(row)
            state.replicas[replica.id] = replica
        self._stored_activity.stored(
            {r.id: (r.in_flight, r.last_request_at) for r in state.replicas.values()}
        )
        if leading:
            for replica in state.replicas.values():
                replica.in_flight = 0
            # No node could report while no instance led (NodeRecord.listening_since).
            began = time.time()
            for node in state.nodes.values():
                node.listening_since = began
        await self._load_keys()
        self._admin_hash = await self.store.get_setting(ADMIN_HASH)
        await self._load_join_tokens()
        for name in approval.parse(await self.store.get_setting(approval.SETTING)):
            if name in state.nodes:
                state.nodes[name].pending_approval = True
        for name in approval.parse(await self.store.get_setting(approval.PINNED_SETTING)):
            if name in state.nodes:
                state.nodes[name].fabrics_pinned = True
        self._gateway_hash = await self.store.get_setting(GATEWAY_HASH)
        self.engine_keys = await EngineKeys.load(self.store)
        self.digests.load(await self.store.get_setting(WEIGHT_DIGESTS))
        await state.bump_routing()

    async def ensure_credentials(self, *, first_api_key: bool = True) -> NewCredentials:
        """Create whatever credential is missing; return the new plaintexts."""
        created = NewCredentials()
        for key, prefix, attr in (
            (ADMIN_HASH, secrets.ADMIN_PREFIX, "admin_token"),
            (GATEWAY_HASH, secrets.GATEWAY_PREFIX, "gateway_token"),
        ):
            secret = secrets.new_secret(prefix)
            if await self.store.set_setting_if_absent(key, secrets.hash_secret(secret)):
                setattr(created, attr, secret)
        if first_api_key and not await self.store.list_api_keys():
            info, secret = await self.create_api_key(name="first key")
            created.api_key, created.api_key_id = secret, info.key_id
        self._admin_hash = await self.store.get_setting(ADMIN_HASH)
        await self._load_join_tokens()
        if not self.join_tokens.tokens:
            fresh = JoinTokens()
            _, secret = fresh.create(self.join_token_ttl_s, description="first")
            if await self.store.set_setting_if_absent(JOIN_TOKENS, fresh.dump()):
                created.join_token = secret
            await self._load_join_tokens()
        self._gateway_hash = await self.store.get_setting(GATEWAY_HASH)
        return created

    async def _load_join_tokens(self) -> None:
        self.join_tokens = JoinTokens.parse(
            await self.store.get_setting(JOIN_TOKENS), await self.store.get_setting(JOIN_HASH)
        )

    async def _save_join_tokens(self) -> None:
        await self.writes.set_setting(JOIN_TOKENS, self.join_tokens.dump())

    async def rotate_join_token(self) -> str:
        """Revoke every join token and make one new one (default expiry)."""
        self.require_leader()
        self.join_tokens.revoke_all()
        token, secret = self.join_tokens.create(self.join_token_ttl_s, description="rotated")
        await self._save_join_tokens()
        await self.event("credentials", "join-token",
                         f"join tokens rotated: all revoked, {token.id} made")
        return secret

    async def rotate_token(self, kind: Literal["admin", "gateway"]) -> str:
        """A new admin or gateway token; the old one stops working at once.

        At once on this instance; a standby reads the new hash with its next
        refresh (every few seconds). Gateways holding the old gateway token
        keep serving the routes they know and fail to sync until given the
        new one, so rotate it with the new token ready to hand out.
        """
        self.require_leader()
        prefix, setting = ((secrets.ADMIN_PREFIX, ADMIN_HASH) if kind == "admin"
                           else (secrets.GATEWAY_PREFIX, GATEWAY_HASH))
        secret = secrets.new_secret(prefix)
        digest = secrets.hash_secret(secret)
        await self.writes.set_setting(setting, digest)
        if kind == "admin":
            self._admin_hash = digest
        else:
            self._gateway_hash = digest
        await self.event("credentials", f"{kind}-token", f"{kind} token rotated")
        return secret

    async def create_join_token(
        self, *, ttl_s: float | None, max_uses: int | None = None, description: str = ""
    ) -> tuple[JoinToken, str]:
        """One more join token; the secret is in the answer and nowhere else."""
        self.require_leader()
        token, secret = self.join_tokens.create(ttl_s, max_uses, description)
        await self._save_join_tokens()
        await self.event("credentials", "join-token", f"join token {token.id} made")
        return token, secret

    async def revoke_join_token(self, token_id: str) -> JoinToken:
        self.require_leader()
        token = self.join_tokens.revoke(token_id)
        await self._save_join_tokens()
        await self.event("credentials", "join-token", f"join token {token_id} revoked")
        return token

    @property
    def is_leader(self) -> bool:
        return self.leadership.is_leader

    @is_leader.setter
    def is_leader(self, leading: bool) -> None:
        self.leadership.is_leader = leading

    @property
    def epoch(self) -> int:
        return self.leadership.epoch or 0

    def require_leader(self) -> None:
        """Refuse a write on a standby (llmgw.control.standby says why)."""
        if not self.is_leader:
            raise StandbyError("this control-plane instance is a standby")

    # -- credentials checks ----------------------------------------------------

    def is_admin(self, token: str | None) -> bool:
        return bool(token and self._admin_hash and secrets.matches(token, self._admin_hash))

    def is_gateway(self, token: str | None) -> bool:
        # The admin token may act as a gateway too: an operator running a
        # standalone gateway by hand should not need a second secret.
        if token and self._gateway_hash and secrets.matches(token, self._gateway_hash):
            return True
        return self.is_admin(token)

    def node_for_token(self, token: str | None) -> NodeRecord:
        """The node a token speaks for.

        Looked up by hash: the tokens are 256 random bits, so comparing their
        SHA-256 digests through a dict leaks nothing a timing attack could use,
        and it keeps a report from hashing once per node of the fleet.
        """
        if not token:
            raise AuthError("a node token is required")
        digest = secrets.hash_secret(token)
        name = self._node_by_token_hash.get(digest)
        if name is None:
            self._node_by_token_hash = {
                n.token_hash: n.name for n in self.state.nodes.values() if n.token_hash
            }
            name = self._node_by_token_hash.get(digest)
        node = self.state.nodes.get(name) if name else None
        if node is None or node.token_hash != digest:
            raise AuthError("unknown node token")
        return node

    # -- agents -------------------------------------------------------------

    async def register(self, reg: AgentRegistration) -> AgentRegistrationAnswer:
        self.require_leader()
        now = time.time()
        if self.join_tokens.find(reg.join_token) is None:
            raise AuthError("invalid join token")
        existing = self.state.nodes.get(reg.node)
        registered = existing if existing is not None and existing.token_hash else None
        if registered is not None:
            # Only its own agent, whose answer was lost: it gets a fresh token
            # and the node keeps its state, GPUs and replicas (see
            # llmgw.control.registration for why the join token is not enough).
            check_registering_again(registered, reg.agent_key)
        join = self.join_tokens.check(reg.join_token, now, retry=registered is not None)
        if registered is None:
            # Counted (and written) before the node exists: a crash in between
            # costs a use, never grants one more.
            join.uses += 1
            await self._save_join_tokens()
        token = secrets.new_secret(secrets.NODE_PREFIX)
        node = existing or NodeRecord(name=reg.node, registered_at=time.time())
        node.token_hash = secrets.hash_secret(token)  # the old token stops working
        if registered is None:
            node.agent_key_hash = agent_key_hash(reg.agent_key)
            if self.approve_nodes:
                node.pending_approval = True
                node.admin_state = NodeState.CORDONED
        if reg.inventory is not None:
            node.inventory = reg.inventory
        self.state.nodes[node.name] = node
        await self.writes.upsert_nodes([node_row(node)])
        if reg.inventory is not None:
            await self.writes.replace_gpus(node.name, gpu_rows(reg.inventory))
        if registered is not None:
            await self.event("node", node.name, f"node {node.name} registered again by its"
                             " own agent (same agent key); its previous node token is revoked")
        elif node.pending_approval:
            await self.writes.set_setting(approval.SETTING, approval.dump(self.state.nodes))
            await self.event("node", node.name, f"node {node.name} registered; held cordoned"
                             f" until approved (llmgw ctl nodes approve {node.name})")
        else:
            await self.event("node", node.name, f"node {node.name} registered")
        return AgentRegistrationAnswer(node=node.name, node_token=token)

    async def approve_node(self, name: str) -> NodeRecord:
        """Accept a node held by --approve-nodes: uncordon it and let it copy weights."""
        self.require_leader()
        node = self.state.nodes.get(name)
        if node is None:
            raise NotFoundError(f"node {name!r} does not exist")
        if not node.pending_approval:
            raise ValidationError(f"node {name} is not waiting for approval", field="node")
        node.pending_approval = False
        node.admin_state = NodeState.READY
        # Accepted as it showed itself: the fabrics it reported are pinned.
        node.fabrics_pinned = True
        node.fabrics = list(node.reported_fabrics)
        await self.writes.upsert_nodes([node_row(node)])
        await self.writes.set_setting(approval.SETTING, approval.dump(self.state.nodes))
        await self._save_pinned_fabrics()
        await self.event("node", name, f"node {name} approved (fabrics:"
                         f" {','.join(node.fabrics) or 'none'})")
        self.wake_reconciler()
        return node

    async def set_node_fabrics(self, name: str, fabrics: list[str] | None) -> NodeRecord:
        """Pin a node's fabrics (reports stop changing them), or None: its reports decide."""
        self.require_leader()
        node = self.state.nodes.get(name)
        if node is None:
            raise NotFoundError(f"node {name!r} does not exist")
        if fabrics is None:
            node.fabrics_pinned = False
            node.fabrics = list(node.reported_fabrics) if self.trust_reported_fabrics else []
            message = (f"node {name} takes its fabrics from its reports again"
                       if self.trust_reported_fabrics else f"node {name} fabrics unset")
        else:
            node.fabrics_pinned = True
            node.fabrics = list(fabrics)
            message = f"node {name} fabrics set to {','.join(fabrics) or 'none'}"
        await self.writes.upsert_nodes([node_row(node)])
        await self._save_pinned_fabrics()
        await self.event("node", name, message)
        self.wake_reconciler()
        return node

    async def _save_pinned_fabrics(self) -> None:
        pinned = approval.dump_pinned(self.state.nodes)
        await self.writes.set_setting(approval.PINNED_SETTING, pinned)

    async def report(self, node: NodeRecord, report: AgentReport) -> AgentReportAnswer:
        """Take in a node's report; answer with everything it must run."""
        self.require_leader()
        if report.node != node.name:
            raise AuthError(f"this token speaks for node {node.name!r}, not {report.node!r}")
        now = time.time()
        effects = apply_report(
            self.state, node, report, now, trust_reported_fabrics=self.trust_reported_fabrics,
            vouch=lambda entries: self.digests.vouched(self.state, entries),
        )
        if effects.write_node:
            await self.writes.upsert_nodes([node_row(node)])
        else:
            self._pending_heartbeats[node.name] = now
        if effects.write_gpus:
            await self.writes.replace_gpus(node.name, gpu_rows(report.inventory))
        if effects.replicas:
            await self.writes.write_replicas([replica_row(r) for r in effects.replicas])
        if effects.agent_key_recorded:
            await self.event("node", node.name, f"node {node.name} recorded its agent's key"
                             " from a report; its agent may now register it again")
        if effects.foreign and self._foreign_reported.get(node.name) != effects.foreign:
            # Once per distinct set, not once per report every 5 s.
            log.warning("node %s reported on replicas not assigned to it (ignored): %s",
                        node.name, ", ".join(effects.foreign))
            await self.event("node", node.name, f"node {node.name} reported on replicas not"
                             " assigned to it; ignored", replicas=effects.foreign)
        self._foreign_reported[node.name] = effects.foreign
        issued = await self._certificate(node, report)
        await self.digests.take_report(self.state, node, report)
        if effects.wake_reconciler:
            self.wake_reconciler()
        if effects.routing_changed:
            await self.state.bump_routing()
        return AgentReportAnswer(
            node=node.name,
            assignments=assignments_for(self.state, node.name, self.engine_keys.key),
            report_interval_s=REPORT_INTERVAL_S,
            # A node waiting for approval reads no one's weights.
            weight_peers={} if node.pending_approval else weight_peers(
                self.state, node, self.digests.records, self.node_certs.scheme
            ),
            weight_digests=self.digests.for_node(self.state, node),
            peer_token=None if node.pending_approval else self.peer_token,
            node_tls=self.node_certs.enabled,
            certificate=issued.certificate,
            certificate_ca=(self.node_certs.issuer.ca_pem.decode("ascii")
                            if issued.certificate and self.node_certs.issuer else None),
            certificate_refused=issued.refused,
        )

    async def _certificate(self, node: NodeRecord, report: AgentReport) -> Issued:
        """The certificate a report's CSR asked for, or why not (an event once per reason)."""
        if report.csr is None or not self.node_certs.enabled:
            self._certificate_refused.pop(node.name, None)
            return Issued()
        issued = self.node_certs.issue(self.state, node, report.csr)
        if issued.refused is None:
            self._certificate_refused.pop(node.name, None)
        elif self._certificate_refused.get(node.name) != issued.refused:
            self._certificate_refused[node.name] = issued.refused
            log.warning("no server certificate for node %s: %s", node.name, issued.refused)
            await self.event("node", node.name, f"node {node.name} gets no server certificate:"
                             f" {issued.refused}; its server stays down until it has one")
        return issued

    async def note_reachability(self, now: float) -> None:
        """Act on nodes turning unreachable (or back) by time passing alone.

        No event announces that reports stopped: without this look, the
        gateways' routing table kept a dead node's replicas until something
        else changed it, and every request to them failed. A change rebuilds
        the table and wakes the reconciler, which replaces a lost replica at
        once if its model has no other (scheduler/triage.py).
        """
        unreachable = self.state.unreachable_nodes(now)
        before, self._unreachable = self._unreachable, unreachable
        if unreachable == before:
            return
        for name in sorted(unreachable - (before or frozenset())):
            if before is not None:
                await self.event("node", name, f"node {name} is unreachable: no report for"
                                 f" more than {UNREACHABLE_AFTER_S:g} s")
        await self.state.bump_routing()
        self.wake_reconciler()

    async def flush_heartbeats(self) -> None:
        pending, self._pending_heartbeats = self._pending_heartbeats, {}
        await self.writes.touch_nodes(pending)

    async def flush_activity(self) -> int:
        """Store the use of replicas whose stored use is out of date (the leader's only).

        Called every HEARTBEAT_FLUSH_S: at most one row update per replica per
        flush, and for a replica busy for long, one per ACTIVITY_SLACK_S
        (control.inflight). Returns the number of rows written.
        """
        if not self.is_leader:
            return 0
        current = {r.id: (r.in_flight, r.last_request_at) for r in self.state.replicas.values()}
        due = self._stored_activity.due(current)
        if due:
            await self.writes.touch_replicas(due)
            self._stored_activity.stored(due)
        return len(due)

    # -- gateway link ---------------------------------------------------------

    def gateway_config(self) -> GatewayConfig:
        """The routing table and keys, rebuilt only when something changed."""
        version = self.state.routing_version
        if self._gateway_config is not None and self._gateway_config_version == version:
            return self._gateway_config
        began = time.monotonic()
        now = time.time()
        nodes = self.state.nodes
        # Which nodes are down, once per table, not once per replica shard.
        down = {name for name, node in nodes.items() if node.state(now) is NodeState.UNREACHABLE}
        routes: list[ModelRoute] = []
        endpoints_before, self._endpoints = self._endpoints, {}
        routes_before, self._routes = self._routes, {}
        for model in sorted(self.state.models.values(), key=lambda m: m.name):
            spec = model.spec
            endpoints = external.endpoints(spec) or [
                self._endpoint(endpoints_before, r, spec)
                for r in sorted(self.state.replicas_of(model.name), key=lambda r: r.id)
                # FleetState.routable, with the down nodes looked up once.
                if r.state is ReplicaState.READY and r.port is not None
                and all(s.node in nodes and s.node not in down for s in r.shards)
            ]
            # Built again only when something in it changed: 10,000 replicas'
            # worth of validated objects per change was most of a busy control
            # plane's CPU (bench/reports.py, py-spy).
            key = (tuple(spec.aliases), spec.on_demand, spec.routing, served_name(spec),
                   spec.max_output_tokens, model.parked, model.last_error)
            kept = routes_before.get(model.name)
            if kept is not None and kept[0] == key and _same(kept[1].endpoints, endpoints):
                route = kept[1]
            else:
                route = ModelRoute(
                    name=model.name,
                    aliases=list(spec.aliases),
                    on_demand=spec.on_demand,
                    routing=spec.routing,
                    served_name=served_name(spec),
                    endpoints=endpoints,
                    parked=model.parked,
                    parked_reason=model.last_error if model.parked else None,
                    max_output_tokens=spec.max_output_tokens,
                )
            self._routes[model.name] = (key, route)
            routes.append(route)
        issuer = self.node_certs.issuer
        config = GatewayConfig(
            routing=RoutingTable(
                version=version,
                models=routes,
                engine_ca=issuer.ca_pem.decode("ascii") if issuer is not None else None,
            ),
            keys=list(self._keys.values()),
        )
        self._gateway_config, self._gateway_config_version = config, version
        took = time.monotonic() - began
        # Rebuilt at most a quarter of the time (watch_config waits out the rest).
        self._config_quiet_until = time.monotonic() + 3 * took
        return config

    def _endpoint(
        self, before: dict[str, tuple[tuple[object, ...], Endpoint]], replica: ReplicaRecord,
        spec: ModelSpec,
    ) -> Endpoint:
        """The replica's endpoint: the last table's object while nothing in it changed."""
        url = (f"{self._engine_scheme(replica, spec)}://"
               f"{host_in_url(self.state.nodes[replica.leader_node].address)}:{replica.port}")
        key = (url, spec.kv_capacity_tokens, replica.dialect)
        kept = before.get(replica.id)
        if kept is not None and kept[0] == key:
            endpoint = kept[1]
        else:
            endpoint = Endpoint(replica_id=replica.id, url=url,
                                kv_capacity_tokens=spec.kv_capacity_tokens,
                                dialect=replica.dialect,
                                engine_key=self.engine_keys.key(replica.id))
        self._endpoints[replica.id] = (key, endpoint)
        return endpoint

    def _engine_scheme(self, replica: ReplicaRecord, spec: ModelSpec) -> str:
        """http or https, as the replica's agent reported its engine listens.

        Until that agent reports again after this instance started (a restart,
        a standby taking over), a fleet that issues node certificates assumes
        https, as its agents start every engine that can with TLS, except
        SGLang's, which never does; the next report (seconds) corrects the
        rest (llama-server, engines started before their node's certificate).
        """
        if replica.tls is None:
            return "http" if spec.engine == EngineKind.SGLANG else self.node_certs.scheme
        return "https" if replica.tls else "http"

    async def watch_config(self, after_version: int, wait_s: float = 25.0) -> GatewayConfig:
        """The config once it is newer than ``after_version``, or after ``wait_s``."""
        cond = self.state.changed()
        if self.state.routing_version <= after_version:
            async with cond:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        cond.wait_for(lambda: self.state.routing_version > after_version),
                        wait_s,
                    )
        # A table that takes long to build is not built back to back: a burst
        # of changes (every replica's first report after a restart changes
        # routing) once kept a 10,000-node control plane rebuilding it with
        # three quarters of its CPU, its reports starved. A small table, built
        # in a millisecond, is never held (a cold start's waiters see it at once).
        wait = self._config_quiet_until - time.monotonic()
        if wait > 0 and self._gateway_config_version != self.state.routing_version:
            await asyncio.sleep(wait)
        return self.gateway_config()

    async def demand(self, model_name: str) -> None:
        self.require_leader()
        model = self.state.resolve_model(model_name)
        if model is None:
            raise NotFoundError(f"model {model_name!r} does not exist")
        first = model.demand_at is None or not any(
            r.state != ReplicaState.FAILED for r in self.state.replicas_of(model.name)
        )
        model.demand_at = time.time()
        # The pass reads demand from memory: woken first, it places the
        # replica while the demand is written, instead of after (two store
        # writes, 20-100 ms of a cold start here, measured by bench/coldstart.py).
        self.wake_reconciler()
        if first:
            await self.writes.upsert_models([model_row(model)])
            await self.event("demand", model.name, f"a request asked for {model.name}")

    async def record_load(self, report: GatewayLoadReport) -> None:
        self.require_leader()
        now = time.time()
        self._in_flight.forget_except(self.state.replicas)
        per_model: dict[str, list[int]] = {}
        for load in report.replicas:
            replica = self.state.replicas.get(load.replica_id)
            if replica is None:
                if load.up is not None:
                    self._note_external(report.gateway_id, load, now)
                continue
            # Summed over gateways: each reports only the requests it proxies.
            replica.in_flight = self._in_flight.record(
                replica.id, report.gateway_id, load.in_flight, now
            )
            if replica.in_flight > 0:
                # In use now: a request that has run for an hour ends an hour
                # after it was sent, and idle time counts from its end.
                replica.last_request_at = max(replica.last_request_at or 0.0, now)
            if load.last_request_at and (
                replica.last_request_at is None or load.last_request_at > replica.last_request_at
            ):
                replica.last_request_at = load.last_request_at
                model = self.state.models.get(replica.model)
                if model is not None:
                    model.demand_at = max(model.demand_at or 0.0, load.last_request_at)
            per_model.setdefault(replica.model, []).append(replica.in_flight)
        for name, loads in per_model.items():
            model = self.state.models.get(name)
            if model is None:
                continue
            mean = sum(loads) / max(1, len(loads))
            wanted = 1 if mean > SCALE_UP_IN_FLIGHT else 0
            if wanted != model.load_demand:
                model.load_demand = wanted
                self.wake_reconciler()
        for name, waiting in report.waiting.items():
            # A model deleted since the gateway's last config is no reason to
            # drop the rest of its report.
            if waiting > 0 and self.state.resolve_model(name) is not None:
                await self.demand(name)

    def _note_external(self, gateway_id: str, load: ReplicaLoad, now: float) -> None:
        """One gateway's probe of an external model's URL (control.external)."""
        if self._external_index_version != self.state.routing_version:
            self._external_index = external.index([m.spec for m in self.state.models.values()])
            self._external_index_version = self.state.routing_version
        found = self._external_index.get(load.replica_id)
        model = self.state.models.get(found[0]) if found is not None else None
        if found is None or model is None or load.up is None:
            return  # a URL removed since that gateway's config
        probe = external.Probe(up=load.up, reason=load.reason, at=now)
        external.record(model.endpoint_health, found[1], gateway_id, probe)

    async def record_usage(self, records: Iterable[UsageRecord]) -> None:
        await self.writes.add_usage([r.model_dump() for r in records])

    # -- catalog ------------------------------------------------------------

    async def put_models(self, specs: list[ModelSpec]) -> tuple[list[str], list[str]]:
        """Add or replace catalog entries (already validated). Returns (added, changed)."""
        self.require_leader()
        now = time.time()
        added: list[str] = []
        changed: list[str] = []
        rows: list[Row] = []
        bumps: list[ReplicaRecord] = []
        for spec in specs:
            current = self.state.models.get(spec.name)
            if current is None:
                record = ModelRecord(spec=spec, created_at=now, updated_at=now)
                added.append(spec.name)
            elif current.spec != spec:
                record = current
                # A changed entry restarts its replicas with the new settings,
                # unless only what the gateway reads changed (the routing
                # table carries that): a new output cap restarts no engine.
                if engine_changed(record.spec, spec):
                    # Draining and failed ones are on their way out already.
                    for replica in self.state.replicas_of(spec.name):
                        if replica.can_move_to(ReplicaState.STARTING):
                            replica.restart()
                            bumps.append(replica)
                record.spec = spec
                record.updated_at = now
                changed.append(spec.name)
            else:
                continue
            self.state.models[spec.name] = record
            rows.append(model_row(record))
        await self.writes.upsert_models(rows)
        if bumps:
            await self.writes.write_replicas([replica_row(r) for r in bumps])
        for name in added:
            await self.event("catalog", name, f"model {name} added")
        for name in changed:
            await self.event("catalog", name, f"model {name} changed")
        if rows:
            await self.state.bump_routing()
            self.wake_reconciler()
        return added, changed

    async def delete_model(self, name: str) -> None:
        self.require_leader()
        if name not in self.state.models:
            raise NotFoundError(f"model {name!r} does not exist")
        doomed = [r.id for r in self.state.replicas_of(name)]
        await self.writes.write_replicas([], doomed)
        await self.writes.delete_models([name])
        for replica_id in doomed:
            del self.state.replicas[replica_id]
        del self.state.models[name]
        await self.event("catalog", name, f"model {name} deleted with {len(doomed)} replica(s)")
        await self.state.bump_routing()

    async def unpark(self, name: str) -> None:
        self.require_leader()
        model = unpark(self.state, name)
        await self.writes.upsert_models([model_row(model)])
        await self.event("unpark", name, f"model {name} unparked")
        await self.state.bump_routing()
        self.wake_reconciler()

    # -- nodes --------------------------------------------------------------

    async def set_node_state(self, name: str, target: NodeState) -> NodeRecord:
        self.require_leader()
        node = self.state.nodes.get(name)
        if node is None:
            raise NotFoundError(f"node {name!r} does not exist")
        if target == NodeState.UNREACHABLE:
            raise ValidationError("a node cannot be set unreachable", field="state")
        if node.pending_approval and target == NodeState.READY:
            raise ValidationError(f"node {name} waits for approval: llmgw ctl nodes approve"
                                  f" {name}", field="state")
        if node.admin_state != target:
            node.admin_state = target
            await self.writes.upsert_nodes([node_row(node)])
            verb = {"ready": "uncordoned", "cordoned": "cordoned", "draining": "draining"}
            await self.event("drain" if target == NodeState.DRAINING else "node", name,
                             f"node {name} {verb[target.value]}")
            self.wake_reconciler()
        return node

    async def delete_node(self, name: str) -> None:
        self.require_leader()
        if name not in self.state.nodes:
            raise NotFoundError(f"node {name!r} does not exist")
        await self.writes.delete_node(name)
        removed = self.state.nodes.pop(name)
        if removed.pending_approval:
            await self.writes.set_setting(approval.SETTING, approval.dump(self.state.nodes))
        if removed.fabrics_pinned:
            await self._save_pinned_fabrics()
        await self.event("node", name, f"node {name} removed")
        self.wake_reconciler()

    async def drain_replica(self, replica_id: str) -> ReplicaRecord:
        self.require_leader()
        replica = self.state.replicas.get(replica_id)
        if replica is None:
            raise NotFoundError(f"replica {replica_id!r} does not exist")
        if replica.draining:
            return replica  # asked twice: nothing more to do
        replica.move_to(ReplicaState.DRAINING, replica.reason)
        await self.writes.write_replicas([replica_row(replica)])
        await self.event("drain", replica.model, f"replica {replica_id} draining on request")
        await self.state.bump_routing()
        self.wake_reconciler()
        return replica

    # -- API keys -----------------------------------------------------------

    async def _load_keys(self) -> None:
        self._keys = {}
        for row in await self.store.list_api_keys():
            info = key_from_row(row)
            self._keys[info.key_id] = info

    async def create_api_key(
        self,
        *,
        name: str = "",
        models: list[str] | None = None,
        expires_at: float | None = None,
        rpm: int | None = None,
        tpm: int | None = None,
    ) -> tuple[ApiKeyInfo, str]:
        self.require_leader()
        secret = secrets.new_secret(secrets.API_KEY_PREFIX)
        info = ApiKeyInfo(
            key_id=secrets.new_id(12),
            name=name,
            secret_hash=secrets.hash_secret(secret),
            models=list(models or []),
            expires_at=expires_at,
            rpm=rpm,
            tpm=tpm,
        )
        await self.writes.add_api_key(
            {
                "id": info.key_id,
                "name": info.name,
                "secret_hash": info.secret_hash,
                "models": info.models,
                "expires_at": info.expires_at,
                "rpm": info.rpm,
                "tpm": info.tpm,
                "revoked": False,
                "created_at": time.time(),
            }
        )
        self._keys[info.key_id] = info
        await self.event("key", info.key_id, f"API key {info.key_id} ({name}) created")
        await self.state.bump_routing()
        return info, secret

    def list_api_keys(self) -> list[ApiKeyInfo]:
        return list(self._keys.values())

    async def revoke_api_key(self, key_id: str) -> None:
        self.require_leader()
        if key_id not in self._keys or not await self.writes.revoke_api_key(key_id):
            raise NotFoundError(f"API key {key_id!r} does not exist")
        self._keys[key_id] = self._keys[key_id].model_copy(update={"revoked": True})
        await self.event("key", key_id, f"API key {key_id} revoked")
        await self.state.bump_routing()

    # -- events and reconciler wake-ups ----------------------------------------

    async def event(self, kind: str, subject: str, message: str, **data: object) -> None:
        await self.writes.add_events(
            [{"at": time.time(), "kind": kind, "subject": subject, "message": message,
              "data": {k: v for k, v in data.items()}}]
        )

    def wake_reconciler(self) -> None:
        self._reconcile_wakeup.set()

    async def wait_for_wakeup(self, at_most_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._reconcile_wakeup.wait(), at_most_s)
        self._reconcile_wakeup.clear()
