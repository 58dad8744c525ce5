"""What every engine adapter shares: the launch it builds and the checks on catalog input.

An adapter is a pure function from an assignment (plus the weights path, the
port and the pinned devices the agent chose) to an argv list and an
environment. Keeping it pure means the exact command of every engine, for
every shape of replica, is pinned by unit tests without starting anything;
the supervisor is the only place that turns a launch into a process.

Catalog input reaches argv items and environment variables. It never passes
through a shell, but it is still checked here, once, before anything starts:
an item with a NUL or a newline cannot be a real flag value and would corrupt
the engine's log or its argv, and a catalog flag that overrides what the agent
manages (``--port``, ``--host``, the served name, device pinning) would make
the agent health-check one port while the engine listens on another.
Engines do not read their command lines literally, so neither does the check
(:class:`FlagRules`): vLLM and llama-server turn ``_`` into ``-`` in a long
flag, Python's argparse (vLLM, SGLang, llama_cpp.server) takes any unique
prefix of a long flag (``--po`` for ``--port``) and a value glued to a short
one (``-n2``), and vLLM reads ``--flag.key v`` as a field of ``--flag``.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from llmgw.agent.discovery.pinning import engine_env
from llmgw.agent.progress import ProgressMetrics
from llmgw.engine_env import env_problem
from llmgw.errors import EngineError
from llmgw.wire import CPU_CLASS, Device, EngineDialect, EngineKind, ModelSpec, ReplicaAssignment

# The hint for engine flags that import code by a name the catalog gives.
LOADS_CODE = (
    "it loads Python code on the node, and a catalog entry cannot run code on a node"
    " (docs/security.md)"
)
# The hint for --trust-remote-code, which a node's admin may allow on that
# node (agent.engines.nodeargs).
REMOTE_CODE = (
    "it runs the Python files of the model's repository on the node, and a catalog entry"
    " cannot run code on a node; a node's admin may allow it there:"
    " llmgw agent --engine-flag-allow trust-remote-code (docs/security.md)"
)
MAX_ENGINE_ARGS = 256
MAX_ARG_CHARS = 4096
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")

# Variables the agent sets to pin an engine to its devices. A catalog entry
# that set them would move the engine onto GPUs another replica holds.
PINNING_ENV = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "GGML_VK_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "NVIDIA_VISIBLE_DEVICES",
    }
)


@dataclass(frozen=True)
class EngineTls:
    """The node's certificate and key (agent.nodecert), for an engine to listen with.

    Paths, not contents: the key stays in its owner-only file in the agent's
    data dir, and only its path reaches argv.
    """

    cert_file: str
    key_file: str


def uvicorn_tls_flags(tls: EngineTls) -> list[str]:
    """TLS flags of an engine served by uvicorn (vLLM, SGLang): the node's certificate,
    reloaded when it is renewed on disk."""
    return [
        "--ssl-keyfile", tls.key_file, "--ssl-certfile", tls.cert_file, "--enable-ssl-refresh",
    ]  # fmt: skip


@dataclass(frozen=True)
class LaunchContext:
    """Everything an adapter needs besides the assignment itself."""

    assignment: ReplicaAssignment
    weights_path: str | None
    host: str
    port: int
    devices: Sequence[Device] = ()
    # RAM the engine may use, which the agent enforces (llmgw.memory,
    # agent.memguard): adapters size the engine's caches to fit in it.
    # None: no budget (a test that builds a launch by hand).
    memory_budget_mib: int | None = None
    # Size of the weights at ``weights_path``, for the same sizing.
    weights_bytes: int | None = None
    # Listen with TLS under the node's certificate where the engine can;
    # None: the fleet issues none (or this node has none yet), plain http.
    tls: EngineTls | None = None
    # The LoRA adapters an engine that takes them only at its start is
    # started with (EngineAdapter.adapters_at_start): (catalog name, weights
    # path), in the order the engine numbers them.
    adapters: tuple[tuple[str, str], ...] = ()
    # Where an engine that publishes its KV-cache events (ModelSpec.kv_events)
    # publishes them: an ``ipc://`` socket its guard relays (agent.kvrelay);
    # None: it publishes none.
    kv_events: str | None = None


@dataclass(frozen=True)
class SecretFile:
    """What :attr:`EngineLaunch.secret_file` writes: ``text``, named by ``flag``."""

    flag: str
    text: str = field(repr=False)
    # The file's name ends so (SGLang reads a --config file only as .yaml/.yml).
    suffix: str = ""


@dataclass(frozen=True)
class EngineLaunch:
    """A command ready to run: argv (never a shell string) and added environment."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    # Path polled for readiness; None for a shard that serves no HTTP (a
    # non-leader rank of a multi-node replica), which is ready once it runs.
    health_path: str | None = "/health"
    # Path probed while the engine serves, to catch one that hangs after it
    # was ready (agent.liveness); None: the health path. It differs where the
    # readiness path waits behind generation: llama_cpp.server's /v1/models
    # takes the model lock, so a probe would stall for a whole completion.
    liveness_path: str | None = None
    # The engine's Prometheus metrics that show it makes progress
    # (agent.progress); None: it has none, and only the probe watches it.
    progress: ProgressMetrics | None = None
    # Upper-case names of variables the engine must not inherit from the
    # agent: it would read them as settings over its command line (engine_env).
    drop_env: frozenset[str] = frozenset()
    # Where the engine's OpenAI API falls short (reported to the gateway,
    # which mends it); the default is an engine that speaks OpenAI faithfully.
    dialect: EngineDialect = field(default_factory=EngineDialect)
    # A secret the engine reads only from argv or a file (SGLang's key):
    # the supervisor writes it to a file only the agent's user can read and
    # passes ``flag PATH``, since argv is world-readable in /proc.
    secret_file: SecretFile | None = None
    # The engine listens with TLS (it took LaunchContext.tls): its endpoint
    # is https://, and the agent probes it so.
    tls: bool = False
    # argv starts the engine guard (agent.guardlaunch), whose own options end
    # at its "--": the guard starts the engine, and so runs it as the engine
    # user where the agent has one (agent.engineuser).
    guarded: bool = False

    @property
    def serving_probe(self) -> str | None:
        """What to probe while serving; None when the shard serves no HTTP."""
        if self.health_path is None:
            return None
        return self.liveness_path or self.health_path


