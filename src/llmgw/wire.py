"""Types that cross a process boundary: agent <-> control plane <-> gateway <-> ctl.

Every part of llmgw imports its messages from here and from nowhere else, so
a field renamed on one side is a type error on the other instead of a silent
``None`` at run time. Nothing in this module does I/O.

The protocol between agent and control plane is declarative (DESIGN.md §1):
an agent sends an :class:`AgentReport` (what the node has and what its
replicas are doing) and receives an :class:`AgentReportAnswer` (the complete
set of replicas it should run). A lost message is healed by the next report,
so nothing depends on exactly-once delivery.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from enum import StrEnum
from typing import Annotated, Literal, TypeVar
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

PROTOCOL_VERSION = 1

# Names users type (models, aliases, nodes, fabrics) end up in URLs, log lines
# and engine argv items; keeping them to a plain alphabet means none of them can
# ever be mistaken for an option, a path or a shell word.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$"
_NAME_RE = re.compile(NAME_PATTERN)


class Wire(BaseModel):
    """Base for every message: unknown fields are refused, not ignored.

    An agent newer than its control plane (or a typo in a catalog entry)
    should fail loudly with the field's name rather than lose the setting.
    """

    model_config = ConfigDict(extra="forbid", frozen=False, populate_by_name=True)


_W = TypeVar("_W", bound=Wire)


def read_from_newer(kind: type[_W], body: bytes | str) -> tuple[_W, list[str]]:
    """``body`` as ``kind``, tolerating fields added by a newer sender; and their names.

    The control plane is upgraded before its agents and gateways (docs/
    operations.md), so for a while it answers them with fields they do not
    know. Refusing those answers, as :class:`Wire` refuses everything else,
    would stop every node mid-upgrade; the reader ignores them instead and
    names them, so the caller can say once that it is older than its
    control plane. Any other fault still raises ``pydantic.ValidationError``.
    """
    try:
        return kind.model_validate_json(body), []
    except ValidationError as exc:
        errors = exc.errors()
        unknown = [".".join(map(str, e["loc"])) for e in errors if e["type"] == "extra_forbidden"]
        if len(unknown) != len(errors):
            raise
    return kind.model_validate_json(body, extra="ignore"), unknown


# ---------------------------------------------------------------------------
# States (fixed by DESIGN.md §3)
# ---------------------------------------------------------------------------


class NodeState(StrEnum):
    READY = "ready"
    CORDONED = "cordoned"
    DRAINING = "draining"
    UNREACHABLE = "unreachable"


class ReplicaState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


class EngineKind(StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"
    LLAMACPP = "llamacpp"
    SIM = "sim"
    # Not run by llmgw: servers that already exist (ModelSpec.external).
    EXTERNAL = "external"


CPU_CLASS = "cpu"
MIG_CLASS_MARKER = "-mig-"
MIG_NUMBER_BASE = 1000


def is_mig_class(gpu_class: str) -> bool:
    return MIG_CLASS_MARKER in gpu_class


def mig_number(card_index: int, instance: int) -> int:
    """The placement number of a MIG instance: ``1000 + 100 x card + instance``.

    Instances need numbers that can never collide with a card index and still
    say which card they live on; ``card/migN`` is how they are shown.
    """
    return MIG_NUMBER_BASE + 100 * card_index + instance


# Node and fabric names reach URLs (``/admin/v1/nodes/NAME``), log lines,
# tables in ``llmgw ctl`` and the console: a narrower alphabet than model
# names (no ``/``, ``:``, ``@``, no brackets), so none of them can split a URL
# path, pass for Rich markup or HTML, or be mistaken for an option.
NODE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_NODE_NAME_RE = re.compile(NODE_NAME_PATTERN)
_HOST_LABEL_RE = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")


def check_node_name(value: str, what: str = "node name") -> str:
    """``value`` if it is a valid node or fabric name; ValueError saying why not."""
    if not _NODE_NAME_RE.match(value):
        raise ValueError(
            f"{value!r} is not a valid {what}: use letters, digits and . _ -, starting"
            " with a letter or digit, at most 128 characters"
        )
    return value


def check_host(value: str) -> str:
    """``value`` if it is a bare host name or IP address; ValueError saying why not.

    A node's address is where the gateway sends prompts and peers send the
    peer token; it goes between ``http://`` and ``:port``, so a scheme, a
    port, a path or user info in it would aim those requests somewhere else.
    """
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    labels = value.split(".")
    if len(value) > 253 or not all(_HOST_LABEL_RE.match(label) for label in labels):
        raise ValueError(
            f"{value!r} is not a host name or IP address (no scheme, port, path or user"
            " info; e.g. 10.0.0.5 or gpu-01.example.com)"
        )
    return value


def host_in_url(address: str) -> str:
    """The address as it goes between ``scheme://`` and ``:port`` (IPv6 bracketed)."""
    return f"[{address}]" if ":" in address else address


