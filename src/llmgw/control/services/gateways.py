"""The gateways' feed: the routing table and keys out, load, demand and usage in.

The table is rebuilt only when the routing version moved, and each endpoint
and route in it is the last table's object while what it was built from is
unchanged: 10,000 replicas' worth of validated objects per change was most
of a busy control plane's CPU (bench/reports.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable

from llmgw.control import external
from llmgw.control.adapters import adapter_load_demand
from llmgw.control.concurrency import replica_concurrency
from llmgw.control.gateway_count import GatewayCount, LastReport
from llmgw.control.inflight import InFlightBook
from llmgw.control.services.catalog import Catalog
from llmgw.control.services.core import Core
from llmgw.control.services.keys import ApiKeys
from llmgw.control.services.teams import Teams
from llmgw.control.state import ReplicaRecord
from llmgw.sleepmode import sleeps_by_itself
from llmgw.wire import (
    Endpoint,
    EngineDialect,
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
    kv_events_url,
)

# Mean requests in flight per ready replica above which the gateway's load
# asks for one more replica (bounded by the model's max_replicas).
SCALE_UP_IN_FLIGHT = 8.0


def _same(before: list[Endpoint], now: list[Endpoint]) -> bool:
    """The same endpoint objects, in the same order."""
    return len(before) == len(now) and all(a is b for a, b in zip(before, now, strict=True))


def adapter_routable(replica: ReplicaRecord, adapter: str) -> bool:
    """The replica's engine has ``adapter`` loaded and is not about to unload it."""
    return adapter in replica.loaded_adapters and adapter in (replica.adapters or ())


def served_name(spec: ModelSpec) -> str:
    """The name the upstream knows the model by: what the gateway puts in request bodies."""
    if spec.external is not None and spec.external.model:
        return spec.external.model
    return spec.name


