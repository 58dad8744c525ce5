"""The argv and environment of every engine adapter, against each engine's documented flags.

Shapes: one GPU, tp=4 on one node, a MIG instance, and rank 1 of a two-node
replica. The argv is a list (never a shell string) and catalog arguments
come last, after validation.
"""

from __future__ import annotations

import sys

import pytest
from tests.agent.helpers import assign, cpu_slot, gpu, mig_instance, model

from llmgw.agent.engines import LlamaCppAdapter, SglangAdapter, SimAdapter, VllmAdapter
from llmgw.agent.engines.base import LaunchContext, split_host_port, validate_engine_args
from llmgw.errors import EngineError
from llmgw.wire import Device, ReplicaAssignment, SimParams, WeightsSource

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
    launch = SglangAdapter(python="/opt/sglang/bin/python").build(
        ctx(assign(model("sglang"), d), d)
    )
    assert launch.argv[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
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
    assert launch.argv[0] == sys.executable
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


def test_llamacpp_python_server_on_cpu() -> None:
    d = [cpu_slot()]
    spec = model(
        "llamacpp",
        name="gemma-3-270m",
        weights=WeightsSource(kind="package", package="p"),
        gpu_classes=["cpu"],
    )
    launch = LlamaCppAdapter(server_binary="").build(ctx(assign(spec, d), d, weights=GGUF))
    assert launch.argv[:3] == [sys.executable, "-m", "llama_cpp.server"]
    assert flag(launch.argv, "--model") == GGUF
    assert flag(launch.argv, "--model_alias") == "gemma-3-270m"
    assert flag(launch.argv, "--host") == "10.0.0.5"
    assert flag(launch.argv, "--port") == "21000"
    assert flag(launch.argv, "--chat_format") == "gemma"  # the GGUF has no template
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


def test_llamacpp_catalog_chat_format_wins() -> None:
    d = [cpu_slot()]
    spec = model(
        "llamacpp",
        name="gemma-3-270m",
        engine_args=["--chat_format", "chatml"],
        gpu_classes=["cpu"],
    )
    launch = LlamaCppAdapter(server_binary="").build(ctx(assign(spec, d), d, weights=GGUF))
    assert launch.argv.count("--chat_format") == 1
    assert launch.argv[-2:] == ["--chat_format", "chatml"]


def test_llamacpp_not_gemma_keeps_its_template() -> None:
    d = [cpu_slot()]
    spec = model("llamacpp", name="qwen2-0.5b", gpu_classes=["cpu"])
    launch = LlamaCppAdapter(server_binary="").build(
        ctx(assign(spec, d), d, weights="/w/qwen.gguf")
    )
    assert "--chat_format" not in launch.argv


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