def device_label(number: int, gpu_class: str | None = None) -> str:
    """How every view and message names a device: ``"3"`` for card 3,
    ``"0/mig1"`` for instance 1 of card 0, ``"cpu0"`` for CPU slot 0.

    A CPU slot's number looks like a card's, so the label needs the class
    (``gpu_class``) to tell them apart; MIG numbers say what they are.
    """
    if gpu_class == CPU_CLASS:
        return f"cpu{number}"
    if number >= MIG_NUMBER_BASE:
        card, instance = divmod(number - MIG_NUMBER_BASE, 100)
        return f"{card}/mig{instance}"
    return str(number)


def device_label_on(devices: Sequence[Device], number: int) -> str:
    """:func:`device_label` of device ``number`` on a node that lists ``devices``.

    For views and messages that hold only a shard's device numbers: the class
    comes from the node's inventory. A number the inventory does not list is
    named as a CPU slot on a node of CPU slots, and as a card otherwise.
    """
    for device in devices:
        if device.number == number:
            return device_label(number, device.gpu_class)
    cpu_node = bool(devices) and all(d.gpu_class == CPU_CLASS for d in devices)
    return device_label(number, CPU_CLASS if cpu_node else None)


# ---------------------------------------------------------------------------
# Inventory: what a node has (agent -> control plane)
# ---------------------------------------------------------------------------


class GpuProcess(Wire):
    pid: int
    name: str = ""
    used_memory_mib: int = 0


class MigInfo(Wire):
    """Where a MIG instance lives on its card."""

    parent_uuid: str
    parent_index: int
    gpu_instance_id: int
    compute_instance_id: int
    profile: str  # e.g. "3g.40gb" or "1c.3g.40gb"


class Device(Wire):
    """One placeable unit: a whole card, a MIG instance, or a CPU slot.

    The scheduler places replicas on devices, never on cards, so a card in MIG
    mode appears only as its instances and a CPU-only node as its slots.
    """

    number: int  # card index, MIG number (1000 + 100 x card + instance) or CPU slot
    label: str  # "0", "0/mig1", "cpu0"
    uuid: str  # GPU-…, MIG-…, or a stable id for a CPU slot
    name: str  # product name, "NVIDIA A100-SXM4-80GB"; "cpu" for slots
    gpu_class: str  # "a100-80g", "a100-80g-mig-3g.40gb", "cpu"
    memory_total_mib: int = 0
    memory_used_mib: int = 0
    # None when the source cannot say (always for MIG instances): a 0 would
    # claim an idle device that may be saturated.
    utilization_pct: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None
    healthy: bool = True
    unhealthy_reasons: list[str] = Field(default_factory=list)
    # False for a device that is healthy but cannot take work, e.g. a card in
    # MIG mode with no instances carved, or a mode change pending a reset.
    placeable: bool = True
    unplaceable_reason: str | None = None
    mig: MigInfo | None = None
    processes: list[GpuProcess] = Field(default_factory=list)
    # Wear counters, the card's (also for its instances).
    ecc_uncorrected: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_pending: bool | None = None
    remapping_failed: bool | None = None


class NodeInventory(Wire):
    hostname: str
    source: Literal["nvml", "nvidia-smi", "fake", "none"] = "none"
    driver_version: str | None = None
    cuda_version: str | None = None
    devices: list[Device] = Field(default_factory=list)
    # Problems met while discovering, e.g. "nvidia-smi -L: exit 9"; the node
    # still registers, with what could be found.
    warnings: list[str] = Field(default_factory=list)
    # The node's RAM (llmgw.memory): CPU replicas are placed against it.
    # None from an agent that does not report it: placement then takes the
    # node's word that it fits, as it did before RAM was reported.
    memory_total_mib: int | None = Field(None, ge=0)


class WeightsEntry(Wire):
    """A model whose weights a node holds in its local cache."""

    model: str
    revision: str | None = None
    size_bytes: int = 0
    sha256: str | None = None
    path: str | None = None
    # The source the entry was fetched from: the control plane counts a
    # holding as a copy of a model only when it is of the catalog's source.
    source: WeightsSource | None = None