class EngineAdapter(Protocol):
    kind: EngineKind

    @property
    def guards_every_route(self) -> bool:
        """The engine refuses every route but a bare health check without its key itself,
        so the agent puts no guard in front of it (agent.engineguard)."""
        ...

    @property
    def adapters_at_start(self) -> bool:
        """The engine takes its LoRA adapters only when it starts (llama-server's
        ``--lora``): a replica starts with every adapter it is assigned."""
        ...

    def validate(self, assignment: ReplicaAssignment) -> None:
        """Raise EngineError when the assignment cannot be launched by this engine."""

    def build(self, ctx: LaunchContext) -> EngineLaunch:
        """The command and environment for one shard of a replica."""


@dataclass(frozen=True)
class FlagRules:
    """The flags the agent manages for one engine, and how that engine reads a flag."""

    managed: frozenset[str]
    # ``--served_model_name`` is ``--served-model-name`` (vLLM, llama-server).
    dashes: bool = False
    # Python argparse with allow_abbrev (its default): ``--po`` is ``--port``
    # when no other flag starts so, and ``-n2`` is ``-n 2``.
    abbreviations: bool = False
    # vLLM: ``--served-model-name.x v`` sets ``--served-model-name`` to JSON.
    dotted: bool = False
    # The engine's own flags: one of them is read as itself, never as an
    # abbreviation of a managed flag it happens to begin (--cache of --cache_size).
    flags: frozenset[str] = frozenset()
    # What to do instead, for managed flags a catalog is likely to try.
    hints: Mapping[str, str] = field(default_factory=dict)

    def spelled(self, item: str) -> str | None:
        """The flag an argv item names, as the engine normalises it; None for a value."""
        if len(item) < 2 or item[0] != "-" or item[1].isdigit() or item[1] == ".":
            return None  # a value: "5", "-1", "-.5"
        flag = item.split("=", 1)[0]
        if flag.startswith("--"):
            if self.dotted:
                flag = flag.split(".", 1)[0]
            if self.dashes:
                flag = flag.replace("_", "-")
        return flag

    def managed_flag(self, item: str) -> str | None:
        """The managed flag ``item`` would set, in any spelling the engine accepts."""
        flag = self.spelled(item)
        if flag is None:
            return None
        if flag in self.managed:
            return flag
        if not self.abbreviations or flag in ("-", "--") or flag in self.flags:
            return None
        for managed in sorted(self.managed):
            long = managed.startswith("--")
            if long != flag.startswith("--"):
                continue
            if managed.startswith(flag):  # an abbreviation: --po, -t
                return managed
            if not long and flag.startswith(managed):  # a glued value: -n2
                return managed
        return None


