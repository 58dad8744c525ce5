"""Two LoRA adapters of the starter model on vLLM's CPU build, through the whole path.

`llmgw up` runs a base model on vLLM with ``--enable-lora --max-lora-rank 8
--max-loras 2`` and two adapters of it (made by scripts/engines.sh with
peft, scripts/make_loras.py). Nothing is preloaded with ``--lora-modules``:
each adapter is loaded by the agent when first asked for, through vLLM's
runtime route (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, which the agent sets
because the engine runs behind its guard). Through the gateway, with the
official openai client: /v1/models lists each adapter with its parent, and
at temperature 0 each adapter's answer differs from the base's and from the
other's, so each request reached its own adapter. The entry sizes no KV
cache: the agent's default for vLLM on a CPU slot has to start it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.engines.fleet import (
    Fleet,
    adapter_entries,
    catalog_fleet,
    engines_dir,
    greedy_answer,
)

ADAPTERS = ("gemma-lora-a", "gemma-lora-b")
PROMPT = [{"role": "user", "content": "Write one sentence about the sea."}]


def catalog(dir_: Path) -> str:
    loras = dir_ / "models" / "gemma-3-270m-loras"
    base = dir_ / "models" / "gemma-3-270m-hf"
    lines = [
        "models:",
        "  - name: gemma-vllm-lora",
        "    engine: vllm",
        f"    weights: {{kind: local, path: '{base}'}}",
        "    gpu_classes: [cpu]",
        "    start_timeout_s: 900",
        "    memory_mib: 8192",
        "    kv_capacity_tokens: 32768",
        "    engine_args: [--max-model-len, '1024', --enforce-eager,",
        "                  --enable-lora, --max-lora-rank, '8', --max-loras, '2']",
        # No VLLM_CPU_KVCACHE_SPACE, as a user's entry may well say nothing of
        # it: the agent sizes the KV cache to the budget (engines/cpukv.py),
        # where vLLM alone would ask for 0.92 of the node's RAM and not start.
    ]
    paths = [loras / sub for sub in ("lora-a", "lora-b")]
    lines += adapter_entries("vllm", "gemma-vllm-lora", dict(zip(ADAPTERS, paths, strict=True)))
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def lora_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    made = engines_dir() / "models" / "gemma-3-270m-loras"
    missing = [a for a in ("lora-a", "lora-b") if not (made / a / "adapter_config.json").exists()]
    if missing:
        pytest.fail(f"no adapters in {made} ({missing}): run `make engines` (scripts/engines.sh"
                    " loras makes them with peft, seconds)", pytrace=False)  # fmt: skip
    tmp = tmp_path_factory.mktemp("vllm-lora")
    with catalog_fleet(tmp, catalog(engines_dir()), ("gemma-vllm-lora",)) as fleet:
        yield fleet


def test_two_adapters_answer_differently_from_their_base_at_temperature_0(
    lora_fleet: Fleet,
) -> None:
    listed = {m.id: m for m in lora_fleet.client().models.list().data}
    assert all(getattr(listed[name], "parent", None) == "gemma-vllm-lora" for name in ADAPTERS)
    base = greedy_answer(lora_fleet, "gemma-vllm-lora", PROMPT)
    # Each loaded on demand, then served at once.
    first = {name: greedy_answer(lora_fleet, name, PROMPT) for name in ADAPTERS}
    again = {name: greedy_answer(lora_fleet, name, PROMPT) for name in ADAPTERS}
    print(f"vllm adapters: base {base!r}, {first}", file=sys.stderr)
    assert first == again  # temperature 0: each adapter answers as itself every time
    assert base not in first.values()
    assert first[ADAPTERS[0]] != first[ADAPTERS[1]]
    (replica,) = lora_fleet.replicas("gemma-vllm-lora")
    assert sorted(replica["adapters"]) == sorted(ADAPTERS) and not replica["adapter_errors"]


def test_the_runtime_adapter_routes_answer_nobody_without_the_engine_key(
    lora_fleet: Fleet,
) -> None:
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING mounts them; the replica's advertised
    # port is its guard's, which refuses every caller without the key.
    (replica,) = lora_fleet.replicas("gemma-vllm-lora")
    base = f"http://127.0.0.1:{replica['port']}"
    body = {"lora_name": "intruder", "lora_path": "/tmp"}
    for headers in ({}, {"Authorization": "Bearer not-the-engine-key-0123456789"}):
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            answer = httpx.post(base + path, json=body, headers=headers, timeout=30)
            assert answer.status_code == 401, (path, answer.status_code, answer.text)
    listed = {m.id for m in lora_fleet.client().models.list().data}
    assert "intruder" not in listed
