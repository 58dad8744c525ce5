"""Everything a request needs, compiled once per config version.

A request reads one :class:`ConfigView` reference at its start and uses it to
the end, so a config update never shows it half-applied; building the next
snapshot costs what it costs once per version, never per request.

Long-lived state is carried across versions by identity: replicas (in-flight
counts, cool-downs) by replica id, prefix indexes and measured prefill speeds
by model name, key buckets by key id. A replica that disappears from the table
drops out of the registry; requests still in flight on it keep their own
reference and finish normally.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmgw import wire
from llmgw.gateway.checks.auth import KeyTable
from llmgw.gateway.external import renamer, upstream_key
from llmgw.gateway.routing.measured import PrefillSpeed
from llmgw.gateway.routing.prefixindex import PrefixIndex
from llmgw.gateway.routing.replica import Replica
from llmgw.gateway.routing.router import ModelRouter
from llmgw.gateway.routing.support import RouteSupport
from llmgw.gateway.settings import GatewaySettings


@dataclass(frozen=True, slots=True)
class ExternalEndpoint:
    """A URL of an external model, for the health prober (llmgw.gateway.health)."""

    model: str
    url: str
    replica: Replica
    # Why no key can be sent although the catalog names one (its variable
    # is not set here): the URL is down for this gateway until it is.
    key_problem: str | None


class ConfigView:
    def __init__(
        self,
        config: wire.GatewayConfig,
        settings: GatewaySettings,
        previous: ConfigView | None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.version = config.routing.version
        self.config = config
        old_replicas = previous.replicas if previous else {}
        old_indexes = previous.indexes if previous else {}
        old_speeds = previous.speeds if previous else {}
        self.replicas: dict[str, Replica] = {}
        self.indexes: dict[str, PrefixIndex] = {}
        self.speeds: dict[str, PrefillSpeed] = {}
        self.routes: dict[str, ModelRouter] = {}
        self.keys: KeyTable = KeyTable(config.keys, config.teams)
        # External models' URLs by replica id, and what puts the catalog's
        # name back into their answers (llmgw.gateway.external).
        self.external: dict[str, ExternalEndpoint] = {}
        self.renames: dict[str, Callable[[bytes], bytes]] = {}
        # Which replicas serve the routes not every engine has (llmgw.gateway.routing.support).
        self.support = RouteSupport()
        for route in config.routing.models:
            replicas = []
            for endpoint in route.endpoints:
                replica = self.replicas.get(endpoint.replica_id) or old_replicas.get(
                    endpoint.replica_id
                )
                if replica is None:
                    replica = Replica(endpoint)
                else:
                    replica.update(endpoint)
                if endpoint.external:
                    replica.engine_key, problem = upstream_key(endpoint.api_key_env,
                                                               settings.key_env_allowed)
                    self.external[endpoint.replica_id] = ExternalEndpoint(
                        route.name, endpoint.url, replica, problem
                    )
                    self.renames[route.name] = renamer(route.name)
                elif route.parent is not None and _names_adapters_by_number(endpoint):
                    # llama-server answers under its own name, the base's.
                    self.renames[route.name] = renamer(route.name)
                self.replicas[endpoint.replica_id] = replica
                replicas.append(replica)
            index = old_indexes.get(route.name) or PrefixIndex()
            self.indexes[route.name] = index
            speed = old_speeds.get(route.name) or PrefillSpeed(
                settings.prefill_tokens_per_s, settings.chars_per_token
            )
            self.speeds[route.name] = speed
            router = ModelRouter(
                route,
                replicas,
                index,
                speed,
                block_chars=settings.prefix_block_chars,
                chars_per_token=settings.chars_per_token,
                tokens_per_unit=settings.prefill_tokens_per_unit,
                ttft_slack_s=settings.ttft_slack_s,
                wait_ratio=settings.miss_wait_ratio,
                spread=settings.load_threshold,
                gateways=config.routing.gateways,  # counted by the control plane
                copy_cost=settings.prefix_copy_cost,
                clock=clock,
            )
            # The canonical name wins over another model's alias of the same spelling.
            for alias in route.aliases:
                self.routes.setdefault(alias, router)
            self.routes[route.name] = router
            self.support.add(route, router)
        self.model_list: list[dict[str, str | int]] = [
            model_entry(route) for route in config.routing.models
        ]

    def served_models(self) -> set[str]:
        """Names of models that have at least one endpoint in this snapshot."""
        return {r.route.name for r in self.routes.values() if r.replicas}

    def listing(self, allowed: frozenset[str] | None) -> dict[str, Any]:
        data = self.model_list
        if allowed is not None:
            data = [m for m in data if self._permits(str(m["id"]), allowed)]
        return {"object": "list", "data": data}

    def _permits(self, name: str, allowed: frozenset[str]) -> bool:
        router = self.routes.get(name)
        if router is None:
            return False
        return name in allowed or any(a in allowed for a in router.route.aliases)


def _names_adapters_by_number(endpoint: wire.Endpoint) -> bool:
    dialect = endpoint.dialect
    return dialect is not None and dialect.lora_ids is not None


def model_entry(route: wire.ModelRoute) -> dict[str, str | int]:
    """One model as /v1/models lists it; an adapter names its base as
    ``parent``, as vLLM lists the adapters it serves."""
    entry: dict[str, str | int] = {
        "id": route.name, "object": "model", "created": 0, "owned_by": "llmgw"
    }
    if route.parent is not None:
        entry["parent"] = route.parent
    return entry