class Gateways:
    def __init__(self, core: Core, keys: ApiKeys, catalog: Catalog, teams: Teams) -> None:
        self.core = core
        self.keys = keys
        self.teams = teams
        self.catalog = catalog
        self._gateway_config: GatewayConfig | None = None
        self._gateway_config_version = -1
        # The last table's endpoints and routes with what they were built
        # from, by replica id and model name (config reuses them).
        self._endpoints: dict[str, tuple[tuple[object, ...], Endpoint]] = {}
        self._routes: dict[str, tuple[tuple[object, ...], ModelRoute]] = {}
        # watch holds a new table until then (monotonic).
        self._config_quiet_until = 0.0
        # Requests in flight per replica and gateway (memory only, re-learnt).
        self._in_flight = InFlightBook()
        # Gateways reporting now, which the table tells them (memory only).
        self._gateway_count = GatewayCount()
        # External models' endpoint ids (control.external), per routing version.
        self._external_index: dict[str, tuple[str, str]] = {}
        self._external_index_version = -1

    def config(self) -> GatewayConfig:
        """The routing table and keys, rebuilt only when something changed."""
        version = self.core.state.routing_version
        if self._gateway_config is not None and self._gateway_config_version == version:
            return self._gateway_config
        began = time.monotonic()
        now = time.time()
        nodes = self.core.state.nodes
        # Which nodes are down, once per table, not once per replica shard.
        down = {name for name, node in nodes.items() if node.state(now) is NodeState.UNREACHABLE}
        routes: list[ModelRoute] = []
        endpoints_before, self._endpoints = self._endpoints, {}
        routes_before, self._routes = self._routes, {}
        for model in sorted(self.core.state.models.values(), key=lambda m: m.name):
            spec = model.spec
            # An adapter is served by its base's replicas that have it loaded.
            serving = self.core.state.models.get(spec.base) if spec.base else model
            engine_spec = serving.spec if serving is not None else spec
            # llama-server wakes itself for a request: asleep, it is still sent
            # them, and the first pays a reload instead of a round trip here.
            wakes = sleeps_by_itself(engine_spec)
            endpoints = external.endpoints(spec) or [
                self._endpoint(endpoints_before, r, engine_spec)
                for r in sorted(
                    self.core.state.replicas_of(engine_spec.name), key=lambda r: r.id
                )
                # FleetState.routable, with the down nodes looked up once.
                if r.state is ReplicaState.READY and r.port is not None and (r.awake or wakes)
                and all(s.node in nodes and s.node not in down for s in r.shards)
                and (spec.base is None or adapter_routable(r, spec.name))
            ]
            # Built again only when something in it changed: 10,000 replicas'
            # worth of validated objects per change was most of a busy control
            # plane's CPU (bench/reports.py, py-spy).
            key = (tuple(spec.aliases), spec.on_demand, spec.routing, served_name(spec),
                   spec.max_output_tokens, spec.price, model.parked, model.last_error,
                   spec.base, replica_concurrency(engine_spec))
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
                    parent=spec.base,
                    price=spec.price,
                    # The replicas' engine's (an adapter's are its base's).
                    max_concurrency=key[-1],
                )
            self._routes[model.name] = (key, route)
            routes.append(route)
        issuer = self.core.node_certs.issuer
        config = GatewayConfig(
            routing=RoutingTable(
                version=version,
                models=routes,
                engine_ca=issuer.ca_pem.decode("ascii") if issuer is not None else None,
                gateways=self._gateway_count.count,
            ),
            keys=self.keys.all(),
            teams=self.teams.all(),
        )
        self._gateway_config, self._gateway_config_version = config, version
        took = time.monotonic() - began
        # Rebuilt at most a quarter of the time (watch waits out the rest).
        self._config_quiet_until = time.monotonic() + 3 * took
        return config

    def _endpoint(
        self, before: dict[str, tuple[tuple[object, ...], Endpoint]], replica: ReplicaRecord,
        spec: ModelSpec,
    ) -> Endpoint:
        """The replica's endpoint: the last table's object while nothing in it changed."""
        host = host_in_url(self.core.state.nodes[replica.leader_node].address)
        url = f"{self._engine_scheme(replica, spec)}://{host}:{replica.port}"
        key = (url, spec.kv_capacity_tokens, replica.dialect)
        kept = before.get(replica.id)
        if kept is not None and kept[0] == key:
            endpoint = kept[1]
        else:
            endpoint = Endpoint(replica_id=replica.id, url=url,
                                kv_capacity_tokens=spec.kv_capacity_tokens,
                                dialect=replica.dialect,
                                engine_key=self.core.engine_keys.key(replica.id),
                                kv_events=_kv_events(url, replica.dialect))
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
            return "http" if spec.engine == EngineKind.SGLANG else self.core.node_certs.scheme
        return "https" if replica.tls else "http"

    async def watch(self, after_version: int, wait_s: float = 25.0) -> GatewayConfig:
        """The config once it is newer than ``after_version``, or after ``wait_s``."""
        cond = self.core.state.changed()
        if self.core.state.routing_version <= after_version:
            # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancel
            # that lands in the turn the table moves, and the watching loop
            # (the in-process gateway, a long poll) went round again instead of
            # stopping (tests/control/test_watch_cancel.py).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s), cond:
                    await cond.wait_for(lambda: self.core.state.routing_version > after_version)
        # A table that takes long to build is not built back to back: a burst
        # of changes (every replica's first report after a restart changes
        # routing) once kept a 10,000-node control plane rebuilding it with
        # three quarters of its CPU, its reports starved. A small table, built
        # in a millisecond, is never held (a cold start's waiters see it at once).
        wait = self._config_quiet_until - time.monotonic()
        if wait > 0 and self._gateway_config_version != self.core.state.routing_version:
            await asyncio.sleep(wait)
        return self.config()

    async def record_load(self, report: GatewayLoadReport) -> None:
        self.core.require_leader()
        now = time.time()
        self._in_flight.forget_except(self.core.state.replicas)
        per_model: dict[str, list[int]] = {}
        # For the list of gateways (admin API); summed in this loop, as a
        # second pass over 9,500 replicas per report per gateway is not free.
        gateway_in_flight = 0
        for load in report.replicas:
            gateway_in_flight += load.in_flight
            replica = self.core.state.replicas.get(load.replica_id)
            if replica is None:
                if load.up is not None:
                    self._note_external(report.gateway_id, load, now)
                continue
            # Summed over gateways: each reports only the requests it proxies.
            in_flight = self._in_flight.record(replica.id, report.gateway_id, load.in_flight, now)
            # Assigned only when it moved: a record logs every assignment
            # (writelog.py), and each gateway's report every second names
            # every replica (9,500 at 10,000 nodes), nearly all unchanged.
            if in_flight != replica.in_flight:
                replica.in_flight = in_flight
            if replica.in_flight > 0:
                # In use now: a request that has run for an hour ends an hour
                # after it was sent, and idle time counts from its end.
                replica.last_request_at = max(replica.last_request_at or 0.0, now)
            if load.last_request_at and (
                replica.last_request_at is None or load.last_request_at > replica.last_request_at
            ):
                replica.last_request_at = load.last_request_at
                model = self.core.state.models.get(replica.model)
                if model is not None:
                    model.demand_at = max(model.demand_at or 0.0, load.last_request_at)
            used_at = replica.last_request_at or 0.0
            if replica.asleep and used_at > (replica.asleep_since or 0.0):
                # Used while asleep (an engine that wakes for a request, which
                # was sent it): the next pass marks it awake (control.sleep).
                model = self.core.state.models.get(replica.model)
                if model is not None and (model.demand_at or 0.0) < used_at:
                    model.demand_at = used_at
                    self.core.wake_reconciler()
            per_model.setdefault(replica.model, []).append(replica.in_flight)
        if self._gateway_count.heard(report.gateway_id, time.monotonic(),
                                     in_flight=gateway_in_flight, waiting=report.waiting):
            # Rare (a gateway started or gone), and each gateway's routing
            # depends on it, so it goes out as a new table.
            await self.core.state.bump_routing()
        for name, loads in per_model.items():
            model = self.core.state.models.get(name)
            if model is None:
                continue
            mean = sum(loads) / max(1, len(loads))
            wanted = 1 if mean > SCALE_UP_IN_FLIGHT else 0
            if wanted != model.load_demand:
                model.load_demand = wanted
                self.core.wake_reconciler()
        for name, at in report.used.items():
            # An adapter's use is its recency on its base's replicas
            # (control.adapters: kept while used, least recently used out
            # first); the replica's own last request cannot tell adapters apart.
            used = self.core.state.resolve_model(name)
            if used is not None and used.spec.base is not None:
                used.demand_at = max(used.demand_at or 0.0, min(at, now))
                wanted = adapter_load_demand(self.core.state, used, SCALE_UP_IN_FLIGHT)
                if wanted != used.load_demand:
                    used.load_demand = wanted
                    self.core.wake_reconciler()
        for name, waiting in report.waiting.items():
            # A model deleted since the gateway's last config is no reason to
            # drop the rest of its report.
            if waiting > 0 and self.core.state.resolve_model(name) is not None:
                await self.catalog.demand(name)

    def reporting(self, now: float) -> tuple[int, dict[str, LastReport]]:
        """The count the routing table carries, and the gateways not stale at ``now``
        (monotonic), by id. A standby hears no reports (they are the leader's)."""
        return self._gateway_count.count, self._gateway_count.reporting(now)

    def _note_external(self, gateway_id: str, load: ReplicaLoad, now: float) -> None:
        """One gateway's probe of an external model's URL (control.external)."""
        if self._external_index_version != self.core.state.routing_version:
            self._external_index = external.index([m.spec for m in self.core.state.models.values()])
            self._external_index_version = self.core.state.routing_version
        found = self._external_index.get(load.replica_id)
        model = self.core.state.models.get(found[0]) if found is not None else None
        if found is None or model is None or load.up is None:
            return  # a URL removed since that gateway's config
        probe = external.Probe(up=load.up, reason=load.reason, at=now)
        external.record(model.endpoint_health, found[1], gateway_id, probe)

    async def record_usage(self, records: Iterable[UsageRecord]) -> None:
        """Store usage with the key's team and the spend at the catalog's prices now."""
        keys = {k.key_id: k for k in self.keys.all()}
        models = self.core.state.models
        rows = []
        for record in records:
            key = keys.get(record.key_id)
            model = models.get(record.model)
            price = model.spec.price if model is not None else None
            spend = price.cost(record.prompt_tokens, record.completion_tokens) if price else 0.0
            rows.append({**record.model_dump(), "team_id": key.team_id if key else None,
                         "spend_usd": spend})
        await self.core.writes.add_usage(rows)


def _kv_events(url: str, dialect: EngineDialect | None) -> str | None:
    """Where the replica's guard relays its engine's KV-cache events: on the replica's
    own address, behind its engine key (agent.kvrelay)."""
    if dialect is None or not dialect.kv_events:
        return None
    return kv_events_url(url)
