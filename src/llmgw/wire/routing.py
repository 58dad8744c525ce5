"""Routing table (control plane -> gateway), load and usage (gateway -> control plane)."""

from __future__ import annotations

from pydantic import Field, model_validator

from llmgw.wire.base import Wire
from llmgw.wire.catalog import ENV_NAME_PATTERN, EngineDialect, ModelPrice, RoutingPolicy
from llmgw.wire.replicas import EngineKey
from llmgw.wire.tenancy import TeamInfo, TenantLimits

# Where an engine guard relays its engine's KV-cache events (llmgw.kvstream.PATH,
# spelt again here because wire imports nothing outside it; a test pins the two).
KV_EVENTS_PATH = "/llmgw/kv-events"


def kv_events_url(url: str) -> str:
    """The events relay of the replica whose engine is at ``url``."""
    return url.rstrip("/") + KV_EVENTS_PATH


class Endpoint(Wire):
    replica_id: str
    url: str  # base URL of the engine's OpenAI API, without /v1
    kv_capacity_tokens: int = 32768
    # What the gateway mends for this engine; None: an agent too old to say,
    # served unmended as before. Per endpoint, not per model: one model may
    # run as llama-server on one node and llama_cpp.server on another.
    dialect: EngineDialect | None = None
    # What the gateway sends as ``Authorization: Bearer`` to this engine
    # (ReplicaAssignment.engine_key); never passed on to a client.
    engine_key: EngineKey | None = Field(None, repr=False)
    # A server llmgw does not run (ModelSpec.external): the gateway probes
    # it itself and takes it out of routing while it is down.
    external: bool = False
    # The environment variable, on the gateway, that holds the key to send
    # (ExternalSpec.api_key_env): the name travels, never the key.
    api_key_env: str | None = Field(None, pattern=ENV_NAME_PATTERN)
    # Where the replica's engine guard relays its KV-cache block events
    # (vLLM's, published on its node only): ``url`` + KV_EVENTS_PATH, and
    # nowhere else, since the gateway sends it the engine key. The gateway
    # follows them and routes on what the replica really holds. None: it
    # publishes none, and the gateway's estimate of its cache is used
    # (gateway.routing.kvcache).
    kv_events: str | None = Field(None, max_length=2048)

    @model_validator(mode="after")
    def _kv_events_on_the_replica(self) -> Endpoint:
        if self.kv_events is not None and self.kv_events != kv_events_url(self.url):
            raise ValueError(
                f"kv_events must be the replica's own relay, {kv_events_url(self.url)!r}, "
                f"not {self.kv_events!r}: the engine key goes there, and an engine's events "
                "are reachable only through its guard"
            )
        return self


class ModelRoute(Wire):
    name: str
    aliases: list[str] = Field(default_factory=list)
    on_demand: bool = False
    routing: RoutingPolicy = "prefix"
    # The engine's own name for the model (what goes into the upstream body).
    served_name: str
    endpoints: list[Endpoint] = Field(default_factory=list)
    parked: bool = False
    parked_reason: str | None = None
    # The catalog's max_output_tokens (see ModelSpec).
    max_output_tokens: int | None = None
    # A LoRA adapter's base model (ModelSpec.base), listed as vLLM lists
    # one; its endpoints are the base's replicas that have it loaded.
    parent: str | None = None
    # The catalog's price (ModelSpec.price): what budgets are spent at.
    price: ModelPrice | None = None
    # Requests one replica runs at once (ModelSpec.max_concurrency, or the
    # engine's setting); None: no cap, the gateway holds nothing back.
    max_concurrency: int | None = Field(None, ge=1)


class RoutingTable(Wire):
    """Everything the gateway needs to route, as one versioned snapshot.

    Snapshots, not deltas: a gateway that missed an update is healed by the
    next one, and one that loses the control plane keeps the last it had.
    """

    version: int
    models: list[ModelRoute] = Field(default_factory=list)
    # PEM of the CA that signs node certificates, which the https:// endpoints
    # of engines llmgw runs present (not external ones: the system's CAs
    # verify those); None in a fleet that issues none.
    engine_ca: str | None = None
    # How many gateways route with this table: those whose load reports the
    # control plane received in the last 30 s, 0 while it cannot tell yet
    # (just started or took over). A gateway that knows it is the only one
    # places a new prefix by load alone; with others, or not knowing, it
    # places it where every gateway would (gateway.routing.SoonestStart).
    gateways: int = Field(0, ge=0)


class ReplicaLoad(Wire):
    replica_id: str
    in_flight: int = 0
    last_request_at: float | None = None  # unix time
    requests: int = 0  # since the last report
    # An external endpoint (Endpoint.external) as this gateway's probes see
    # it: True up, False down (``reason`` says why), None never probed yet
    # or not external.
    up: bool | None = None
    reason: str | None = Field(None, max_length=500)


class GatewayLoadReport(Wire):
    gateway_id: str
    replicas: list[ReplicaLoad] = Field(default_factory=list)
    # Models with requests waiting for a replica (on-demand start), with how
    # many are waiting.
    waiting: dict[str, int] = Field(default_factory=dict)
    # Models whose requests ended since the last report, with when the last
    # one did (unix time): an adapter's use, which its base replica's own
    # last request cannot tell apart from its siblings'.
    used: dict[str, float] = Field(default_factory=dict)


class DemandRequest(Wire):
    """The gateway asks for a replica of an on-demand model."""

    model: str


class UsageRecord(Wire):
    """Usage of one key on one model in one minute."""

    minute: int  # unix time // 60 * 60
    key_id: str
    model: str
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    errors: int = 0


class ApiKeyInfo(TenantLimits):
    """An API key as the gateway needs it: the hash, never the secret.

    Its limits (TenantLimits) hold beside its team's: a request needs room
    under both.
    """

    key_id: str
    name: str = ""
    secret_hash: str
    models: list[str] = Field(default_factory=list)  # empty: all models
    expires_at: float | None = None
    revoked: bool = False
    # None: the operator's key, under no team's models or limits.
    team_id: str | None = None


class GatewayConfig(Wire):
    """Keys and routing, as a standalone gateway's watch stream sends them."""

    routing: RoutingTable
    keys: list[ApiKeyInfo] = Field(default_factory=list)
    teams: list[TeamInfo] = Field(default_factory=list)