class WeightsFile(Wire):
    """One file of a model's weights as its origin vouches for it.

    ``sha256`` from the Hub (LFS files) or the package; files the Hub keeps
    in git (config.json, the tokenizer) have only their git blob id there,
    so ``git_sha1`` stands in for it. ``size`` None: not known at the origin.
    """

    path: str
    size: int | None = Field(None, ge=0)
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    git_sha1: str | None = Field(None, pattern=r"^[0-9a-f]{40}$")


class WeightsDigests(Wire):
    """What a model's weights must be, recorded once by the control plane.

    A copy from a peer was checked only against the peer's own manifest, so
    one rogue node (anyone with a join token) could serve its fabric any
    weights it liked. Agents verify every copy, from a peer or the origin,
    against this record before an engine loads it (llmgw.agent.trust).
    ``origin``: ``hub`` (the Hub's file list at the pinned revision),
    ``package`` (the digest the package ships), ``first-fetch`` (neither
    could be read: the first copy an assigned node reported, trusted on
    first use). ``files`` None: only ``sha256``, the digest of the whole
    entry, is known (first fetch).
    """

    source: WeightsSource
    origin: Literal["hub", "package", "first-fetch"]
    files: list[WeightsFile] | None = None
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    # The node whose copy was trusted (first-fetch only).
    node: str | None = None


# ---------------------------------------------------------------------------
# Catalog entries (ctl/admin API -> control plane)
# ---------------------------------------------------------------------------


class WeightsSource(Wire):
    """Where a model's weights come from.

    ``local``: a path already on every node (a shared filer, or a file);
    ``hf``: the Hugging Face Hub at a pinned revision; ``package``: a Python
    package that ships the weights (the starter model); ``none``: engines that
    need no weights (the simulated engine).
    """

    kind: Literal["local", "hf", "package", "none"] = "none"
    path: str | None = None
    repo: str | None = None
    revision: str | None = None
    file: str | None = None  # one file inside the repo or package (a .gguf)
    package: str | None = None

    @model_validator(mode="after")
    def _fields_for_kind(self) -> WeightsSource:
        needed = {"local": "path", "hf": "repo", "package": "package"}.get(self.kind)
        if needed and not getattr(self, needed):
            raise ValueError(f"weights of kind {self.kind!r} need {needed!r}")
        return self


# The OpenAI routes beyond chat, completions and embeddings (which every
# engine serves): an engine serves a route only where its adapter says so
# (EngineDialect.extra_routes), and the gateway answers 404 for a model whose
# engines do not, instead of handing the client the engine's own 404.
ExtraRoute = Literal["/v1/responses", "/v1/rerank", "/v1/score", "/v1/audio/transcriptions"]
EXTRA_ROUTES: tuple[ExtraRoute, ...] = (
    "/v1/responses", "/v1/rerank", "/v1/score", "/v1/audio/transcriptions",
)


class SimParams(Wire):
    """How a simulated engine behaves (see llmgw.sim.engine)."""

    startup_s: float = 0.5
    prefill_tokens_per_s: float = 20000.0
    decode_ms_per_token: float = 10.0
    kv_blocks: int = 2048
    block_tokens: int = 16
    max_running: int = 64
    # cut_stream: a stream ends cleanly after crash_after_tokens tokens with
    # no finish_reason (then [DONE]), as llama_cpp.server's interrupt_requests does.
    fault: Literal[
        "none", "fail_at_start", "crash_mid_stream", "cut_stream", "hang", "slow"
    ] = "none"
    # Dialect switches, to exercise the gateway's mending (EngineDialect):
    # False makes the engine ignore max_completion_tokens / include_usage, as
    # llama_cpp.server does.
    max_completion_tokens: bool = True
    stream_usage: bool = True
    # Multiplies every simulated duration (start-up, prefill, decode): 0.01
    # runs a scenario 100x faster for tests, keeping its ratios.
    time_factor: float = Field(1.0, gt=0)
    # Prompt tokens computed per engine step (vLLM's max-num-batched-tokens).
    prefill_chunk_tokens: int = Field(2048, ge=1)
    # Decode step time = decode_ms_per_token * (1 + alpha * (running - 1)).
    decode_batch_alpha: float = Field(0.01, ge=0)
    # Requests queued beyond this get 503; None: unbounded, as in vLLM.
    max_waiting: int | None = Field(None, ge=0)
    # With fault crash_mid_stream (cut_stream): output tokens sent before the
    # connection drops (the stream ends).
    crash_after_tokens: int = Field(2, ge=0)
    # Seconds after it became ready (times time_factor) when the engine wedges,
    # as a deadlocked one does: running requests stop, and every request,
    # /health included, is accepted and never answered. None: never.
    hang_after_s: float | None = Field(None, ge=0, allow_inf_nan=False)
    # Seconds after it became ready (times time_factor) when the engine stops
    # making progress while its HTTP server answers on, as vLLM stuck inside a
    # CUDA call does: running requests stay running with no more tokens, the
    # token counters in /metrics freeze, /health answers 200. None: never.
    stall_after_s: float | None = Field(None, ge=0, allow_inf_nan=False)
    # The routes of EXTRA_ROUTES the engine serves (and its adapter declares);
    # None: all of them. [] makes an engine that serves only the core routes,
    # to see the gateway's 404 for the others.
    routes: list[ExtraRoute] | None = None


