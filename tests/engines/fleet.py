"""One `llmgw up` serving the starter model on three real engines (examples/engines-cpu.yaml).

The engines come from ``make engines`` (scripts/engines.sh), in their own
environments under ``$LLMGW_ENGINES_DIR`` (default ``~/.cache/llmgw/engines``);
without them these tests fail and say so: they are the only place vLLM and
llama-server run in the suite. ``llmgw up`` starts once per module and is
stopped at its end: vLLM alone takes minutes to start on two cores.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from openai import OpenAI
from tests.servers import ROOT, free_port, spawn_up, stop_group, wait_up_json

from llmgw.agent.engineguard import GUARD_MODULE

CATALOG = ROOT / "examples" / "engines-cpu.yaml"
MODELS = ("gemma-vllm", "gemma-llama-server", "gemma-llamacpp")
# What names each model's engine in its argv (the served name's flag).
NAME_FLAGS = ("--served-model-name", "--alias", "--model_alias")
# vLLM takes ~2.5 min to start on 2 idle cores; a loaded CI machine doubles that.
READY_WITHIN_S = 900.0


def engines_dir() -> Path:
    return Path(os.environ.get("LLMGW_ENGINES_DIR") or "~/.cache/llmgw/engines").expanduser()


def engine_env() -> dict[str, str]:
    """What points `llmgw up` at what `make engines` installed (scripts/engines.sh env)."""
    venv = str(Path(sys.executable).parent.parent)
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "engines.sh"), "env"], cwd=ROOT, check=True,
        capture_output=True, text=True, env={**os.environ, "VENV": venv},
    )
    env = dict(line.removeprefix("export ").split("=", 1)
               for line in done.stdout.splitlines() if "=" in line)
    needed = [
        Path(env["LLMGW_ENGINE_VLLM"]),
        Path(env["LLMGW_ENGINE_LLAMA_SERVER"]),
        Path(env["LLMGW_ENGINES_DIR"]) / "models" / "gemma-3-270m-hf" / "config.json",
    ]
    missing = [str(path) for path in needed if not path.exists()]
    if missing:
        pytest.fail(
            "the engine tests need the engines `make engines` installs (scripts/engines.sh);"
            f" missing: {', '.join(missing)}. Run `make engines` (first time ~10 min).",
            pytrace=False,
        )
    return env


@dataclass
class Fleet:
    """The running `llmgw up` and what the tests need of it."""

    proc: subprocess.Popen[bytes]
    data: Path
    port: int
    log: Path
    env: dict[str, str]
    info: dict[str, Any]
    # Seconds from assignment to ready per model (the control plane's record).
    start_s: dict[str, float] = field(default_factory=dict)
    # Every engine process seen, stopped at the end if still running (one
    # adopted by a restarted `up` is not its child).
    engine_pids: set[int] = field(default_factory=set)

    def client(self, timeout: float = 120.0) -> OpenAI:
        return OpenAI(base_url=self.info["api_url"], api_key=self.info["api_key"],
                      max_retries=0, timeout=timeout)

    def admin(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.request(method, f"{self.info['admin_url']}/admin/v1{path}",
                             headers={"Authorization": f"Bearer {self.info['admin_token']}"},
                             timeout=30, **kwargs)

    def replicas(self, model: str) -> list[dict[str, Any]]:
        answer = self.admin("GET", "/replicas")
        answer.raise_for_status()
        return [r for r in answer.json() if r["model"] == model]

    def engine(self, model: str) -> psutil.Process:
        """The engine process serving ``model``: the one listening behind the replica's
        advertised port (its guard's ``--port``, agent.engineguard, or its own), found
        by that port so that another `llmgw up` serving the same names is never taken."""
        (replica,) = self.replicas(model)
        port = str(replica["port"])
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            argv = proc.info["cmdline"] or []
            named = any(f in argv and argv[argv.index(f) + 1] == model for f in NAME_FLAGS)
            if not named or "--port" not in argv:
                continue
            listens = argv[argv.index("--port") + 1] == port
            if GUARD_MODULE in argv and listens:  # its guard: the engine is its child
                found += [child for child in proc.children()
                          if GUARD_MODULE not in child.cmdline()]
            elif GUARD_MODULE not in argv and listens:
                found.append(proc)
        assert len(found) == 1, f"{model}: engine processes {found} behind port {port}"
        self.engine_pids.add(found[0].pid)
        return found[0]

    def engine_tree(self, model: str) -> list[psutil.Process]:
        """What the engine's memory budget covers: its guard (when it has one), the
        engine and every process the engine started."""
        engine = self.engine(model)
        parent = engine.parent()
        root = parent if parent is not None and GUARD_MODULE in parent.cmdline() else engine
        return [root, *root.children(recursive=True)]

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def wait_ready(self, models: tuple[str, ...] = MODELS,
                   within_s: float = READY_WITHIN_S) -> dict[str, float]:
        """Until each model answers through the gateway; seconds each took from now."""
        client = self.client(timeout=60)
        started = time.monotonic()
        waited: dict[str, float] = {}
        last: dict[str, str] = {}
        said = started
        while len(waited) < len(models):
            if self.proc.poll() is not None:
                pytest.fail(f"llmgw up exited with {self.proc.returncode}:\n{self.tail()}")
            for model in models:
                if model in waited:
                    continue
                try:
                    client.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
                    waited[model] = time.monotonic() - started
                except Exception as exc:  # 503 while the engine loads
                    last[model] = f"{type(exc).__name__}: {str(exc)[:200]}"
            elapsed = time.monotonic() - started
            if elapsed > within_s:
                pytest.fail(f"not ready within {within_s:.0f} s: {last}\n{self.tail()}")
            if time.monotonic() - said > 30:  # a long wait says what it waits for
                said = time.monotonic()
                print(f"engines: {elapsed:.0f} s, ready: {sorted(waited)}, waiting: {last}",
                      file=sys.stderr, flush=True)
            time.sleep(1)
        return waited


def start_up(tmp: Path, env: dict[str, str], log: Path, data: Path | None = None,
             port: int | None = None) -> tuple[subprocess.Popen[bytes], Path, int]:
    data = data or tmp / "data"
    port = port or free_port()
    proc = spawn_up(data, port, log, "--catalog", str(CATALOG), "--cpu-slots", str(len(MODELS)),
                    env={**os.environ, **env}, append=log.exists())
    return proc, data, port


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    env = engine_env()
    tmp = tmp_path_factory.mktemp("engines")
    out = Path(os.environ.get("LLMGW_TEST_OUTPUT", "test-output"))
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"engines-up-{tmp.name}.log"
    log.unlink(missing_ok=True)
    proc, data, port = start_up(tmp, env, log)
    fleet = Fleet(proc, data, port, log, env, {})
    try:
        fleet.info = wait_up_json(proc, data, log)
        fleet.wait_ready()
        for model in MODELS:
            (replica,) = fleet.replicas(model)
            fleet.start_s[model] = round(replica["ready_at"] - replica["created_at"], 1)
            fleet.engine(model)
        print(f"engines: start (assignment -> ready) {fleet.start_s}", file=sys.stderr)
        yield fleet
    finally:
        if fleet.proc.poll() is None:
            fleet.proc.send_signal(signal.SIGINT)
            try:
                fleet.proc.wait(90)
            except subprocess.TimeoutExpired:
                stop_group(fleet.proc, signal.SIGKILL, 5)
        for pid in fleet.engine_pids:
            with contextlib.suppress(psutil.Error):
                for proc in [*psutil.Process(pid).children(recursive=True), psutil.Process(pid)]:
                    proc.kill()


@contextlib.contextmanager
def catalog_fleet(tmp: Path, catalog: str, ready: tuple[str, ...]) -> Iterator[Fleet]:
    """`llmgw up` on one CPU slot with ``catalog`` (YAML), once ``ready`` models serve;
    stopped (and every engine it ran) when the block ends."""
    env = engine_env()
    (tmp / "catalog.yaml").write_text(catalog)
    out = Path(os.environ.get("LLMGW_TEST_OUTPUT", "test-output"))
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"engines-{tmp.name}.log"
    data, port = tmp / "data", free_port()
    proc = spawn_up(data, port, log, "--catalog", str(tmp / "catalog.yaml"), "--cpu-slots", "1",
                    env={**os.environ, **env})  # fmt: skip
    fleet = Fleet(proc, data, port, log, env, {})
    try:
        fleet.info = wait_up_json(proc, data, log)
        fleet.wait_ready(ready, READY_WITHIN_S)
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


def greedy_answer(fleet: Fleet, model: str, prompt: list[dict[str, str]],
                  stream: bool = False) -> str:  # fmt: skip
    """``model``'s answer to ``prompt`` at temperature 0 (16 tokens), named as asked."""
    client = fleet.client(timeout=300)
    if stream:
        chunks = client.chat.completions.create(
            model=model, messages=prompt, temperature=0, max_tokens=16,  # type: ignore[arg-type]
            stream=True,
        )  # fmt: skip
        pieces = []
        for chunk in chunks:
            assert chunk.model == model
            pieces += [choice.delta.content or "" for choice in chunk.choices]
        return "".join(pieces)
    reply = client.chat.completions.create(
        model=model, messages=prompt, temperature=0, max_tokens=16  # type: ignore[arg-type]
    )
    assert reply.model == model
    return reply.choices[0].message.content or ""


def adapter_entries(engine: str, base: str, weights: dict[str, Path]) -> list[str]:
    """Catalog lines (YAML) for adapters of ``base``: name -> its weights (rank 8)."""
    lines: list[str] = []
    for name, path in weights.items():
        lines += [
            f"  - name: {name}",
            f"    engine: {engine}",
            f"    base: {base}",
            "    min_replicas: 0",
            "    adapter: {rank: 8}",
            f"    weights: {{kind: local, path: '{path}'}}",
        ]
    return lines
