"""vLLM's runtime adapter and sleep routes: switched on only for engines behind their guard."""

from __future__ import annotations

from tests.agent.helpers import assign, gpu, model

from llmgw.agent.engines import VllmAdapter
from llmgw.agent.engines.base import LaunchContext

KEY = "k" * 32


def env_of(engine_args: list[str], key: str | None) -> dict[str, str]:
    a = assign(model("vllm", engine_args=engine_args), [gpu(0)])
    a = a.model_copy(update={"engine_key": key})
    ctx = LaunchContext(assignment=a, weights_path="/w", host="127.0.0.1", port=21000,
                        devices=[gpu(0)])  # fmt: skip
    return dict(VllmAdapter().build(ctx).env or {})


def test_lora_and_sleep_switches_follow_the_catalogs_flags_and_need_the_key() -> None:
    env = env_of(["--enable-lora", "--max-loras", "2", "--enable-sleep-mode"], KEY)
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    plain = env_of([], KEY)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain
    assert "VLLM_SERVER_DEV_MODE" not in plain
    # No key, no guard: the sleep routes would answer anyone.
    bare = env_of(["--enable-lora", "--enable-sleep-mode"], None)
    assert not {"VLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_SERVER_DEV_MODE"} & set(bare)
