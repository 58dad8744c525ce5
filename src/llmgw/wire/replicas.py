"""The agent protocol: registration, reports, and the replicas a node must run.

The protocol between agent and control plane is declarative (DESIGN.md §1):
an agent sends an :class:`AgentReport` (what the node has and what its
replicas are doing) and receives an :class:`AgentReportAnswer` (the complete
set of replicas it should run). A lost message is healed by the next report,
so nothing depends on exactly-once delivery.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator

from llmgw.wire.base import (
    PROTOCOL_VERSION,
    Int64,
    ReplicaState,
    Wire,
    check_host,
    check_node_name,
)
from llmgw.wire.catalog import EngineDialect, ModelSpec
from llmgw.wire.inventory import NodeInventory
from llmgw.wire.weights import WeightsDigests, WeightsEntry


class ShardAssignment(Wire):
    """The part of a replica that runs on one node."""

    node: str
    rank: Int64 = 0
    device_numbers: list[Int64] = Field(default_factory=list)
    device_uuids: list[str] = Field(default_factory=list)


# An engine key goes into an HTTP header and an engine's environment: only
# characters that are safe in both (the control plane makes them URL-safe).
EngineKey = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{16,128}$")]


class ReplicaAssignment(Wire):
    """One replica the node must run, complete enough to start it from scratch.

    ``generation`` changes whenever the control plane wants the engine
    restarted (e.g. the model entry changed); same id and generation means
    "leave it running".
    """

    replica_id: str
    generation: Int64 = 1
    model: ModelSpec
    shard: ShardAssignment
    nodes: Int64 = 1
    # Address the rank-0 shard listens on for distributed init (multi-node).
    leader_address: str | None = None
    draining: bool = False
    # The replica's own engine key (DESIGN.md §6b): the engine is started with
    # it and refuses calls without it; only the gateways (Endpoint.engine_key)
    # and this node learn it. Kept out of repr, so a logged assignment never
    # shows it. None: no key (an assignment built by hand, e.g. in tests).
    engine_key: EngineKey | None = Field(None, repr=False)
    # LoRA adapters its engine should have loaded (their catalog entries, for
    # their weights and rank): the agent loads what is missing and unloads
    # the rest through the engine's runtime routes (agent.loras). Changing
    # the list restarts nothing.
    adapters: list[ModelSpec] = Field(default_factory=list)
    # Put the engine to sleep (weights to host RAM, device memory freed) or
    # keep it awake; changing it restarts nothing (agent.loras).
    asleep: bool = False


class DownloadProgress(Wire):
    bytes_done: Int64 = 0
    bytes_total: Int64 | None = None
    rate_bps: float = 0.0
    eta_s: float | None = None


class ReplicaStatus(Wire):
    """What the agent sees of one replica it runs."""

    replica_id: str
    generation: Int64 = 1
    state: ReplicaState
    port: int | None = Field(default=None, ge=0, le=65535)  # a column of the store
    pid: Int64 | None = None
    exit_code: Int64 | None = None
    reason: str | None = None  # why failed / what it is waiting for
    log_tail: list[str] = Field(default_factory=list)
    download: DownloadProgress | None = None
    started_at: float | None = None
    ready_at: float | None = None
    # What its engine's API gets wrong (the adapter's declaration); None from
    # an agent older than dialects.
    dialect: EngineDialect | None = None
    # The engine listens with TLS under the node's certificate (https://);
    # False: plain http (no certificate yet, an engine without TLS flags, an
    # agent older than engine TLS).
    tls: bool = False
    # The adapters its engine has loaded now, and those it could not load
    # with why (name -> reason, the last attempt's).
    adapters: list[str] = Field(default_factory=list)
    adapter_errors: dict[str, str] = Field(default_factory=dict)
    # Its engine is asleep (weights in host RAM): not to be routed to.
    sleeping: bool = False


class AgentRegistration(Wire):
    """First contact: a join token buys a node token, once per node name.

    ``agent_key`` is a secret the agent made for its data dir before it first
    registered. Without it, an agent whose answer was lost (a timeout, a reset
    after the control plane committed) would hold no node token while its
    name is taken, and a person would have to delete the node. With it, the
    same data dir may register its node again; the join token alone never
    can, or any holder of it could take over a running node's identity.

    The join token travels in the ``Authorization`` header, where the control
    plane checks it before it reads this body (docs/security.md, Limits).
    ``join_token`` here is for callers inside the control plane's process;
    over HTTP it may only repeat the header's.
    """

    node: str
    join_token: str | None = Field(default=None, max_length=512)
    inventory: NodeInventory | None = None
    # Long enough to be unguessable: the control plane trusts it as a credential.
    agent_key: str | None = Field(default=None, min_length=32, max_length=256)

    @field_validator("node")
    @classmethod
    def _node_name(cls, value: str) -> str:
        return check_node_name(value)


class AgentRegistrationAnswer(Wire):
    node: str
    node_token: str


class AgentReport(Wire):
    protocol: Int64 = PROTOCOL_VERSION
    node: str
    agent_version: str = ""
    # Where engines on this node can be reached by the gateway (host only).
    address: str = "127.0.0.1"
    fabrics: list[str] = Field(default_factory=list)
    inventory: NodeInventory
    replicas: list[ReplicaStatus] = Field(default_factory=list)
    weights: list[WeightsEntry] = Field(default_factory=list)
    # Port of the agent's own HTTP server (weights for peers), when it runs one.
    agent_port: int | None = Field(default=None, ge=0, le=65535)  # a column of the store
    # Replica ids the agent refused, with the reason (malformed assignment).
    refused: dict[str, str] = Field(default_factory=dict)
    # Weights copies refused since the last report (a peer's file that did
    # not match the recorded digests), one sentence each, for the events.
    weights_refused: list[str] = Field(default_factory=list, max_length=64)
    # The hash (llmgw.secrets.hash_secret) of this data dir's agent key. A
    # node registered before agent keys has none stored, so an agent of it
    # whose registration answer is lost could never register again; the
    # report (authenticated by the node token) gives it one. The hash, not
    # the key: the key then never travels outside a registration.
    agent_key_hash: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    # A PEM certificate request for the agent's server (llmgw.nodetls): sent
    # when the node has no certificate from this fleet's CA for its address,
    # or its certificate is due for renewal; None otherwise.
    csr: str | None = Field(default=None, max_length=4096)

    @field_validator("node")
    @classmethod
    def _node_name(cls, value: str) -> str:
        return check_node_name(value)

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        return check_host(value)

    @field_validator("fabrics")
    @classmethod
    def _fabrics(cls, value: list[str]) -> list[str]:
        if len(value) > 16:
            raise ValueError(f"{len(value)} fabrics: a node belongs to at most 16")
        for fabric in value:
            check_node_name(fabric, "fabric name")
        return value


class AgentReportAnswer(Wire):
    node: str
    assignments: list[ReplicaAssignment] = Field(default_factory=list)
    report_interval_s: float = 5.0
    # Peers of the same fabric that hold weights, for peer-to-peer copies:
    # model name -> list of "http(s)://host:port" agent URLs.
    weight_peers: dict[str, list[str]] = Field(default_factory=dict)
    # Shared secret that agents present to each other (Bearer) when copying
    # weights peer to peer; None: this agent serves no weights to anyone.
    # Without it any host on the management network could read the weights.
    peer_token: str | None = None
    # model name -> what its weights must be; every copy is verified against
    # it. A model missing here is fetched from its origin only.
    weight_digests: dict[str, WeightsDigests] = Field(default_factory=dict)
    # This control plane issues node certificates (llmgw.nodetls): the
    # agent's server listens only with one, and peers' URLs are https://.
    # False: the fleet runs plain (loopback, --insecure-http) or serve holds
    # no CA key; the agent's server is plain HTTP.
    node_tls: bool = False
    # The certificate the report's CSR asked for (PEM), with the CA that
    # signed it (peers' certificates are checked against it); or why none.
    certificate: str | None = None
    certificate_ca: str | None = None
    certificate_refused: str | None = None
    # LoRA adapters of the base models this node runs, whose weights it
    # should fetch before any is asked for (agent.prefetch): a load then
    # costs the engine's read, not a download.
    prefetch: list[ModelSpec] = Field(default_factory=list)


# The control plane POSTs here on an agent's own server (llmgw.agent.server)
# when the node's assignments changed, so the agent reports now rather than
# at its next interval (llmgw.control.nudge).
NUDGE_PATH = "/agent/v1/nudge"