RoutingPolicy = Literal["prefix", "least-loaded", "round-robin"]

# An environment variable's name: what ``api_key_env`` may hold.
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"
_URL_PATH_RE = re.compile(r"^(/[A-Za-z0-9._~!$&'()*+,;=:@%-]*)*$")


def check_external_url(value: str) -> str:
    """``value`` if it is a base URL the gateway can send OpenAI requests to.

    ``http(s)://host[:port][/path prefix]``, without ``/v1`` (the gateway adds
    it, as for every engine). No user info, query or fragment: a URL that
    carried a password would show it in every read of the catalog, and a
    query would be lost when the route's path is appended.
    """
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{value!r} is not an http:// or https:// URL with a host")
    try:
        check_host(parts.hostname)
    except ValueError:
        raise ValueError(f"{value!r}: {parts.hostname!r} is not a host name or address") from None
    if parts.username is not None or parts.password is not None:
        raise ValueError(
            f"{value!r} carries user info: give the key by name in api_key_env instead"
        )
    if parts.query or parts.fragment or value.endswith(("?", "#")):
        raise ValueError(f"{value!r} has a query or fragment: give the base URL only")
    try:
        parts.port  # noqa: B018 (raises on a port out of range)
    except ValueError:
        raise ValueError(f"{value!r} has an invalid port") from None
    if not _URL_PATH_RE.match(parts.path):
        raise ValueError(f"{value!r}: the path may hold only URL characters")
    if parts.path.rstrip("/").endswith("/v1"):
        raise ValueError(
            f"{value!r} ends in /v1: give the base URL without it (the gateway adds /v1/...)"
        )
    return value


class ExternalSpec(Wire):
    """OpenAI-compatible servers llmgw routes to but does not run.

    A vLLM someone started by hand, an Ollama box, a hosted API: the gateway
    treats each URL as one replica (keys, limits, usage, prefix and load
    routing, retries, cool-down), probes them itself (llmgw.gateway.health)
    and the scheduler places nothing for the model.
    """

    urls: list[str] = Field(min_length=1, max_length=64)
    # The upstream's own name for the model, sent in every request body;
    # None: the catalog name. Answers carry the catalog name back to clients.
    model: str | None = Field(None, min_length=1, max_length=256)
    # The name of the environment variable, on each gateway, holding the
    # upstream's API key (sent as ``Authorization: Bearer``). The name only:
    # the key itself is never in the catalog, the store or any admin read.
    api_key_env: str | None = Field(None, pattern=ENV_NAME_PATTERN)
    # What the upstream's API gets wrong, as for an engine; None: it speaks
    # OpenAI faithfully (vLLM, SGLang, hosted APIs): streams are sent with
    # include_usage and the usage is taken from them.
    dialect: EngineDialect | None = None

    @field_validator("urls")
    @classmethod
    def _urls(cls, value: list[str]) -> list[str]:
        for url in value:
            check_external_url(url)
        if len({url.rstrip("/") for url in value}) != len(value):
            raise ValueError("a URL is listed twice")
        return value

    @field_validator("model")
    @classmethod
    def _upstream_name(cls, value: str | None) -> str | None:
        if value is not None and any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise ValueError("the upstream model name must not hold control characters")
        return value


