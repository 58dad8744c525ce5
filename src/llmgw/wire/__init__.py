"""Types that cross a process boundary: agent <-> control plane <-> gateway <-> ctl.

Every part of llmgw imports its messages from here and from nowhere else, so
a field renamed on one side is a type error on the other instead of a silent
``None`` at run time. Nothing in this package does I/O.

The modules go by subject; import from ``llmgw.wire``, not from them:

- :mod:`~llmgw.wire.base`: the :class:`Wire` base, reading a newer sender,
  states, node and host names;
- :mod:`~llmgw.wire.inventory`: what a node has (agent -> control plane);
- :mod:`~llmgw.wire.weights`: where weights come from and what they must be;
- :mod:`~llmgw.wire.catalog`: catalog entries and engine dialects;
- :mod:`~llmgw.wire.replicas`: the agent protocol (DESIGN.md §1);
- :mod:`~llmgw.wire.routing`: routing table, load, usage and keys (gateway);
- :mod:`~llmgw.wire.events`: the fleet's events;
- :mod:`~llmgw.wire.errorbody`: the error body every API answers, and the
  standby's pointer to the leader.
"""

from llmgw.wire.base import (
    LLAMACPP_KINDS,
    PRIORITY_CLASSES,
    PROTOCOL_VERSION,
    EngineKind,
    NodeState,
    PriorityClass,
    ReplicaState,
    Wire,
    check_host,
    check_node_name,
    host_in_url,
    read_from_newer,
)
from llmgw.wire.catalog import (
    ENV_NAME_PATTERN,
    EXTRA_ROUTES,
    NAME_PATTERN,
    AdapterSpec,
    ChatTemplate,
    EngineDialect,
    ExternalSpec,
    ExtraRoute,
    ModelPrice,
    ModelSpec,
    RoutingPolicy,
    SimParams,
    check_external_url,
)
from llmgw.wire.errorbody import LEADER_HEADER, STANDBY_CODE, ErrorBody, ErrorDetail
from llmgw.wire.events import Event
from llmgw.wire.inventory import (
    CPU_CLASS,
    MIG_CLASS_MARKER,
    MIG_NUMBER_BASE,
    Device,
    GpuProcess,
    MigInfo,
    NodeInventory,
    device_label,
    device_label_on,
    is_mig_class,
    mig_number,
)
from llmgw.wire.replicas import (
    NUDGE_PATH,
    AgentRegistration,
    AgentRegistrationAnswer,
    AgentReport,
    AgentReportAnswer,
    DownloadProgress,
    EngineKey,
    ReplicaAssignment,
    ReplicaStatus,
    ShardAssignment,
)
from llmgw.wire.routing import (
    KV_EVENTS_PATH,
    ApiKeyInfo,
    DemandRequest,
    Endpoint,
    GatewayConfig,
    GatewayLoadReport,
    ModelRoute,
    ReplicaLoad,
    RoutingTable,
    UsageRecord,
    kv_events_url,
)
from llmgw.wire.tenancy import (
    LIMIT_KINDS,
    AllowanceAnswer,
    AllowanceReport,
    AllowanceShare,
    AllowanceUse,
    BudgetPeriod,
    LimitKind,
    TeamInfo,
    TenantLimits,
)
from llmgw.wire.weights import WeightsDigests, WeightsEntry, WeightsFile, WeightsSource

__all__ = [
    "CPU_CLASS",
    "ENV_NAME_PATTERN",
    "EXTRA_ROUTES",
    "KV_EVENTS_PATH",
    "LEADER_HEADER",
    "LIMIT_KINDS",
    "LLAMACPP_KINDS",
    "MIG_CLASS_MARKER",
    "MIG_NUMBER_BASE",
    "NAME_PATTERN",
    "NUDGE_PATH",
    "PRIORITY_CLASSES",
    "PROTOCOL_VERSION",
    "STANDBY_CODE",
    "AdapterSpec",
    "AgentRegistration",
    "AgentRegistrationAnswer",
    "AgentReport",
    "AgentReportAnswer",
    "AllowanceAnswer",
    "AllowanceReport",
    "AllowanceShare",
    "AllowanceUse",
    "ApiKeyInfo",
    "BudgetPeriod",
    "ChatTemplate",
    "DemandRequest",
    "Device",
    "DownloadProgress",
    "Endpoint",
    "EngineDialect",
    "EngineKey",
    "EngineKind",
    "ErrorBody",
    "ErrorDetail",
    "Event",
    "ExternalSpec",
    "ExtraRoute",
    "GatewayConfig",
    "GatewayLoadReport",
    "GpuProcess",
    "LimitKind",
    "MigInfo",
    "ModelPrice",
    "ModelRoute",
    "ModelSpec",
    "NodeInventory",
    "NodeState",
    "PriorityClass",
    "ReplicaAssignment",
    "ReplicaLoad",
    "ReplicaState",
    "ReplicaStatus",
    "RoutingPolicy",
    "RoutingTable",
    "ShardAssignment",
    "SimParams",
    "TeamInfo",
    "TenantLimits",
    "UsageRecord",
    "WeightsDigests",
    "WeightsEntry",
    "WeightsFile",
    "WeightsSource",
    "Wire",
    "check_external_url",
    "check_host",
    "check_node_name",
    "device_label",
    "device_label_on",
    "host_in_url",
    "is_mig_class",
    "kv_events_url",
    "mig_number",
    "read_from_newer",
]
