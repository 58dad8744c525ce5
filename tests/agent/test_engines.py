"""The argv and environment of every engine adapter, against each engine's documented flags.

Shapes: one GPU, tp=4 on one node, a MIG instance, and rank 1 of a two-node
replica. The argv is a list (never a shell string) and catalog arguments
come last, after validation.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import sys
from pathlib import Path

import pytest
from tests.agent.helpers import assign, cpu_slot, gemma, gpu, mig_instance, model, write_gguf

from llmgw.agent.engines import LlamaCppAdapter, SglangAdapter, SimAdapter, VllmAdapter, templates
from llmgw.agent.engines.base import LaunchContext, split_host_port, validate_engine_args
from llmgw.agent.engines.nodeenv import NodeEnvAllowed
from llmgw.agent.engines.vllm import installed_version
from llmgw.agent.replicalaunch import engine_launch, kv_events_endpoint, publishes_kv_events
from llmgw.agent.supervisor import engine_environment
from llmgw.engine_env import LLAMA_CPP_PYTHON_SETTINGS
from llmgw.errors import EngineError
from llmgw.wire import Device, ModelSpec, ReplicaAssignment, SimParams, WeightsSource

W = "/data/weights/llama"


def ctx(
    a: ReplicaAssignment, devices: list[Device], weights: str | None = W, port: int = 21000
) -> LaunchContext:
    return LaunchContext(
        assignment=a, weights_path=weights, host="10.0.0.5", port=port, devices=devices
    )


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


# -- vLLM -------------------------------------------------------------------------


def test_vllm_single_gpu() -> None:
    d = [gpu(3)]
    launch = VllmAdapter().build(ctx(assign(model("vllm"), d), d))
    assert launch.argv[:3] == ["vllm", "serve", W]
    assert flag(launch.argv, "--served-model-name") == "llama-3-70b"
    assert flag(launch.argv, "--host") == "10.0.0.5"
    assert flag(launch.argv, "--port") == "21000"
    assert flag(launch.argv, "--tensor-parallel-size") == "1"
    assert flag(launch.argv, "--pipeline-parallel-size") == "1"
    assert "--nnodes" not in launch.argv and "--headless" not in launch.argv
    assert launch.env["CUDA_VISIBLE_DEVICES"] == d[0].uuid
    assert launch.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert "GGML_VK_VISIBLE_DEVICES" not in launch.env
    assert launch.health_path == "/health"


def test_vllm_publishes_kv_events_on_the_node_for_its_guard_to_relay() -> None:
    d = [gpu(3)]
    spec = model("vllm").model_copy(update={"kv_events": True})
    plain = VllmAdapter().build(ctx(assign(spec, d), d))
    assert "--kv-events-config" not in plain.argv and not plain.dialect.kv_events
    # Without a key no guard stands in front of the engine: nobody would relay them.
    assert not publishes_kv_events(assign(spec, d))
    keyed = assign(spec, d).model_copy(update={"engine_key": "k" * 32})
    assert publishes_kv_events(keyed)
    endpoint = kv_events_endpoint("r1")
    assert endpoint.startswith("ipc:///") and endpoint.endswith("/events")
    assert kv_events_endpoint("r1") != endpoint  # a name nobody can make first
    with_events = dataclasses.replace(ctx(keyed, d), kv_events=endpoint)
    launch, engine_port = engine_launch(VllmAdapter(), with_events, lambda: 21005)
    config = json.loads(flag(launch.argv, "--kv-events-config"))
    # An ipc endpoint, which vLLM binds (a non-wildcard tcp one it would connect to).
    assert config == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
    assert launch.dialect.kv_events and launch.guarded and engine_port == 21005
    # The guard gets the same endpoint, before the engine's own command.
    guard_argv = launch.argv[: launch.argv.index("--")]
    assert flag(guard_argv, "--kv-events") == endpoint
    for dp in (["--data-parallel-size", "2"], ["-dp=4"], ["--data_parallel_size", "2"]):
        parallel = keyed.model_copy(update={"model": spec.model_copy(update={"engine_args": dp})})
        with pytest.raises(EngineError, match="data-parallel"):
            VllmAdapter().build(dataclasses.replace(ctx(parallel, d), kv_events=endpoint))


def test_vllm_tp4_with_catalog_args_last() -> None:
    d = [gpu(i) for i in range(4)]
    spec = model(
        "vllm",
        tp=4,
        engine_args=["--max-model-len", "8192", "--enable-prefix-caching"],
        env={"VLLM_LOGGING_LEVEL": "DEBUG"},
    )
    launch = VllmAdapter().build(ctx(assign(spec, d), d))
    assert flag(launch.argv, "--tensor-parallel-size") == "4"
    assert launch.argv[-3:] == ["--max-model-len", "8192", "--enable-prefix-caching"]
    assert launch.env["CUDA_VISIBLE_DEVICES"] == ",".join(x.uuid for x in d)
    assert launch.env["VLLM_LOGGING_LEVEL"] == "DEBUG"


def test_vllm_mig_instance() -> None:
    d = [mig_instance()]
    spec = model("vllm", gpu_classes=["a100-80g-mig-3g.40gb"])
    launch = VllmAdapter().build(ctx(assign(spec, d), d))
    assert launch.env["CUDA_VISIBLE_DEVICES"] == "MIG-11111111-2222-3333-4444-555555555555"
    assert "GGML_VK_VISIBLE_DEVICES" not in launch.env


def test_vllm_rank1_of_two_nodes_is_headless() -> None:
    d = [gpu(i) for i in range(8)]
    spec = model("vllm", tp=8, pp=2, nodes=2)
    a = assign(spec, d, rank=1, leader="10.0.0.1:29500")
    launch = VllmAdapter().build(ctx(a, d))
    assert flag(launch.argv, "--tensor-parallel-size") == "8"
    assert flag(launch.argv, "--pipeline-parallel-size") == "2"
    assert flag(launch.argv, "--nnodes") == "2"
    assert flag(launch.argv, "--node-rank") == "1"
    assert flag(launch.argv, "--master-addr") == "10.0.0.1"
    assert flag(launch.argv, "--master-port") == "29500"
    assert "--headless" in launch.argv
    assert launch.health_path is None  # no API server on a headless rank
    assert launch.serving_probe is None
    leader = VllmAdapter().build(ctx(assign(spec, d, rank=0, leader="10.0.0.1:29500"), d))
    assert "--headless" not in leader.argv and leader.health_path == "/health"


def test_vllm_multi_node_without_leader_is_refused() -> None:
    d = [gpu(0)]
    spec = model("vllm", tp=1, pp=2, nodes=2)
    with pytest.raises(EngineError, match="leader_address"):
        VllmAdapter().build(ctx(assign(spec, d, rank=1), d))


# -- SGLang ---------------------------------------------------------------------------


def test_sglang_single_gpu() -> None:
    d = [gpu(0)]
    launch = SglangAdapter(executable="/opt/sglang/bin/sglang").build(
        ctx(assign(model("sglang"), d), d)
    )
    # `sglang serve`: 0.5.23 warns that `python -m sglang.launch_server` is only still supported.
    assert launch.argv[:3] == ["/opt/sglang/bin/sglang", "serve", "--model-path"]
    assert flag(launch.argv, "--model-path") == W
    assert flag(launch.argv, "--served-model-name") == "llama-3-70b"
    assert flag(launch.argv, "--host") == "10.0.0.5"
    assert flag(launch.argv, "--port") == "21000"
    assert flag(launch.argv, "--tp-size") == "1"
    assert flag(launch.argv, "--pp-size") == "1"
    assert launch.env["CUDA_VISIBLE_DEVICES"] == d[0].uuid


def test_sglang_tp4() -> None:
    d = [gpu(i) for i in range(4)]
    launch = SglangAdapter().build(ctx(assign(model("sglang", tp=4), d), d))
    assert launch.argv[:2] == ["sglang", "serve"]
    assert flag(launch.argv, "--tp-size") == "4"
    assert launch.env["CUDA_VISIBLE_DEVICES"].count(",") == 3


def test_sglang_mig_instance() -> None:
    d = [mig_instance()]
    launch = SglangAdapter().build(ctx(assign(model("sglang", gpu_classes=["x"]), d), d))
    assert launch.env["CUDA_VISIBLE_DEVICES"] == d[0].uuid


def test_sglang_rank1_of_two_nodes() -> None:
    d = [gpu(i) for i in range(8)]
    spec = model("sglang", tp=16, nodes=2)
    launch = SglangAdapter().build(ctx(assign(spec, d, rank=1, leader="10.0.0.1:5000"), d))
    assert flag(launch.argv, "--tp-size") == "16"
    assert flag(launch.argv, "--nnodes") == "2"
    assert flag(launch.argv, "--node-rank") == "1"
    assert flag(launch.argv, "--dist-init-addr") == "10.0.0.1:5000"
    assert launch.health_path is None


def test_sglang_leader_needs_a_port() -> None:
    d = [gpu(0)]
    spec = model("sglang", tp=2, nodes=2)
    with pytest.raises(EngineError, match="needs a port"):
        SglangAdapter().build(ctx(assign(spec, d, rank=1, leader="10.0.0.1"), d))


# -- llama.cpp ------------------------------------------------------------------------

GGUF = "/data/weights/gemma-3-270m-q4_k_m.gguf"


def test_llamacpp_python_server_on_cpu(tmp_path: Path) -> None:
    d = [cpu_slot()]
    weights = write_gguf(tmp_path / "gemma.gguf", "gemma3")  # no template, as the starter's
    launch = LlamaCppAdapter(server_binary="").build(ctx(assign(gemma(), d), d, weights=weights))
    assert launch.argv[:3] == [sys.executable, "-m", "llama_cpp.server"]
    assert flag(launch.argv, "--model") == weights
    assert flag(launch.argv, "--model_alias") == "gemma-3-270m"
    assert flag(launch.argv, "--host") == "10.0.0.5"
    assert flag(launch.argv, "--port") == "21000"
    # The GGUF has no template: Gemma 3's official one (its gemma format
    # would drop system messages).
    assert flag(launch.argv, "--chat_format") == "hf-tokenizer-config"
    config = flag(launch.argv, "--hf_tokenizer_config_path")
    assert config == templates.template_files("gemma3").tokenizer_config
    assert "chat_template" in json.loads(Path(config).read_text())
    # No per-token logits (about 1 MB a token for Gemma), and no RAM prompt
    # cache, whose cache_size does not count what it holds (test_memory_budget).
    assert flag(launch.argv, "--logits_all") == "false"
    assert "--cache" not in launch.argv
    assert "--n_gpu_layers" not in launch.argv
    assert launch.env["CUDA_VISIBLE_DEVICES"] == ""  # a CPU slot never takes a GPU
    assert launch.health_path == "/v1/models"  # llama_cpp.server answers 404 on /health
    # ... and its /v1/models waits for the model lock (and cuts a running
    # stream short): while serving, the lock-free docs page is probed instead.
    assert launch.serving_probe == "/docs"


def test_llamacpp_catalog_chat_format_wins(tmp_path: Path) -> None:
    d = [cpu_slot()]
    spec = model(
        "llamacpp",
        name="gemma-3-270m",
        engine_args=["--chat_format", "chatml"],
        gpu_classes=["cpu"],
    )
    weights = write_gguf(tmp_path / "gemma.gguf", "gemma3")
    launch = LlamaCppAdapter(server_binary="").build(ctx(assign(spec, d), d, weights=weights))
    assert launch.argv.count("--chat_format") == 1
    assert launch.argv[-2:] == ["--chat_format", "chatml"]


@pytest.mark.parametrize("server", ["", "/usr/local/bin/llama-server"])
def test_llamacpp_model_with_a_template_or_unknown_family_keeps_its_own(
    tmp_path: Path, server: str
) -> None:
    d = [cpu_slot()]
    spec = model("llamacpp", name="gemma-3-270m", gpu_classes=["cpu"])
    own = write_gguf(tmp_path / "own.gguf", "gemma3", "{{ messages }}")
    other = write_gguf(tmp_path / "qwen.gguf", "qwen2")
    for weights in (own, other, "/w/missing.gguf"):
        argv = LlamaCppAdapter(server_binary=server).build(
            ctx(assign(spec, d), d, weights=weights)
        ).argv
        assert not any("chat" in item or "tokenizer_config" in item for item in argv), argv


def test_llama_server_gets_the_template_file_never_a_family_name(tmp_path: Path) -> None:
    # Current llama-server reads --chat-template's value as Jinja text: "gemma"
    # would make every prompt the word "gemma" (common/chat.cpp).
    d = [cpu_slot()]
    weights = write_gguf(tmp_path / "gemma.gguf", "gemma3")
    launch = LlamaCppAdapter(server_binary="/usr/local/bin/llama-server").build(
        ctx(assign(gemma(), d), d, weights=weights)
    )
    assert "--chat-template" not in launch.argv
    assert flag(launch.argv, "--chat-template-file") == templates.template_files("gemma3").jinja
    with pytest.raises(EngineError, match="Jinja text"):
        LlamaCppAdapter(server_binary="llama-server").validate(
            assign(gemma().model_copy(update={"engine_args": ["--chat-template", "gemma"]}), d)
        )


def test_llamacpp_binary_single_gpu_and_tp4() -> None:
    d = [gpu(2)]
    adapter = LlamaCppAdapter(server_binary="/usr/local/bin/llama-server")
    launch = adapter.build(ctx(assign(model("llamacpp"), d), d, weights=GGUF))
    assert launch.argv[0] == "/usr/local/bin/llama-server"
    assert flag(launch.argv, "--model") == GGUF
    assert flag(launch.argv, "--alias") == "llama-3-70b"
    assert flag(launch.argv, "--port") == "21000"
    assert flag(launch.argv, "--n-gpu-layers") == "999"
    assert launch.health_path == "/health" and launch.serving_probe == "/health"
    assert launch.env["CUDA_VISIBLE_DEVICES"] == d[0].uuid
    d4 = [gpu(i) for i in range(4)]
    launch4 = adapter.build(ctx(assign(model("llamacpp", tp=4), d4), d4, weights=GGUF))
    assert launch4.env["CUDA_VISIBLE_DEVICES"] == ",".join(x.uuid for x in d4)


def test_llamacpp_vulkan_build_pins_by_index_and_refuses_mig() -> None:
    d = [gpu(1), gpu(3)]
    adapter = LlamaCppAdapter(server_binary="llama-server", vulkan=True)
    launch = adapter.build(ctx(assign(model("llamacpp", tp=2), d), d, weights=GGUF))
    assert launch.env["GGML_VK_VISIBLE_DEVICES"] == "1,3"
    m = [mig_instance()]
    with pytest.raises(EngineError, match="Vulkan"):
        adapter.build(ctx(assign(model("llamacpp", gpu_classes=["x"]), m), m, weights=GGUF))


def test_llamacpp_mig_instance_cuda_build() -> None:
    d = [mig_instance()]
    launch = LlamaCppAdapter(server_binary="").build(
        ctx(assign(model("llamacpp", gpu_classes=["x"]), d), d, weights=GGUF)
    )
    assert launch.env["CUDA_VISIBLE_DEVICES"] == d[0].uuid
    assert flag(launch.argv, "--n_gpu_layers") == "-1"


def test_llamacpp_refuses_two_nodes() -> None:
    d = [gpu(0)]
    spec = model("llamacpp", pp=2, nodes=2)
    with pytest.raises(EngineError, match="one node"):
        LlamaCppAdapter(server_binary="").build(ctx(assign(spec, d, rank=1, leader="h:1"), d))


# -- sim -------------------------------------------------------------------------------


def test_sim_argv() -> None:
    d = [cpu_slot()]
    spec = model("sim", name="sim-model", weights=WeightsSource(kind="none"), gpu_classes=["cpu"])
    spec.sim = SimParams(startup_s=0.1)
    launch = SimAdapter().build(ctx(assign(spec, d), d, weights=None))
    assert launch.argv[:3] == [sys.executable, "-m", "llmgw.sim.engine"]
    assert flag(launch.argv, "--model") == "sim-model"
    assert flag(launch.argv, "--port") == "21000"
    assert SimParams.model_validate_json(flag(launch.argv, "--params-json")).startup_s == 0.1
    assert launch.health_path == "/health"


# -- catalog input ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-model-len", "8192\n--port"], "line break"),
        (["a\x00b"], "NUL"),
        (["--port", "9000"], "manages"),
        (["--port=9000"], "manages"),
        (["--served-model-name", "x"], "manages"),
        ([1], "not a string"),
    ],
)
def test_bad_engine_args_are_refused(args: list[object], message: str) -> None:
    with pytest.raises(EngineError, match=message):
        validate_engine_args(args, ["--port", "--served-model-name"])


def test_catalog_env_cannot_undo_pinning() -> None:
    d = [gpu(0)]
    spec = model("vllm", env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    with pytest.raises(EngineError, match="pin"):
        VllmAdapter().build(ctx(assign(spec, d), d))


def test_split_host_port() -> None:
    assert split_host_port("10.0.0.1:5000") == ("10.0.0.1", 5000)
    assert split_host_port("[fd00::1]:5000") == ("fd00::1", 5000)
    assert split_host_port("node-a") == ("node-a", None)
    with pytest.raises(EngineError):
        split_host_port("h:99999")


# -- checked against the engines' own sources ----------------------------------------
# vLLM 0.34, SGLang 0.5.23, llama-cpp-python 0.3.36 and the llama-server it bundles.

CPU = [cpu_slot()]


def gguf_model(**fields: object) -> ModelSpec:
    spec = model("llamacpp", name="gemma-3-270m", gpu_classes=["cpu"])
    return spec.model_copy(update=fields)


def test_llamacpp_context_is_the_models_kv_capacity() -> None:
    # llama_cpp.server's n_ctx defaults to 2048 whatever the catalog says;
    # the gateway sizes its prefix index from kv_capacity_tokens.
    spec = gguf_model(kv_capacity_tokens=8192)
    python = LlamaCppAdapter(server_binary="").build(ctx(assign(spec, CPU), CPU, weights=GGUF))
    assert flag(python.argv, "--n_ctx") == "8192"
    binary = LlamaCppAdapter(server_binary="llama-server").build(
        ctx(assign(spec, CPU), CPU, weights=GGUF)
    )
    assert flag(binary.argv, "--ctx-size") == "8192"


def test_llama_cpp_server_never_cuts_a_stream_for_another_request() -> None:
    # Its interrupt_requests defaults to true: a second request ends a running
    # stream as if complete. The real-engine test streams two at once.
    launch = LlamaCppAdapter(server_binary="").build(
        ctx(assign(gguf_model(), CPU), CPU, weights=GGUF)
    )
    assert flag(launch.argv, "--interrupt_requests") == "false"


SLIPPED = [
    # vLLM: "_" is "-", --flag.key sets --flag, argparse takes prefixes and glued values.
    (VllmAdapter(), ["--served_model_name", "x"], "--served-model-name"),
    (VllmAdapter(), ["--served-model-name.x", "y"], "--served-model-name"),
    (VllmAdapter(), ["--po", "9000"], "--port"),
    (VllmAdapter(), ["--api_key=k"], "--api-key"),
    (VllmAdapter(), ["--uds", "/tmp/s"], "--uds"),
    (VllmAdapter(), ["--config", "serve.yaml"], "--config"),
    (VllmAdapter(), ["-n", "2"], "-n"),
    (VllmAdapter(), ["-n2"], "-n"),
    (VllmAdapter(), ["-r=1"], "-r"),
    (VllmAdapter(), ["-t", "2"], "-tp"),
    (VllmAdapter(), ["--master_ad", "h"], "--master-addr"),
    (VllmAdapter(), ["--headl"], "--headless"),
    (VllmAdapter(), ["--kv_events_config", "{}"], "--kv-events-config"),
    (VllmAdapter(), ["--kv-events-config.endpoint", "tcp://*:1"], "--kv-events-config"),
    # SGLang: argparse prefixes, an alias of --dist-init-addr, a config file.
    (SglangAdapter(), ["--nccl-init-addr", "h:5000"], "--nccl-init-addr"),
    (SglangAdapter(), ["--config", "serve.yaml"], "--config"),
    (SglangAdapter(), ["--tp", "2"], "--tp-size"),
    (SglangAdapter(), ["--po=9000"], "--port"),
    (SglangAdapter(), ["--served", "x"], "--served-model-name"),
    # llama-server: exact names, "_" read as "-"; every model source, the API prefix.
    (LlamaCppAdapter("llama-server"), ["-hfr", "org/m"], "-hfr"),
    (LlamaCppAdapter("llama-server"), ["-hff", "m.gguf"], "-hff"),
    (LlamaCppAdapter("llama-server"), ["--hf_file", "m.gguf"], "--hf-file"),
    (LlamaCppAdapter("llama-server"), ["-dr", "gemma3"], "-dr"),
    (LlamaCppAdapter("llama-server"), ["--api_prefix", "/x"], "--api-prefix"),
    (LlamaCppAdapter("llama-server"), ["--models-dir", "/m"], "--models-dir"),
    (LlamaCppAdapter("llama-server"), ["--models-preset", "p.ini"], "--models-preset"),
    (LlamaCppAdapter("llama-server"), ["-c", "4096"], "-c"),
    (LlamaCppAdapter("llama-server"), ["--ctx_size", "4096"], "--ctx-size"),
    # llama_cpp.server: argparse prefixes of its underscore names.
    (LlamaCppAdapter(""), ["--po", "9000"], "--port"),
    (LlamaCppAdapter(""), ["--n_c", "4096"], "--n_ctx"),
    (LlamaCppAdapter(""), ["--interrupt", "true"], "--interrupt_requests"),
    (LlamaCppAdapter(""), ["--config_f", "c.json"], "--config_file"),
    (LlamaCppAdapter(""), ["--model_a=x"], "--model_alias"),
]


@pytest.mark.parametrize(("adapter", "args", "managed"), SLIPPED)
def test_a_managed_flag_is_refused_in_any_spelling_its_engine_reads(
    adapter: VllmAdapter | SglangAdapter | LlamaCppAdapter, args: list[str], managed: str
) -> None:
    spec = model(adapter.kind, engine_args=args)
    with pytest.raises(EngineError, match="which the agent manages") as caught:
        adapter.validate(assign(spec, CPU))
    assert f"sets {managed}" in str(caught.value)


def test_the_refusal_says_what_the_engine_reads_and_what_to_do() -> None:
    spec = gguf_model(engine_args=["--n_c", "4096"])
    with pytest.raises(EngineError) as caught:
        LlamaCppAdapter("").validate(assign(spec, CPU))
    assert str(caught.value) == (
        "engine_args[0] sets --n_ctx ('--n_c', which the engine reads as --n_ctx), which the"
        " agent manages for this engine; set the model's kv_capacity_tokens instead"
    )


@pytest.mark.parametrize(
    ("adapter", "args"),
    [
        (VllmAdapter(), ["--max_model_len", "8192", "-O3", "-q", "awq", "-dp", "2"]),
        (VllmAdapter(), ["--seed", "-1", "--compilation-config.level", "3"]),
        (SglangAdapter(), ["--mem-fraction-static", "0.8", "--enable-metrics"]),
        (LlamaCppAdapter("llama-server"), ["-ngl", "99", "--threads", "4", "-np", "2"]),
        (LlamaCppAdapter(""), ["--cache", "true", "--n_threads", "4", "--seed", "-1"]),
    ],
)
def test_flags_the_agent_does_not_manage_pass(
    adapter: VllmAdapter | SglangAdapter | LlamaCppAdapter, args: list[str]
) -> None:
    adapter.validate(assign(model(adapter.kind, engine_args=args), CPU))


def test_llama_cpp_server_rules_agree_with_its_own_parser() -> None:
    # Every flag of the installed llama_cpp.server, and every prefix of one,
    # through the server's real argparse: whatever it reads as a managed flag
    # is refused, and none of its own flags is.
    from llama_cpp.server.cli import add_args_from_model
    from llama_cpp.server.settings import Settings

    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    add_args_from_model(parser, Settings)
    parser.add_argument("--config_file")
    rules = LlamaCppAdapter("").managed_flags
    flags = [o for o in parser._option_string_actions if o.startswith("--")]
    dest_of = {o: parser._option_string_actions[o].dest for o in flags}
    checked = 0
    for full in flags:
        for cut in range(3, len(full) + 1):
            item = full[:cut]
            try:
                with contextlib.redirect_stderr(io.StringIO()):
                    parsed, _ = parser.parse_known_args([item, "{}" if "kwargs" in full else "1"])
            except (SystemExit, argparse.ArgumentError):
                continue  # ambiguous or a bad value: the engine refuses it itself
            read_flag = next((o for o in flags if getattr(parsed, dest_of[o]) is not None), None)
            if read_flag in rules.managed:
                assert rules.managed_flag(item) == read_flag, item
            elif item in flags:
                assert rules.managed_flag(item) is None, item
            checked += 1
    assert checked > 300


def test_llama_cpp_settings_are_the_installed_servers() -> None:
    from llama_cpp.server.settings import Settings

    assert set(Settings.model_fields) | {"config_file"} == LLAMA_CPP_PYTHON_SETTINGS


@pytest.mark.parametrize(
    "env", [{"PORT": "9"}, {"port": "9"}, {"CONFIG_FILE": "/c.json"}, {"N_CTX": "64"},
            {"LLAMA_ARG_PORT": "9"}, {"LLAMA_API_KEY": "k"}]
)  # fmt: skip
def test_llamacpp_env_read_over_the_command_line_is_refused(env: dict[str, str]) -> None:
    name = next(iter(env))
    with pytest.raises(EngineError, match=f"^env {name}: llama"):
        LlamaCppAdapter("").validate(assign(gguf_model(env=env), CPU))


def test_other_env_passes_and_other_engines_do_not_read_those_names() -> None:
    env = {"LLAMA_ARG_THREADS": "4", "OMP_NUM_THREADS": "2"}
    LlamaCppAdapter("").validate(assign(gguf_model(env=env), CPU))
    VllmAdapter().validate(assign(model("vllm", env={"VLLM_CPU_KVCACHE_SPACE": "1"}), CPU))


def test_what_a_llama_cpp_server_would_read_is_not_inherited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    python = LlamaCppAdapter("").build(ctx(assign(gguf_model(), CPU), CPU, weights=GGUF))
    binary = LlamaCppAdapter("llama-server").build(
        ctx(assign(gguf_model(), CPU), CPU, weights=GGUF)
    )
    assert {"PORT", "HOST", "CONFIG_FILE", "MODEL", "API_KEY", "N_CTX"} <= python.drop_env
    assert {"LLAMA_ARG_PORT", "LLAMA_API_KEY", "LLAMA_ARG_API_PREFIX"} <= binary.drop_env
    assert (
        "PORT" not in binary.drop_env
        # vLLM reads its settings from argv; only its key variable (the agent sets it).
        and VllmAdapter().build(ctx(assign(model("vllm"), [gpu(0)]), [gpu(0)])).drop_env
        == {"VLLM_API_KEY"}
    )
    for name, value in {
        "PORT": "9",
        "port": "9",
        "Config_File": "/c",
        "LLAMA_ARG_THREADS": "4",
    }.items():
        monkeypatch.setenv(name, value)
    env = engine_environment(python.env, python.drop_env)
    assert not {"PORT", "port", "Config_File"} & env.keys()
    assert env["LLAMA_ARG_THREADS"] == "4" and env["CUDA_VISIBLE_DEVICES"] == ""


def test_vulkan_llama_server_on_a_cpu_slot_sees_no_gpu() -> None:
    # A Vulkan build reads no CUDA variable; with GGML_VK_VISIBLE_DEVICES set
    # and empty, ggml-vulkan opens no device.
    adapter = LlamaCppAdapter(server_binary="llama-server", vulkan=True)
    launch = adapter.build(ctx(assign(gguf_model(), CPU), CPU, weights=GGUF))
    assert launch.env["GGML_VK_VISIBLE_DEVICES"] == ""
    assert launch.env["CUDA_VISIBLE_DEVICES"] == ""


def test_vllm_older_than_0_11_1_cannot_span_nodes() -> None:
    d = [gpu(i) for i in range(8)]
    spec = model("vllm", tp=8, pp=2, nodes=2)
    shard = assign(spec, d, rank=1, leader="10.0.0.1:29500")
    with pytest.raises(EngineError, match=r"^vLLM 0\.11\.0 on this node cannot span nodes"):
        VllmAdapter(version="0.11.0").build(ctx(shard, d))
    for version in ("0.22.0", "0.22.1rc1", "0.34.0", "not a version"):
        assert "--nnodes" in VllmAdapter(version=version).build(ctx(shard, d)).argv


def test_vllm_older_than_0_22_is_refused_for_its_key_bypass() -> None:
    d = [gpu(0)]
    one = assign(model("vllm"), d)
    for version in ("0.6.0", "0.11.1", "0.21.9"):
        with pytest.raises(EngineError, match=r"known way past its API key .* to 0\.22"):
            VllmAdapter(version=version).build(ctx(one, d))
    for version in ("0.22.0", "0.34.0", "not a version"):
        VllmAdapter(version=version).build(ctx(one, d))


def test_vllm_version_is_read_beside_its_script(tmp_path: Path) -> None:
    env = tmp_path / "venv"
    (env / "bin").mkdir(parents=True)
    script = env / "bin" / "vllm"
    script.write_text(f"#!{env}/bin/python3\nfrom vllm.entrypoints.cli.main import main\n")
    script.chmod(0o755)
    assert installed_version(str(script)) is None  # no dist-info: unknown, nothing refused
    dist = env / "lib" / "python3.12" / "site-packages" / "vllm-0.10.2.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.4\nName: vllm\nVersion: 0.10.2\n")
    assert installed_version(str(script)) == "0.10.2"
    adapter = VllmAdapter(str(script))
    d = [gpu(0)]
    shard = assign(model("vllm", pp=2, nodes=2), d, rank=0, leader="10.0.0.1:29500")
    with pytest.raises(EngineError, match=r"came in vLLM 0\.11\.1; upgrade vLLM, or set nodes: 1"):
        adapter.validate(shard)
    assert installed_version(str(tmp_path / "missing")) is None


def test_engine_scripts_beside_the_agents_python_are_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # pip install sglang into llmgw's environment puts the script beside its
    # Python, off PATH when the agent runs under systemd.
    (tmp_path / "python").touch()
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    assert SglangAdapter().executable == "sglang"  # not there: found on PATH
    (tmp_path / "sglang").touch()
    (tmp_path / "vllm").touch()
    assert SglangAdapter().executable == str(tmp_path / "sglang")
    assert VllmAdapter().executable == str(tmp_path / "vllm")


def test_only_a_nodes_admin_lets_other_env_reach_an_engine() -> None:
    # The catalog (the admin token) cannot give an engine LD_PRELOAD and the
    # like; the node's own admin may allow a name on that node
    # (llmgw agent --engine-env-allow), never one the agent manages.
    d = [gpu(0)]
    spec = model("vllm", env={"LD_LIBRARY_PATH": "/opt/driver/lib", "VLLM_LOGGING_LEVEL": "DEBUG"})
    with pytest.raises(EngineError, match="LD_LIBRARY_PATH is not a vllm setting"):
        VllmAdapter().validate(assign(spec, d))
    allowed = NodeEnvAllowed(VllmAdapter(), {"LD_LIBRARY_PATH", "VLLM_API_KEY"})
    allowed.validate(assign(spec, d))
    launch = allowed.build(ctx(assign(spec, d), d))
    assert launch.env["LD_LIBRARY_PATH"] == "/opt/driver/lib"
    assert launch.env["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert launch.env["CUDA_VISIBLE_DEVICES"] == d[0].uuid
    keyed = model("vllm", env={"VLLM_API_KEY": "mine"})
    with pytest.raises(EngineError, match="API key"):
        allowed.validate(assign(keyed, d))


def test_llama_server_starts_with_its_adapters_at_scale_0_numbered_for_the_gateway() -> None:
    d = [cpu_slot()]
    adapter_specs = [
        ModelSpec(name=n, engine="llama-server", base="g", weights=WeightsSource(
            kind="local", path=f"/w/{n}.gguf")) for n in ("g-a", "g-b")
    ]  # fmt: skip
    a = assign(gemma(), d).model_copy(update={"adapters": adapter_specs})
    server = LlamaCppAdapter(server_binary="/usr/local/bin/llama-server")
    assert server.adapters_at_start
    launch = server.build(LaunchContext(
        assignment=a, weights_path=GGUF, host="h", port=1, devices=d,
        adapters=(("g-a", "/c/a.gguf"), ("g-b", "/c/b.gguf")), memory_budget_mib=8192,
    ))  # fmt: skip
    argv = launch.argv
    loras = [argv[i + 1] for i, item in enumerate(argv) if item == "--lora"]
    assert loras == ["/c/a.gguf", "/c/b.gguf"]  # one flag each, in the numbered order
    assert "--lora-init-without-apply" in argv
    # Its RAM prompt cache keeps states without the adapter they were made under.
    assert flag(argv, "--cache-ram") == "0"
    assert launch.dialect.lora_ids == {"g-a": 0, "g-b": 1}
    plain = server.build(ctx(assign(gemma(), d), d, weights=GGUF))
    assert plain.dialect.lora_ids == {} and "--lora" not in plain.argv
    with pytest.raises(EngineError, match="splits --lora at commas"):
        server.build(LaunchContext(assignment=a, weights_path=GGUF, host="h", port=1,
                                   devices=d, adapters=(("g-a", "/c/a,b.gguf"),)))  # fmt: skip
    # The catalog's own --lora would shift every number after it.
    for args in (["--lora", "/x.gguf"], ["--lora-scaled", "/x.gguf:1"]):
        with pytest.raises(EngineError, match="catalog entry with `base:`"):
            server.validate(assign(gemma().model_copy(update={"engine_args": args}), d))
    python = LlamaCppAdapter(server_binary="")
    assert not python.adapters_at_start
    with pytest.raises(EngineError, match="need llama-server"):
        python.validate(a)


def test_llama_servers_idle_sleep_takes_its_own_values_only() -> None:
    d = [cpu_slot()]
    server = LlamaCppAdapter(server_binary="/usr/local/bin/llama-server")
    for good in (["--sleep-idle-seconds", "30"], ["--sleep_idle_seconds=-1"]):
        server.validate(assign(gemma().model_copy(update={"engine_args": good}), d))
    for bad in (["--sleep-idle-seconds", "0"], ["--sleep-idle-seconds", "-5"],
                ["--sleep-idle-seconds=soon"]):  # fmt: skip
        with pytest.raises(EngineError, match="whole number of seconds above 0, or -1"):
            server.validate(assign(gemma().model_copy(update={"engine_args": bad}), d))


def test_a_gguf_is_read_once_while_unchanged(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    # A guarded engine's launch is built twice, each time on a cold start's path.
    from llmgw.agent.engines import gguf

    path = write_gguf(tmp_path / "m.gguf", "gemma3")
    reads: list[str] = []
    real = gguf._read
    monkeypatch.setattr(gguf, "_read", lambda p: reads.append(p) or real(p))
    assert gguf.read_info(path) == gguf.read_info(path)
    assert reads == [path]
    write_gguf(tmp_path / "m.gguf", "qwen2", chat_template="{{ messages }}")  # changed
    assert gguf.read_info(path).architecture == "qwen2" and reads == [path, path]
