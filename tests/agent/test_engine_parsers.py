"""Every launch an adapter can build, parsed by the engine's own code (issue 28 item 3).

The adapters were written from documentation; here their argv, environment and
secret files go through the engines' own parsers (SGLang's prepare_server_args
and its config-file merger, vLLM's ``vllm serve`` parser, llama_cpp.server's
argparse and pydantic settings), run by each engine's own Python
(tests/agent/engine_parse_worker.py, in the virtualenvs ``make engines`` makes
under ~/.cache/llmgw/engines). Hypothesis draws catalog entries: catalog
engine_args and env, tp/pp/nodes and rank, an engine key or none, TLS on or off.

Two properties per engine:
* every launch the adapter accepts is accepted by the engine, which reads what
  the agent meant: its port, host, served name, parallel sizes, key, TLS files;
* no catalog flag the adapter lets through, in any spelling the engine's parser
  takes (prefixes, ``_`` for ``-``, ``=value``), changes any of those.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.agent.helpers import assign, cpu_slot, gpu, model, write_gguf

from llmgw.agent.engines import LlamaCppAdapter, SglangAdapter, VllmAdapter
from llmgw.agent.engines.base import EngineAdapter, EngineLaunch, EngineTls, LaunchContext
from llmgw.agent.supervisor import Supervisor
from llmgw.errors import EngineError
from llmgw.gateway.checks.validation import SCORE
from llmgw.gateway.replies import ApiError
from llmgw.gateway.routing.support import EMBEDDINGS, OPTIONAL_ROUTES
from llmgw.wire import WeightsSource

ENGINES_DIR = Path(os.environ.get("LLMGW_ENGINES_DIR", Path.home() / ".cache/llmgw/engines"))
WORKER = Path(__file__).with_name("engine_parse_worker.py")
KEY = "llmgw-ek-0123456789abcdefABCDEF"
WEIGHTS = "/data/weights/model"


def engine_python(engine: str) -> str:
    if engine == "llama_cpp.server":  # llmgw's own extra (pip install llmgw[llamacpp])
        return sys.executable
    python = ENGINES_DIR / engine / "bin" / "python"
    if not python.is_file():
        pytest.fail(
            f"{engine} is not installed in its own virtualenv ({python} is missing):"
            " run `make engines`"
        )
    return str(python)


class EngineParser:
    """One engine's parser, in a worker process of the engine's Python."""

    def __init__(self, engine: str, log: Path) -> None:
        self.engine = engine
        self._log = open(log, "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [engine_python(engine), str(WORKER), engine],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"},
        )  # fmt: skip
        self._read()  # {"ready": true} once the engine is imported

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                answer: dict[str, Any] = json.loads(line)
                return answer
        log = Path(self._log.name).read_text()[-3000:]
        raise AssertionError(f"the {self.engine} parser worker ended: {log}")

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"engine": self.engine, **request}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def parse(self, argv: list[str], env: dict[str, str]) -> dict[str, Any]:
        return self.ask({"argv": argv, "env": env})

    def options(self) -> list[tuple[str, int, str]]:
        """The engine parser's options: (option string, values it takes, field it sets)."""
        found = self.ask({"options": True})["values"]["options"]
        return [(name, takes, dest) for name, takes, dest in found]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-parsers")


@pytest.fixture(scope="module")
def tls_files(workdir: Path) -> EngineTls:
    # SGLang checks that its TLS files exist before anything else.
    (workdir / "node.pem").write_text("cert")
    (workdir / "node.key").write_text("key")
    return EngineTls(str(workdir / "node.pem"), str(workdir / "node.key"))


def _parser(engine: str, workdir: Path) -> Iterator[EngineParser]:
    parser = EngineParser(engine, workdir / f"{engine}-worker.log")
    try:
        yield parser
    finally:
        parser.close()


@pytest.fixture(scope="module")
def sglang(workdir: Path) -> Iterator[EngineParser]:
    yield from _parser("sglang", workdir)