class ModelSpec(Wire):
    """One catalog entry (DESIGN.md §3). Field-level shape is checked here;
    cross-field rules (MIG limits, gpus = tp x pp, ...) in control.catalog."""

    name: str
    aliases: list[str] = Field(default_factory=list)
    engine: EngineKind
    weights: WeightsSource = Field(default_factory=WeightsSource)
    gpu_classes: list[str] = Field(default_factory=lambda: [CPU_CLASS], min_length=1)
    gpus: int = Field(1, ge=1, le=1024)
    tp: int = Field(1, ge=1, le=1024)
    pp: int = Field(1, ge=1, le=1024)
    nodes: int = Field(1, ge=1, le=256)
    min_replicas: int = Field(1, ge=0, le=10000)
    max_replicas: int = Field(1, ge=0, le=10000)
    idle_timeout_s: float = Field(900.0, ge=0)
    start_timeout_s: float = Field(600.0, gt=0)
    engine_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    # Names in env whose values are secrets: never shown by a read of the
    # catalog (llmgw.control.secretenv; names like *TOKEN* are secret anyway).
    secret_env: list[str] = Field(default_factory=list)
    routing: RoutingPolicy = "prefix"
    # Host RAM one replica's engine may use (per node), in MiB: the budget
    # the agent enforces and, for CPU replicas, what placement charges a
    # node's RAM. None: estimated from the engine, weights and context
    # (llmgw.memory.default_need_mib).
    memory_mib: int | None = Field(None, ge=64, le=16 * 1024 * 1024)
    # Tokens of KV cache one replica holds; sizes the gateway's prefix index.
    kv_capacity_tokens: int = Field(32768, ge=16)
    # Most tokens one answer may generate; the gateway applies it (sets
    # max_tokens when the client gave no limit, lowers a larger one). None: no
    # cap, and a client that sets no limit lets the engine run to its context.
    max_output_tokens: int | None = Field(None, ge=1)
    sim: SimParams | None = None
    # Existing servers to route to instead of an engine to run (engine
    # ``external``, which is also what an entry with this and no engine gets).
    external: ExternalSpec | None = None

    @model_validator(mode="before")
    @classmethod
    def _external_engine(cls, data: object) -> object:
        # ``engine: external`` would only repeat what ``external:`` says.
        if isinstance(data, dict) and data.get("external") is not None and "engine" not in data:
            return {**data, "engine": EngineKind.EXTERNAL.value}
        return data

    @field_validator("name", "aliases")
    @classmethod
    def _plain_names(cls, value: str | list[str]) -> str | list[str]:
        for item in [value] if isinstance(value, str) else value:
            if not _NAME_RE.match(item):
                raise ValueError(
                    f"{item!r} is not a valid name: use letters, digits and . _ : / @ + -,"
                    " starting with a letter or digit"
                )
        return value

    @property
    def on_demand(self) -> bool:
        return self.min_replicas == 0


class ModelFile(Wire):
    """A YAML/JSON document of catalog entries, as ``ctl apply -f`` reads it."""

    models: list[ModelSpec]


# ---------------------------------------------------------------------------
# Replicas: assignments (control plane -> agent) and status (agent -> it)
# ---------------------------------------------------------------------------


class ShardAssignment(Wire):
    """The part of a replica that runs on one node."""

    node: str
    rank: int = 0
    device_numbers: list[int] = Field(default_factory=list)
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
    generation: int = 1
    model: ModelSpec
    shard: ShardAssignment
    nodes: int = 1
    # Address the rank-0 shard listens on for distributed init (multi-node).
    leader_address: str | None = None
    draining: bool = False
    # The replica's own engine key (DESIGN.md §6b): the engine is started with
    # it and refuses calls without it; only the gateways (Endpoint.engine_key)
    # and this node learn it. Kept out of repr, so a logged assignment never
    # shows it. None: no key (an assignment built by hand, e.g. in tests).
    engine_key: EngineKey | None = Field(None, repr=False)


class DownloadProgress(Wire):
    bytes_done: int = 0
    bytes_total: int | None = None
    rate_bps: float = 0.0
    eta_s: float | None = None