def validate_engine_args(args: Sequence[object], managed: FlagRules | Iterable[str]) -> None:
    """Refuse catalog engine args that are malformed or set a managed flag, however spelled."""
    rules = managed if isinstance(managed, FlagRules) else FlagRules(frozenset(managed))
    if len(args) > MAX_ENGINE_ARGS:
        raise EngineError(f"engine_args has {len(args)} items; at most {MAX_ENGINE_ARGS}")
    for index, item in enumerate(args):
        if not isinstance(item, str):
            raise EngineError(f"engine_args[{index}] is not a string: {item!r}")
        if any(ch in item for ch in ("\x00", "\n", "\r")):
            raise EngineError(f"engine_args[{index}] contains a NUL or line break: {item!r}")
        if len(item) > MAX_ARG_CHARS:
            raise EngineError(f"engine_args[{index}] is longer than {MAX_ARG_CHARS} characters")
        flag = rules.managed_flag(item)
        if flag is None:
            continue
        spelled = item.split("=", 1)[0]
        how = "" if spelled == flag else f" ({spelled!r}, which the engine reads as {flag})"
        hint = rules.hints.get(flag)
        raise EngineError(
            f"engine_args[{index}] sets {flag}{how}, which the agent manages for this engine"
            + (f"; {hint}" if hint else "")
        )


def validate_env(
    env: Mapping[str, str], engine: EngineKind | None = None, node_allowed: Collection[str] = ()
) -> None:
    """Refuse catalog environment entries that are malformed, undo device pinning,
    that ``engine`` reads as settings over its command line, or that are not among
    its settings (llmgw.engine_env; ``node_allowed``: what this node's admin adds)."""
    for name, value in env.items():
        if not _ENV_NAME_RE.match(name):
            raise EngineError(f"env name {name!r} is not a valid environment variable name")
        if "\x00" in value:
            raise EngineError(f"env {name} contains a NUL byte")
        if name in PINNING_ENV:
            raise EngineError(f"env {name} is set by the agent to pin devices; remove it")
        problem = env_problem(engine, name, node_allowed) if engine is not None else None
        if problem is not None:
            raise EngineError(f"env {name}: {problem}")


def has_flag(args: Sequence[str], *flags: str) -> bool:
    """True when a catalog arg list already sets one of ``flags`` (``--f v`` or ``--f=v``)."""
    return any(item.split("=", 1)[0] in flags for item in args)


def console_script(name: str) -> str:
    """An engine's command: its script beside the agent's Python, else ``name`` on PATH.

    ``pip install vllm`` (or sglang) into llmgw's environment puts the script
    there, which is not on PATH when the agent runs as a systemd unit.
    """
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() else name


def uses_gpus(devices: Sequence[Device]) -> bool:
    return any(device.gpu_class != CPU_CLASS for device in devices)


def split_host_port(address: str) -> tuple[str, int | None]:
    """``"10.0.0.1:5000"`` -> ``("10.0.0.1", 5000)``; ``"[::1]:5000"`` and a bare host too."""
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif address.count(":") == 1:
        host, _, port_text = address.partition(":")
    else:
        host, port_text = address, ""
    if not host:
        raise EngineError(f"leader address {address!r} has no host")
    if not port_text:
        return host, None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise EngineError(f"leader address {address!r} has no valid port")
    return host, int(port_text)


def require_leader(assignment: ReplicaAssignment, *, needs_port: bool) -> tuple[str, int | None]:
    """The leader's host and port of a multi-node replica, or EngineError naming what is missing."""
    if not assignment.leader_address:
        raise EngineError(
            f"replica {assignment.replica_id} spans {assignment.nodes} nodes but has no"
            " leader_address"
        )
    host, port = split_host_port(assignment.leader_address)
    if needs_port and port is None:
        raise EngineError(f"leader_address {assignment.leader_address!r} needs a port (host:port)")
    return host, port