@pytest.fixture(scope="module")
def vllm(workdir: Path) -> Iterator[EngineParser]:
    yield from _parser("vllm", workdir)


@pytest.fixture(scope="module")
def llama_cpp_server(workdir: Path) -> Iterator[EngineParser]:
    yield from _parser("llama_cpp.server", workdir)


ENGINES = ["sglang", "vllm", "llama_cpp.server"]


def parser_for(request: pytest.FixtureRequest, engine: str) -> EngineParser:
    """The module's parser of ``engine`` (one of ENGINES), its fixture by the engine's name."""
    parser: EngineParser = request.getfixturevalue(engine.replace(".", "_"))
    return parser


# -- catalog entries ------------------------------------------------------------------

# Settings a catalog might give each engine (flags and values the engine takes).
CATALOG_ARGS = {
    "sglang": [["--mem-fraction-static", "0.8"], ["--context-length", "2048"],
               ["--disable-radix-cache"], ["--max-running-requests", "8"],
               ["--dtype", "float16"], ["--enable-metrics"], ["--skip-server-warmup"],
               ["--log-level", "debug"], ["--chunked-prefill-size", "512"]],
    "vllm": [["--max-model-len", "2048"], ["--dtype", "float16"], ["--enforce-eager"],
             ["--gpu-memory-utilization", "0.8"], ["--max-num-seqs", "16"],
             ["--enable-prefix-caching"], ["--seed", "1"], ["--max_num_batched_tokens", "512"]],
    "llama_cpp.server": [["--n_threads", "2"], ["--cache", "yes"], ["--embed", "on"],
                         ["--verbose", "false"], ["--n_batch", "256"], ["--logits_all", "T"],
                         ["--chat_format", "chatml"], ["--cache_size", "1000000"]],
}  # fmt: skip
CATALOG_ENV = {
    "sglang": {"SGLANG_ENABLE_TORCH_COMPILE": "0", "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1"},
    "vllm": {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "2", "VLLM_LOGGING_LEVEL": "INFO"},
    "llama_cpp.server": {"LLAMA_ARG_THREADS": "2", "OMP_NUM_THREADS": "2",
                         "GGML_SCHED_MAX_COPIES": "4"},
}  # fmt: skip
# What the agent manages: parsed values no catalog argument may change.
MANAGED = {
    "sglang": ["model_path", "served_model_name", "host", "port", "tp_size", "pp_size",
               "api_key", "admin_api_key", "nnodes", "node_rank", "dist_init_addr",
               "ssl_keyfile", "ssl_certfile", "grpc_port"],
    "vllm": ["weights", "served_model_name", "host", "port", "tensor_parallel_size",
             "pipeline_parallel_size", "api_key", "nnodes", "node_rank", "master_addr",
             "master_port", "headless", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs",
             "ssl_cert_reqs", "uds"],
    "llama_cpp.server": ["model", "model_alias", "host", "port", "api_key", "n_ctx",
                         "interrupt_requests", "ssl_keyfile", "ssl_certfile"],
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Entry:
    """One drawn catalog entry and replica shape."""

    engine: str
    engine_args: list[str]
    env: dict[str, str]
    tp: int
    pp: int
    nodes: int
    rank: int
    keyed: bool
    tls: bool


@st.composite
def entries(draw: st.DrawFn, engine: str) -> Entry:
    groups = draw(st.lists(st.sampled_from(CATALOG_ARGS[engine]), max_size=4, unique_by=str))
    names = draw(st.sets(st.sampled_from(sorted(CATALOG_ENV[engine]))))
    multi = engine != "llama_cpp.server"
    nodes = draw(st.sampled_from([1, 2])) if multi else 1
    return Entry(
        engine=engine,
        engine_args=[item for group in groups for item in group],
        env={name: CATALOG_ENV[engine][name] for name in names},
        tp=draw(st.sampled_from([1, 2, 4])) if multi else 1,
        pp=draw(st.sampled_from([1, 2])) if multi else 1,
        nodes=nodes,
        rank=draw(st.integers(0, nodes - 1)),
        keyed=draw(st.booleans()),
        tls=draw(st.booleans()),
    )


def adapter_for(engine: str) -> EngineAdapter:
    return {"sglang": SglangAdapter(executable="sglang"), "vllm": VllmAdapter(executable="vllm"),
            "llama_cpp.server": LlamaCppAdapter(server_binary="")}[engine]  # fmt: skip


def build(entry: Entry, workdir: Path, tls: EngineTls) -> tuple[EngineLaunch, LaunchContext]:
    if entry.engine == "llama_cpp.server":
        weights = write_gguf(workdir / "gemma.gguf", "gemma3")
        spec = model("llamacpp", name="gemma-3-270m", gpu_classes=["cpu"],
                     weights=WeightsSource(kind="local", path=weights))  # fmt: skip
        devices = [cpu_slot(0)]
    else:
        weights = WEIGHTS
        spec = model(entry.engine, tp=entry.tp, pp=entry.pp, nodes=entry.nodes)
        devices = [gpu(i) for i in range(entry.tp * entry.pp // entry.nodes or 1)]
    spec = spec.model_copy(update={"engine_args": entry.engine_args, "env": entry.env})
    leader = "10.0.0.1:29500" if entry.nodes > 1 else None
    assignment = assign(spec, devices, rank=entry.rank, leader=leader)
    assignment = assignment.model_copy(update={"engine_key": KEY if entry.keyed else None})
    ctx = LaunchContext(assignment=assignment, weights_path=weights, host="10.0.0.5",
                        port=22123, devices=devices, tls=tls if entry.tls else None)  # fmt: skip
    return adapter_for(entry.engine).build(ctx), ctx


def started(launch: EngineLaunch, workdir: Path) -> tuple[list[str], dict[str, str]]:
    """The argv the supervisor starts (with its secret file written) and the added env."""
    argv = Supervisor(workdir / "logs").command("r-1", launch)
    return argv, dict(launch.env)


def meant(entry: Entry, launch: EngineLaunch, ctx: LaunchContext) -> dict[str, Any]:
    """What the agent means the engine to read, in the engine's own field names."""
    serves = launch.health_path is not None
    key = KEY if entry.keyed and serves else None
    files = ctx.tls if entry.tls and serves else None
    ssl = {"ssl_keyfile": files.key_file if files else None,
           "ssl_certfile": files.cert_file if files else None}  # fmt: skip
    if entry.engine == "sglang":
        return {"model_path": WEIGHTS, "served_model_name": ctx.assignment.model.name,
                "host": "10.0.0.5", "port": 22123, "tp_size": entry.tp, "pp_size": entry.pp,
                "api_key": key, "admin_api_key": None, "nnodes": entry.nodes,
                "node_rank": entry.rank, "grpc_port": None, **ssl}  # fmt: skip
    if entry.engine == "vllm":
        return {"weights": WEIGHTS, "served_model_name": [ctx.assignment.model.name],
                "host": "10.0.0.5", "port": 22123, "tensor_parallel_size": entry.tp,
                "pipeline_parallel_size": entry.pp, "api_key": None, "nnodes": entry.nodes,
                "node_rank": entry.rank, "headless": not serves, "uds": None, **ssl}  # fmt: skip
    return {"model": ctx.weights_path, "model_alias": "gemma-3-270m", "host": "10.0.0.5",
            "port": 22123, "api_key": key, "interrupt_requests": False, **ssl}  # fmt: skip


def check_entry(parser: EngineParser, entry: Entry, workdir: Path, tls: EngineTls) -> None:
    try:
        launch, ctx = build(entry, workdir, tls)
    except EngineError as exc:
        raise AssertionError(f"the adapter refused a plain entry: {exc}") from None
    argv, env = started(launch, workdir)
    answer = parser.parse(argv, env)
    assert answer["ok"], f"{entry.engine} refused {argv} {env}: {answer['error']}"
    values = answer["values"]
    for name, value in meant(entry, launch, ctx).items():
        assert values[name] == value, (name, values[name], value, argv)
    if entry.engine == "vllm":  # its key comes from the environment only
        assert env.get("VLLM_API_KEY") == (KEY if entry.keyed else None)


PROPERTY = settings(max_examples=25, deadline=None, derandomize=True)


@pytest.mark.parametrize("engine", ENGINES)
def test_the_engine_reads_every_launch_as_the_agent_means_it(
    engine: str, request: pytest.FixtureRequest, workdir: Path, tls_files: EngineTls
) -> None:
    parser = parser_for(request, engine)

    @PROPERTY
    @given(entry=entries(engine))
    def run(entry: Entry) -> None:
        check_entry(parser, entry, workdir, tls_files)

    run()


# -- no catalog flag moves what the agent manages -----------------------------------------


@st.composite
def spellings(draw: st.DrawFn, options: list[tuple[str, int, str]]) -> list[str]:
    """One of the engine's own options as a catalog could write it, with a value."""
    option, takes, _ = draw(st.sampled_from(options))
    if option.startswith("--"):
        form = draw(st.sampled_from(["exact", "prefix", "underscores"]))
        if form == "prefix" and len(option) > 5:
            option = option[: draw(st.integers(4, len(option) - 1))]
        elif form == "underscores":
            option = "--" + option[2:].replace("-", "_")
    value = draw(st.sampled_from(["1", "/tmp/other", "0.0.0.0", "x"]))
    if not takes:
        return [option]
    return [f"{option}={value}"] if draw(st.booleans()) else [option, value]


def check_no_flag_moves_managed(
    parser: EngineParser, engine: str, extra: list[str], workdir: Path, tls: EngineTls
) -> None:
    entry = Entry(engine, [], {}, 1, 1, 1, 0, keyed=True, tls=True)
    base, _ = build(entry, workdir, tls)
    baseline = parser.parse(*started(base, workdir))
    assert baseline["ok"], baseline
    try:
        launch, _ = build(dataclasses.replace(entry, engine_args=extra), workdir, tls)
    except EngineError:
        return  # refused: the agent manages it
    answer = parser.parse(*started(launch, workdir))
    if not answer["ok"]:
        return  # the engine would not start: the replica fails with its reason
    for name in MANAGED[engine]:
        assert answer["values"][name] == baseline["values"][name], (
            f"{engine} engine_args {extra} changed {name}: "
            f"{baseline['values'][name]!r} -> {answer['values'][name]!r}"
        )


@pytest.mark.parametrize("engine", ENGINES)
def test_no_catalog_flag_moves_what_the_agent_manages(
    engine: str, request: pytest.FixtureRequest, workdir: Path, tls_files: EngineTls
) -> None:
    parser = parser_for(request, engine)
    options = parser.options()
    assert len(options) > 20, options

    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(extra=spellings(options))
    def run(extra: list[str]) -> None:
        check_no_flag_moves_managed(parser, engine, extra, workdir, tls_files)

    run()


# Fields of the engines' parsers that the agent sets, or that must stay as the
# agent leaves them (an https engine behind an http endpoint never gets ready,
# a gRPC port or a second tokenizer worker beside the key stop SGLang), and the
# ones that import code by a name the catalog gives.
MANAGED_FIELDS = {
    "sglang": {*MANAGED["sglang"], "config", "ssl_ca_certs", "ssl_keyfile_password",
               "enable_ssl_refresh", "tokenizer_worker_num",
               # code the catalog would name, or let every request send
               "custom_weight_loader", "forward_hooks", "enable_custom_logit_processor"},
    "vllm": {*MANAGED["vllm"], "config", "enable_ssl_refresh", "grpc", "grpc_port",
             "tool_parser_plugin", "reasoning_parser_plugin", "middleware",
             "logits_processors", "worker_cls", "worker_extension_cls", "scheduler_cls"},
    "llama_cpp.server": {*MANAGED["llama_cpp.server"], "config_file"},
}  # fmt: skip


def _written(option: str, parser_options: set[str]) -> list[str]:
    """Ways a catalog can write ``option`` that the engine's argparse reads as it:
    itself, with ``_`` for ``-``, and its shortest unambiguous prefix."""
    forms = [option]
    if option.startswith("--"):
        forms.append("--" + option[2:].replace("-", "_"))
        for end in range(3, len(option)):
            prefix = option[:end]
            if [o for o in parser_options if o.startswith(prefix)] == [option]:
                forms.append(prefix)
                break
    return forms


@pytest.mark.parametrize("engine", ENGINES)
def test_every_option_that_sets_a_managed_field_is_refused(
    engine: str, request: pytest.FixtureRequest
) -> None:
    parser = parser_for(request, engine)
    options = parser.options()
    names = {option for option, _, _ in options}
    adapter = adapter_for(engine)
    devices = [cpu_slot(0)] if engine == "llama_cpp.server" else [gpu(0)]
    kind = "llamacpp" if engine == "llama_cpp.server" else engine
    passed = []
    for option, _, dest in options:
        if dest not in MANAGED_FIELDS[engine]:
            continue
        for form in _written(option, names):
            if engine != "vllm" and "_" in form and form.replace("_", "-") != form:
                continue  # argparse without vLLM's normalising reads it as another name
            spec = model(kind, gpu_classes=[devices[0].gpu_class], engine_args=[form, "1"])
            try:
                adapter.validate(assign(spec, devices))
            except EngineError:
                continue
            passed.append(f"{form} (sets {dest})")
    assert not passed, f"{engine}: the catalog may set what the agent manages: {passed}"


def test_sglang_reads_the_key_file_the_agent_writes_and_only_a_yaml_one(
    sglang: EngineParser, workdir: Path, tls_files: EngineTls
) -> None:
    entry = Entry("sglang", [], {}, 1, 1, 1, 0, keyed=True, tls=False)
    launch, _ = build(entry, workdir, tls_files)
    assert launch.secret_file is not None and launch.secret_file.suffix == ".yaml"
    assert sglang.parse(*started(launch, workdir))["values"]["api_key"] == KEY
    # Without the suffix (as before): SGLang refused every keyed replica.
    bare = dataclasses.replace(
        launch, secret_file=dataclasses.replace(launch.secret_file, suffix="")
    )
    answer = sglang.parse(*started(bare, workdir))
    assert not answer["ok"] and "must be YAML" in answer["error"]


@pytest.mark.parametrize(
    "extra", [["--grpc-port", "5000"], ["--tokenizer-worker-num", "2"],
              ["--admin-api-key", "mine"], ["--grpc-p", "5000"]],
)  # fmt: skip
def test_flags_sglang_refuses_beside_a_key_are_refused_by_the_catalog(
    sglang: EngineParser, workdir: Path, tls_files: EngineTls, extra: list[str]
) -> None:
    entry = Entry("sglang", extra, {}, 1, 1, 1, 0, keyed=True, tls=False)
    with pytest.raises(EngineError, match="manages"):
        build(entry, workdir, tls_files)
    if extra[0] == "--grpc-port":
        # SGLang's own hook refuses it beside the key (arg_groups/serving_hook.py).
        launch, _ = build(dataclasses.replace(entry, engine_args=[]), workdir, tls_files)
        argv, env = started(launch, workdir)
        answer = sglang.parse([*argv, *extra], env)
        assert not answer["ok"] and "incompatible with --api-key" in answer["error"]


def test_sglangs_start_line_holds_its_key_and_the_reported_tail_does_not(
    sglang: EngineParser, workdir: Path, tls_files: EngineTls
) -> None:
    launch, _ = build(Entry("sglang", [], {}, 1, 1, 1, 0, keyed=True, tls=False), workdir,
                      tls_files)  # fmt: skip
    line = sglang.parse(*started(launch, workdir))["values"]["start_line"]
    assert KEY in line  # what SGLang itself logs (entrypoints/engine.py)
    # A tail keeps TAIL_LINE_CHARS of each line: the key may sit within them
    # (here, the line's part around it) or across the cut.
    at = line.index(KEY)
    supervisor = Supervisor(workdir / "logs")
    supervisor.log_path("r-1").write_text(f"{line}\n{line[at - 200 : at + 100]}\nready\n")
    assert any(KEY in item for item in supervisor.log_tail("r-1"))
    tail = supervisor.log_tail("r-1", secret=KEY)
    assert len(tail) == 3 and not any(KEY[:12] in item for item in tail)


def test_llama_cpp_server_reads_catalog_booleans_and_prefixes_as_the_adapter_does(
    llama_cpp_server: EngineParser, workdir: Path, tls_files: EngineTls
) -> None:
    # "--cache yes" turns the cache on (server/cli.py): the adapter must size it.
    for args in (["--cache", "yes"], ["--cache=On"], ["--cache", "T"]):
        entry = Entry("llama_cpp.server", args, {}, 1, 1, 1, 0, keyed=False, tls=False)
        launch, ctx = build(entry, workdir, tls_files)
        ctx = dataclasses.replace(ctx, memory_budget_mib=2048, weights_bytes=300 << 20)
        launch = LlamaCppAdapter(server_binary="").build(ctx)
        values = llama_cpp_server.parse(*started(launch, workdir))["values"]
        if values["cache"]:
            assert "--cache_size" in launch.argv, args
            assert values["cache_size"] < 2048 << 20
    entry = Entry("llama_cpp.server", ["--embed", "on"], {}, 1, 1, 1, 0, keyed=False, tls=False)
    launch, _ = build(entry, workdir, tls_files)
    assert llama_cpp_server.parse(*started(launch, workdir))["values"]["embedding"] is True
    assert launch.dialect.embeddings


@pytest.mark.parametrize(("task", "architecture"),
                         [("generate", "Gemma3ForCausalLM"),
                          ("transcription", "WhisperForConditionalGeneration")])  # fmt: skip
def test_vllm_declares_the_routes_it_mounts_for_the_models_task(
    vllm: EngineParser, tmp_path: Path, task: str, architecture: str
) -> None:
    # vLLM mounts routes by what the model does (launchers/api_server/routers.py):
    # a chat model answered vLLM's bare 404 on /v1/embeddings, /v1/rerank,
    # /v1/score; the gateway answers OpenAI's own 404 for what is not declared.
    mounted = set(vllm.ask({"routes": [task]})["values"]["routes"])
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    spec = model("vllm")
    ctx = LaunchContext(assignment=assign(spec, [gpu(0)]), weights_path=str(tmp_path),
                        host="10.0.0.5", port=22123, devices=[gpu(0)])  # fmt: skip
    dialect = VllmAdapter(executable="vllm").build(ctx).dialect
    declared = set(dialect.extra_routes or []) | ({EMBEDDINGS} if dialect.embeddings else set())
    assert declared == mounted & set(OPTIONAL_ROUTES), (task, sorted(mounted))


SCORE_SIDES = ["text_1", "text_2", "queries", "documents", "items", "data_1", "data_2"]


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(body=st.dictionaries(
    st.sampled_from(SCORE_SIDES),
    st.one_of(st.text(min_size=1, max_size=8), st.lists(st.text(min_size=1, max_size=8),
                                                         min_size=1, max_size=3)),
))  # fmt: skip
def test_the_gateway_takes_every_score_shape_vllm_takes(
    vllm: EngineParser, body: dict[str, Any]
) -> None:
    # vLLM's /v1/score takes text_1/text_2, queries/documents, queries/items and
    # data_1/data_2; the gateway refused all but the first.
    payload = {"model": "m", **body}
    engine = vllm.ask({"score": payload})
    try:
        SCORE.check(payload)
        gateway = None
    except ApiError as exc:
        gateway = exc
    assert engine["ok"] == (gateway is None), (payload, engine, gateway)