class EngineDialect(Wire):
    """Where an engine's OpenAI API differs from OpenAI's, as its adapter declares it.

    The gateway owns the OpenAI contract (DESIGN.md §6) and mends these per
    endpoint, so every client sees one API whatever serves it. Without this,
    llama_cpp.server ignores a client's ``max_completion_tokens`` (173 tokens
    generated for a limit of 5) and never sends a stream's usage, so clients
    that ask get none and per-key token limits meter a guess. The defaults
    describe an engine that speaks OpenAI faithfully (vLLM, SGLang).
    """

    # False: the engine ignores ``max_completion_tokens``; the gateway sends
    # the limit as ``max_tokens`` (the smaller one when both are given).
    max_completion_tokens: bool = True
    # False: the engine ignores ``stream_options.include_usage`` and sends no
    # usage in streams; the gateway counts the stream with the engine's own
    # tokenizer and adds the usage chunk itself.
    stream_usage: bool = True
    # The engine's tokenizer route, for counting what it does not report:
    # POST ``{tokenize_field: text}`` answered by ``{"count": n}`` or
    # ``{"tokens": [...]}``. None: it has none (then stream_usage must hold).
    tokenize_path: str | None = Field(None, pattern=r"^/[A-Za-z0-9/_.-]{0,99}$")
    tokenize_field: Literal["input", "content", "prompt"] = "input"
    # False: the engine goes on with a non-streamed request after its client
    # has gone (llama_cpp.server computes one in a worker thread that nothing
    # interrupts, to its token limit); the gateway asks it for a stream,
    # which stops at the next token once the connection closes, and
    # assembles the non-streamed answer the client asked for.
    stops_unstreamed: bool = True
    # The routes of EXTRA_ROUTES the engine serves. None: not declared (an
    # agent older than this field, an external server that declares no
    # dialect): every route is passed on and the server answers for itself.
    extra_routes: list[ExtraRoute] | None = None


class ReplicaStatus(Wire):
    """What the agent sees of one replica it runs."""

    replica_id: str
    generation: int = 1
    state: ReplicaState
    port: int | None = None
    pid: int | None = None
    exit_code: int | None = None
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


class AgentRegistration(Wire):
    """First contact: a join token buys a node token, once per node name.

    ``agent_key`` is a secret the agent made for its data dir before it first
    registered. Without it, an agent whose answer was lost (a timeout, a reset
    after the control plane committed) would hold no node token while its
    name is taken, and a person would have to delete the node. With it, the
    same data dir may register its node again; the join token alone never
    can, or any holder of it could take over a running node's identity.
    """

    node: str
    join_token: str = Field(max_length=512)
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
    protocol: int = PROTOCOL_VERSION
    node: str
    agent_version: str = ""
    # Where engines on this node can be reached by the gateway (host only).
    address: str = "127.0.0.1"
    fabrics: list[str] = Field(default_factory=list)
    inventory: NodeInventory
    replicas: list[ReplicaStatus] = Field(default_factory=list)
    weights: list[WeightsEntry] = Field(default_factory=list)
    # Port of the agent's own HTTP server (weights for peers), when it runs one.
    agent_port: int | None = None
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


# ---------------------------------------------------------------------------
# Several control-plane instances (one leader, hot standbys)
# ---------------------------------------------------------------------------

# A standby answers the agent API and the gateway link with HTTP 503, an error
# body whose ``code`` is STANDBY_CODE, and the leader's advertised URL in
# LEADER_HEADER when the store knows it. Agents and gateways read these two to
# move to the leader instead of taking a standby's answer (stale assignments,
# heartbeats the leader never sees) or retrying it forever.
STANDBY_CODE = "standby"
LEADER_HEADER = "X-Llmgw-Leader"

# The control plane POSTs here on an agent's own server (llmgw.agent.server)
# when the node's assignments changed, so the agent reports now rather than
# at its next interval (llmgw.control.nudge).
NUDGE_PATH = "/agent/v1/nudge"


# ---------------------------------------------------------------------------
# Routing table (control plane -> gateway) and load (gateway -> control plane)
# ---------------------------------------------------------------------------


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


class ApiKeyInfo(Wire):
    """An API key as the gateway needs it: the hash, never the secret."""

    key_id: str
    name: str = ""
    secret_hash: str
    models: list[str] = Field(default_factory=list)  # empty: all models
    expires_at: float | None = None
    rpm: int | None = None
    tpm: int | None = None
    revoked: bool = False


class GatewayConfig(Wire):
    """Keys and routing, as a standalone gateway's watch stream sends them."""

    routing: RoutingTable
    keys: list[ApiKeyInfo] = Field(default_factory=list)


# ---------------------------------------------------------------------------
# Events
# ---------------------------------------------------------------------------


class Event(Wire):
    id: int | None = None
    at: float
    kind: str  # "placed", "evicted", "failed", "parked", "drain", "leader", ...
    subject: str = ""  # model, replica or node it is about
    message: str
    data: dict[str, Annotated[str | int | float | bool | None, Field()]] = Field(
        default_factory=dict
    )