def require_weights(ctx: LaunchContext) -> str:
    if not ctx.weights_path:
        raise EngineError(
            f"model {ctx.assignment.model.name!r} has no weights; engine"
            f" {ctx.assignment.model.engine.value} needs a weights source"
        )
    return ctx.weights_path


def check_common(assignment: ReplicaAssignment, managed_flags: FlagRules | Iterable[str]) -> None:
    """The checks every adapter makes before it builds anything."""
    validate_engine_args(assignment.model.engine_args, managed_flags)
    validate_env(assignment.model.env, assignment.model.engine)
    if assignment.nodes < 1:
        raise EngineError(f"replica {assignment.replica_id} has nodes={assignment.nodes}")
    if not 0 <= assignment.shard.rank < assignment.nodes:
        raise EngineError(
            f"shard rank {assignment.shard.rank} is outside 0..{assignment.nodes - 1}"
        )


def check_serve(
    assignment: ReplicaAssignment,
    managed_flags: FlagRules,
    *,
    engine: EngineKind,
    leader_port: bool,
) -> None:
    """The checks of a ``serve`` engine: the common ones, weights, and on a multi-node
    replica a leader address (with a port where ``leader_port``)."""
    check_common(assignment, managed_flags)
    if assignment.model.weights.kind == "none":
        raise EngineError(f"model {assignment.model.name!r}: {engine.value} needs weights")
    if assignment.nodes > 1:
        require_leader(assignment, needs_port=leader_port)


@dataclass(frozen=True)
class ServeFlags:
    """How an engine's ``serve`` command (vLLM's, SGLang's) names what the agent sets."""

    weights: str | None  # the flag before the weights path; None: it is positional
    tp: str  # tensor-parallel size
    pp: str  # pipeline-parallel size
    leader: str  # the rank-0 node's address, on a multi-node replica


def serve_argv(executable: str, ctx: LaunchContext, flags: ServeFlags, leader: str) -> list[str]:
    """``EXE serve WEIGHTS``, the served name, where to listen and the parallel sizes;
    on a multi-node replica, the node count, this shard's rank and the ``leader``."""
    assignment = ctx.assignment
    spec = assignment.model
    weights = [flags.weights] if flags.weights is not None else []
    ranks = [] if assignment.nodes <= 1 else [
        "--nnodes",
        str(assignment.nodes),
        "--node-rank",
        str(assignment.shard.rank),
        flags.leader,
        leader,
    ]
    return [
        executable,
        "serve",
        *weights,
        require_weights(ctx),
        "--served-model-name",
        spec.name,
        "--host",
        ctx.host,
        "--port",
        str(ctx.port),
        flags.tp,
        str(spec.tp),
        flags.pp,
        str(spec.pp),
        *ranks,
    ]


def serve_launch(
    ctx: LaunchContext,
    argv: list[str],
    *,
    health: str | None,
    metrics: ProgressMetrics,
    dialect: EngineDialect,
    env: Mapping[str, str] | None = None,
    secret_file: SecretFile | None = None,
    tls: bool = False,
    drop_env: frozenset[str] = frozenset(),
) -> EngineLaunch:
    """A shard's launch for a ``serve`` engine: the catalog's own args after the agent's,
    its environment with the pinning (and ``env``) over it. Metrics, like HTTP, come
    from the rank that serves the API only (``health`` None: a rank that does not)."""
    spec = ctx.assignment.model
    return EngineLaunch(
        argv=[*argv, *spec.engine_args],
        env={**launch_env(spec, ctx.devices), **(env or {})},
        health_path=health,
        progress=metrics if health is not None else None,
        dialect=dialect,
        secret_file=secret_file,
        tls=tls,
        drop_env=drop_env,
    )


def launch_env(
    spec: ModelSpec, devices: Sequence[Device], *, vulkan: bool = False
) -> dict[str, str]:
    """The catalog entry's environment with the pinning to ``devices`` over it."""
    env = dict(spec.env)
    env.update(engine_env(devices, vulkan=vulkan))
    return env
