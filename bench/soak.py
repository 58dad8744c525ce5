"""Soak: mixed load on a simulated fleet for N minutes; do RSS, files and tasks stay flat?

A leak that costs a few kilobytes per request, or one task or socket per
engine restart, passes every functional test and takes a gateway down after a
week. This runs the parts as an operator does, each in its own process:

* ``llmgw serve`` (control plane and the in-process gateway, SQLite store or
  ``--database-url``), and a standalone ``llmgw gateway`` following it over
  the watch stream;
* ``llmgw sim fleet --engines subprocess``: simulated nodes, each the real
  agent, whose supervisor starts one ``python -m llmgw.sim.engine`` process per
  replica, as on a real node;

and sends them, through both gateways with the official ``openai`` client, an
open-loop (Poisson) mix: streamed chats with ``include_usage``, plain chats,
completions (some streamed), embeddings, streams the client drops after two
chunks, on three always-on models and two on-demand models that are asked for
in bursts, so their replicas start, go idle and are unloaded again and again.
Prompts share a few system prompts (prefix routing) and end in fresh text (the
prefix index keeps learning). Requests use several API keys; one has a
requests-per-minute limit below its share (the 429 path), and one is replaced
every minute (created, used, revoked: the gateways' key table churns).

Every ``--sample-s`` (60) seconds, for every process (serve, gateway, fleet,
each engine): RSS from /proc, and asyncio tasks and gc-tracked objects from
the process itself (SIGUSR1, llmgw.procstats). Open file descriptors are
counted every 2 s and a sample holds the fewest seen since the one before:
one count a minute lands on whatever connections are in flight then (serve's
count moves between 32 and 44 at 4 req/s), so its floor over a half hour
depended on one lucky quiet moment. The
first 20 % of the samples (at least 2) are warm-up. RSS growth compares the
median of the first three samples after warm-up with that of the last three,
in percent (limit 5 %). Open files and tasks compare the minimum of the first
half of those samples with that of the second half, in counts (in-flight
requests only add connections and tasks, so the minima are the floor; limit
5 % of the floor or 2, whichever is larger). serve, the gateway, the fleet
and the always-on models' engines must each be one process that answered
every sample after warm-up: one that restarted, missed a reading or was not
there fails the run (it is not left out of the verdict). Engines of on-demand
models live minutes at a time: they are sampled and listed, and measured only
if one lived through the whole window.

    python bench/soak.py [--minutes 30] [--rate 4] [--sample-s 60] [--database-url URL]
    python bench/soak.py --minutes 10 --tracemalloc 8 --keep   # hunting a leak
    make soak

Last line: JSON with ``rss_growth_pct`` (process -> percent), ``open_files_growth``
and ``tasks_growth`` (process -> count), ``ok``, the requests by kind and
outcome, the engine starts per model, and ``samples`` (per minute and process:
rss_mb, open_files, tasks, gc_objects). Exit code 1 when a limit is exceeded
or more than 1 % of requests failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import yaml

from llmgw import procstats

RSS_LIMIT_PCT = 5.0
COUNT_LIMIT_PCT = 5.0
COUNT_LIMIT_ABS = 2
WARMUP_FRACTION = 0.2
WINDOW = 3
START_TIMEOUT_S = 300.0
STATS_WAIT_S = 60.0

# Two L4 nodes (4 cards) and two CPU nodes (4 slots). Sim engines are fast
# (prefill 20k tok/s, 8 ms a token) so that a request holds a core for
# milliseconds: the soak is about what stays behind, not about queueing.
# The on-demand models' idle timeouts are far below their burst period, so
# each is unloaded and started again every few minutes.
FLEET_YAML = """\
fabrics: [soak]
nodes:
  - {count: 2, class: l4-24g, gpus: 2, fabric: soak, name: soak-l4}
  - {count: 2, class: cpu, cpu_slots: 2, fabric: soak, name: soak-cpu}
models:
  - {name: soak-chat, engine: sim, gpu_classes: [l4-24g], min_replicas: 2, max_replicas: 2,
     kv_capacity_tokens: 16384, sim: {SIM}}
  - {name: soak-mini, engine: sim, gpu_classes: [cpu], min_replicas: 1, max_replicas: 1,
     kv_capacity_tokens: 8192, sim: {SIM}}
  - {name: soak-embed, engine: sim, gpu_classes: [cpu], min_replicas: 1, max_replicas: 1,
     sim: {SIM}}
  - {name: soak-burst, engine: sim, gpu_classes: [l4-24g], min_replicas: 0, max_replicas: 1,
     idle_timeout_s: 30, kv_capacity_tokens: 8192, sim: {SIM}}
  - {name: soak-burst-cpu, engine: sim, gpu_classes: [cpu], min_replicas: 0, max_replicas: 1,
     idle_timeout_s: 45, kv_capacity_tokens: 8192, sim: {SIM}}
""".replace(
    "{SIM}",
    "{startup_s: 1.0, prefill_tokens_per_s: 20000, decode_ms_per_token: 8,"
    " kv_blocks: 512, block_tokens: 16}",
)
# The deployment's own processes (Part.name): each judged throughout.
PARTS = ("serve", "gateway", "sim-fleet")
CHAT_MODELS = ("soak-chat", "soak-chat", "soak-mini")
EMBED_MODEL = "soak-embed"
# (model, period s, active s, offset s): asked for during the first `active`
# seconds of every period, nothing in between.
BURSTS = (("soak-burst", 150.0, 50.0, 20.0), ("soak-burst-cpu", 210.0, 40.0, 80.0))
BURST_SHARE = 0.25
# kind -> weight of the mix (bursts take BURST_SHARE of arrivals while active).
MIX = {
    "chat_stream": 30, "chat": 15, "completion": 10, "completion_stream": 5,
    "embeddings": 15, "disconnect": 5,
}  # fmt: skip
SYSTEM_PROMPTS = 6
WORDS = (
    "the", "gpu", "node", "runs", "a", "model", "for", "every", "user", "who", "asks",
    "about", "tokens", "cache", "and", "latency", "while", "gateway", "routes", "each",
    "prompt", "to", "replica", "that", "may", "hold", "its", "prefix",
)  # fmt: skip


# ---------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------


@dataclass
class Part:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path


def _llmgw() -> list[str]:
    beside = Path(sys.executable).with_name("llmgw")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("llmgw")
    if found is None:
        raise SystemExit("soak: the llmgw command is not installed (make setup)")
    return [found]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _spawn(name: str, argv: list[str], logs: Path, env: dict[str, str] | None = None) -> Part:
    log = logs / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})}, start_new_session=True,
        )  # fmt: skip
    return Part(name, proc, log)


def _wait_for(part: Part, marker: str, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while marker not in part.log.read_text(errors="replace"):
        if part.proc.poll() is not None:
            raise SystemExit(f"soak: {part.name} exited ({part.proc.returncode}); see {part.log}")
        if time.monotonic() > deadline:
            raise SystemExit(f"soak: {part.name} did not say {marker!r}; see {part.log}")
        time.sleep(0.2)


def stop_parts(parts: list[Part]) -> None:
    # The fleet first: it stops its engines; then the gateways, then serve.
    # Engines run in sessions of their own: any that a fleet killed for being
    # slow to stop left behind are stopped here.
    engines: list[psutil.Process] = []
    for part in parts:
        with contextlib.suppress(psutil.Error):
            engines += psutil.Process(part.proc.pid).children(recursive=True)
    for part in parts:
        if part.proc.poll() is None:
            part.proc.send_signal(signal.SIGTERM)
            try:
                part.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(part.proc.pid, signal.SIGKILL)
                part.proc.wait()
    for engine in engines:
        with contextlib.suppress(psutil.Error):
            engine.terminate()
    _, alive = psutil.wait_procs(engines, timeout=10)
    for engine in alive:
        with contextlib.suppress(psutil.Error):
            engine.kill()


@dataclass
class Deployment:
    parts: list[Part]
    api_urls: list[str]
    admin_url: str
    admin_token: str
    api_key: str
    fleet_pid: int


def start_deployment(
    work: Path, database_url: str | None, tracemalloc_frames: int, traced: set[str]
) -> Deployment:
    logs = work / "logs"
    logs.mkdir(parents=True)
    llmgw = _llmgw()

    def env_of(name: str) -> dict[str, str]:
        # A traced part starts tracing at the first sample and reports the
        # allocation sites that grew at each later one (llmgw.procstats).
        return {"LLMGW_TRACEMALLOC": str(tracemalloc_frames)} if name in traced else {}
    parts: list[Part] = []
    try:
        port = _free_port()
        argv = [*llmgw, "serve", "--data-dir", str(work / "cp"), "--host", "127.0.0.1",
                "--port", str(port), "--trust-reported-fabrics", "--log-level", "warning"]
        if database_url:
            argv += ["--database-url", database_url]
        serve = _spawn("serve", argv, logs, env_of("serve"))
        parts.append(serve)
        _wait_for(serve, "Role: leader")
        up = json.loads((work / "cp" / "up.json").read_text())
        admin_url = f"http://127.0.0.1:{port}"
        token_file = work / "admin.token"
        token_file.write_text(up["admin_token"])
        token_file.chmod(0o600)
        gw_port = _free_port()
        gateway = _spawn("gateway", [
            *llmgw, "gateway", "--control-plane", admin_url, "--token-file", str(token_file),
            "--host", "127.0.0.1", "--port", str(gw_port), "--log-level", "warning",
        ], logs, env_of("gateway"))  # fmt: skip
        parts.insert(0, gateway)
        spec = work / "fleet.yaml"
        spec.write_text(FLEET_YAML)
        fleet = _spawn("sim-fleet", [
            *llmgw, "sim", "fleet", str(spec), "--control-plane", admin_url,
            "--data-dir", str(work / "fleet"), "--engines", "subprocess",
        ], logs, env={"LLMGW_JOIN_TOKEN": up["join_token"],
                      "LLMGW_ADMIN_TOKEN": up["admin_token"], **env_of("sim-fleet")})  # fmt: skip
        parts.insert(0, fleet)
        _wait_for(fleet, "nodes registered")
        return Deployment(
            parts=parts,
            api_urls=[f"{admin_url}/v1", f"http://127.0.0.1:{gw_port}/v1"],
            admin_url=admin_url,
            admin_token=up["admin_token"],
            api_key=up["api_key"],
            fleet_pid=fleet.proc.pid,
        )
    except BaseException:
        stop_parts(parts)
        raise


# ---------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------


class FdFloor:
    """The fewest open descriptors each process had between two samples.

    Counting is a directory listing of /proc/PID/fd, cheap enough to do every
    couple of seconds; the fewest over a minute is the process without its
    in-flight connections, which is what a leak raises.
    """

    EVERY_S = 2.0

    def __init__(self) -> None:
        self.pids: set[int] = set()
        self.fewest: dict[int, int] = {}

    def take(self, pid: int, now_count: int) -> int:
        """The floor since the last take (this count included), and start again."""
        self.pids.add(pid)
        return min(now_count, self.fewest.pop(pid, now_count))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.EVERY_S)
            for pid in list(self.pids):
                try:
                    count = psutil.Process(pid).num_fds()
                except psutil.Error:
                    self.pids.discard(pid)
                    continue
                self.fewest[pid] = min(count, self.fewest.get(pid, count))


@dataclass
class Target:
    name: str
    pid: int
    log: Path  # where its stderr goes: the procstats line lands there


def _fd_path(pid: int, fd: int) -> Path | None:
    with contextlib.suppress(OSError):
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
        if target.startswith("/"):
            return Path(target.removesuffix(" (deleted)"))
    return None


def _engine_targets(fleet_pid: int) -> list[Target]:
    out = []
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(fleet_pid).children(recursive=True):
            try:
                argv = child.cmdline()
            except psutil.Error:
                continue
            if "llmgw.sim.engine" not in argv or "--model" not in argv:
                continue
            log = _fd_path(child.pid, 2)
            # Only an engine that is up has its SIGUSR1 handler; one still
            # starting would die of the signal.
            if log is None or "listening on" not in log.read_text(errors="replace"):
                continue
            model = argv[argv.index("--model") + 1]
            out.append(Target(f"engine {model} pid {child.pid}", child.pid, log))
    return out


async def sample(deployment: Deployment, fds: FdFloor) -> dict[str, dict[str, Any]]:
    """One sample of every process: /proc figures, and its own (SIGUSR1) figures."""
    targets = [Target(p.name, p.proc.pid, p.log) for p in deployment.parts]
    targets += _engine_targets(deployment.fleet_pid)
    offsets: dict[int, int] = {}
    for target in targets:
        offsets[target.pid] = target.log.stat().st_size
        os.kill(target.pid, procstats.SIGNAL)
    figures: dict[str, dict[str, Any]] = {}
    pending = {t.pid: t for t in targets}
    deadline = time.monotonic() + STATS_WAIT_S
    while pending and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        for pid, target in list(pending.items()):
            stats = _read_stats(target.log, offsets[pid], pid)
            if stats is None:
                continue
            del pending[pid]
            try:
                proc = psutil.Process(pid)
                rss, files = proc.memory_info().rss, proc.num_fds()
            except psutil.Error:
                continue  # gone meanwhile (an on-demand engine unloaded)
            figures[target.name] = {
                "pid": pid,
                "rss_mb": round(rss / 2**20, 2),
                "open_files": fds.take(pid, files),
                "tasks": stats["asyncio_tasks"],
                "gc_objects": stats["gc_objects"],
                "top_tasks": stats["top_tasks"][:3],
            }
            if "allocation_growth" in stats:
                figures[target.name]["allocation_growth"] = stats["allocation_growth"]
    for target in pending.values():
        # Gone meanwhile is an unloaded engine; alive and silent is a miss.
        with contextlib.suppress(psutil.Error):
            if psutil.Process(target.pid).status() != psutil.STATUS_ZOMBIE:
                figures[target.name] = {"pid": target.pid, "missing": True}
    return figures


def _read_stats(log: Path, offset: int, pid: int) -> dict[str, Any] | None:
    try:
        with open(log, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(offset if offset <= size else 0)  # truncated by rotation
            text = handle.read().decode(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        stats = procstats.parse_line(line)
        if stats is not None and stats.get("pid") == pid:
            return stats
    return None


# ---------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------


@dataclass
class Tally:
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def add(self, kind: str, outcome: str, detail: str = "") -> None:
        per = self.counts.setdefault(kind, {})
        per[outcome] = per.get(outcome, 0) + 1
        if outcome == "failed" and len(self.errors) < 20:
            self.errors.append(f"{kind}: {detail}"[:300])

    def total(self, outcome: str) -> int:
        return sum(per.get(outcome, 0) for per in self.counts.values())


class Load:
    """The open-loop mix, through every gateway, with several keys."""

    def __init__(self, deployment: Deployment, rate: float, seed: int) -> None:
        self.deployment = deployment
        self.rate = rate
        self.rng = random.Random(seed)
        self.tally = Tally()
        self.keys: dict[str, str] = {"first": deployment.api_key}
        self.limited: set[str] = set()
        self._clients: dict[tuple[str, str], openai.AsyncOpenAI] = {}
        # One connection pool for every key and gateway, with few idle
        # connections kept, a few seconds each: the gateways' open files then
        # count what they hold, not how many clients the soak made.
        # (Limits of the HTTP library this openai release is built on.)
        limits = type(openai.DEFAULT_CONNECTION_LIMITS)(
            max_connections=64, max_keepalive_connections=8, keepalive_expiry=5.0)
        self._http = openai.DefaultAsyncHttpxClient(limits=limits)
        self._admin = httpx.AsyncClient(
            base_url=f"{deployment.admin_url}/admin/v1",
            headers={"Authorization": f"Bearer {deployment.admin_token}"}, timeout=30,
        )  # fmt: skip
        self._rotating: str | None = None
        self.started = time.monotonic()
        self._inflight: set[asyncio.Task[None]] = set()
        self.runner: asyncio.Task[None] | None = None
        self.systems = [self._words(200, i) for i in range(SYSTEM_PROMPTS)]

    def _words(self, n: int, seed: int | None = None) -> str:
        rng = random.Random(seed) if seed is not None else self.rng
        return " ".join(rng.choice(WORDS) for _ in range(n))

    async def make_key(self, name: str, rpm: int | None = None) -> tuple[str, str]:
        body: dict[str, Any] = {"name": name}
        if rpm is not None:
            body["rpm"] = rpm
        answer = await self._admin.post("/keys", json=body)
        answer.raise_for_status()
        data = answer.json()
        return data["key"]["key_id"], data["secret"]

    async def setup_keys(self) -> None:
        for name in ("soak-a", "soak-b"):
            self.keys[name] = (await self.make_key(name))[1]
        # A share of about 0.05 x rate per second against 20 a minute: part
        # of its requests are refused with 429, as they should be.
        self.keys["soak-limited"] = (await self.make_key("soak-limited", rpm=20))[1]
        self.limited.add("soak-limited")
        self.rotate_id, self.keys["rotating"] = await self.make_key("soak-rotating-0")

    async def rotate_keys(self, stop: asyncio.Event) -> None:
        """Every minute a new key takes the rotating slot and the old one is revoked."""
        n = 0
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 60.0)
                return
            n += 1
            try:
                key_id, secret = await self.make_key(f"soak-rotating-{n}")
                await asyncio.sleep(5.0)  # until both gateways have it
                old_id, self.rotate_id = self.rotate_id, key_id
                old_secret, self.keys["rotating"] = self.keys["rotating"], secret
                for url in self.deployment.api_urls:
                    self._clients.pop((url, old_secret), None)
                await asyncio.sleep(5.0)  # requests with the old key end
                (await self._admin.delete(f"/keys/{old_id}")).raise_for_status()
                self.tally.add("key_rotation", "ok")
            except httpx.HTTPError as exc:
                self.tally.add("key_rotation", "failed", repr(exc))

    def client(self, url: str, key: str) -> openai.AsyncOpenAI:
        found = self._clients.get((url, key))
        if found is None:
            # No retries: every failure counts. On-demand starts wait in the gateway.
            found = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=240,
                                       http_client=self._http)
            self._clients[(url, key)] = found
        return found

    def _pick(self) -> tuple[str, str]:
        now = time.monotonic() - self.started
        active = [m for m, period, on, offset in BURSTS if (now - offset) % period < on
                  and now >= offset]
        if active and self.rng.random() < BURST_SHARE:
            return "burst_stream" if self.rng.random() < 0.5 else "burst", self.rng.choice(active)
        kind = self.rng.choices(list(MIX), weights=list(MIX.values()))[0]
        model = EMBED_MODEL if kind == "embeddings" else self.rng.choice(CHAT_MODELS)
        return kind, model

    async def run(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        stop = asyncio.Event()
        rotator = asyncio.create_task(self.rotate_keys(stop))
        while time.monotonic() < end:
            await asyncio.sleep(self.rng.expovariate(self.rate))
            task = asyncio.create_task(self.one())
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)
        stop.set()
        await rotator
        if self._inflight:
            await asyncio.wait(self._inflight, timeout=300)

    async def one(self) -> None:
        kind, model = self._pick()
        key_name = self.rng.choices(list(self.keys), weights=[
            1 if name in self.limited else 4 for name in self.keys])[0]  # fmt: skip
        client = self.client(self.rng.choice(self.deployment.api_urls), self.keys[key_name])
        messages = [
            {"role": "system", "content": self.rng.choice(self.systems)},
            {"role": "user", "content": self._words(self.rng.randint(8, 40))},
        ]
        max_tokens = self.rng.randint(8, 24)
        try:
            await self._send(client, kind, model, messages, max_tokens)
        except openai.RateLimitError as exc:
            self.tally.add(kind, "rate_limited" if key_name in self.limited else "failed",
                           repr(exc))
        except openai.OpenAIError as exc:
            self.tally.add(kind, "failed", f"{model} key {key_name}: {exc!r}")
        else:
            self.tally.add(kind, "ok")

    async def _send(self, client: openai.AsyncOpenAI, kind: str, model: str,
                    messages: list[Any], max_tokens: int) -> None:
        if kind in ("chat_stream", "burst_stream", "disconnect"):
            stream = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=max_tokens,
                stream=True, stream_options={"include_usage": True},
            )  # fmt: skip
            chunks, usage = 0, None
            async for chunk in stream:
                chunks += 1
                usage = chunk.usage or usage
                if kind == "disconnect" and chunks == 2:
                    await stream.close()  # drops the connection mid-answer
                    return
            if usage is None:
                raise openai.OpenAIError("stream ended without usage")
        elif kind in ("chat", "burst"):
            answer = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=max_tokens,
            )  # fmt: skip
            if answer.usage is None or not answer.choices:
                raise openai.OpenAIError("answer without usage or choices")
        elif kind == "completion_stream":
            text_stream = await client.completions.create(
                model=model, prompt=messages[0]["content"] + messages[1]["content"],
                max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
            )  # fmt: skip
            usage = None
            async for piece in text_stream:
                usage = piece.usage or usage
            if usage is None:
                raise openai.OpenAIError("stream ended without usage")
        elif kind == "completion":
            done = await client.completions.create(
                model=model, prompt=messages[0]["content"] + messages[1]["content"],
                max_tokens=max_tokens,
            )  # fmt: skip
            if done.usage is None:
                raise openai.OpenAIError("completion without usage")
        else:
            inputs = [messages[1]["content"]] * self.rng.randint(1, 4)
            vectors = await client.embeddings.create(model=model, input=inputs)
            if len(vectors.data) != len(inputs):
                raise openai.OpenAIError("embeddings: wrong count")

    async def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until every always-on model answers through every gateway."""
        deadline = time.monotonic() + timeout_s
        models = sorted({*CHAT_MODELS, EMBED_MODEL})
        for url in self.deployment.api_urls:
            client = self.client(url, self.keys["first"])
            for model in models:
                while True:
                    try:
                        if model == EMBED_MODEL:
                            await client.embeddings.create(model=model, input=["ready?"])
                        else:
                            await client.chat.completions.create(
                                model=model, max_tokens=1,
                                messages=[{"role": "user", "content": "ready?"}],
                            )  # fmt: skip
                        break
                    except openai.OpenAIError as exc:
                        if time.monotonic() > deadline:
                            raise SystemExit(f"soak: {model} not ready at {url}: {exc!r}") from None
                        await asyncio.sleep(1.0)

    async def close(self) -> None:
        # Stopped early (a signal): nothing may send on a closed client.
        pending = [t for t in (self.runner, *self._inflight) if t is not None]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await self._http.aclose()  # the openai clients' shared pool
        await self._admin.aclose()


# ---------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------


def warmup_samples(count: int) -> int:
    return max(2, math.ceil(WARMUP_FRACTION * count))


def always_on_engines(fleet_yaml: str = FLEET_YAML) -> dict[str, int]:
    """Models that always run, and their engines: min_replicas of the fleet's catalog."""
    models = yaml.safe_load(fleet_yaml)["models"]
    return {m["name"]: m["min_replicas"] for m in models if m.get("min_replicas", 0) > 0}


def growth(samples: list[dict[str, Any]], parts: tuple[str, ...] = PARTS,
           always_on: dict[str, int] | None = None) -> dict[str, Any]:
    """Growth per process over the samples after warm-up (see the module docstring).

    Every part (serve, gateway, fleet) and every engine of an always-on
    model must be one process that answered every sample after warm-up:
    one that restarted, missed a reading or is not there is a failure, not
    left out. Engines of on-demand models come and go by design; those that
    lived through the whole window are measured too, and none may miss a
    reading while it lives.
    """
    always_on = always_on_engines() if always_on is None else always_on
    after = samples[warmup_samples(len(samples)):]
    out: dict[str, Any] = {"rss_growth_pct": {}, "open_files_growth": {},
                           "tasks_growth": {}, "gc_objects_growth_pct": {}, "failures": []}
    failures: list[str] = out["failures"]
    if len(after) < 2:
        failures.append(f"{len(after)} sample(s) after warm-up: growth needs two or more")
        return out
    for name in sorted({n for s in after for n in s["procs"]}):
        missed = [i for i, s in enumerate(after) if s["procs"].get(name, {}).get("missing")]
        if missed:
            failures.append(f"{name}: no reading in sample(s) {missed} after warm-up")
    judged: list[str] = []
    for name in parts:
        series = [s["procs"].get(name) for s in after]
        pids = sorted({p["pid"] for p in series if p is not None})
        if any(p is None for p in series):
            failures.append(f"{name}: not running in every sample after warm-up")
        elif len(pids) > 1:
            failures.append(f"{name}: restarted (pids {pids})")
        elif not any(p.get("missing") for p in series if p is not None):
            judged.append(name)
    for model, replicas in sorted(always_on.items()):
        per_sample = [sorted(n for n in s["procs"] if _engine_model(n) == model) for s in after]
        names = sorted({n for names in per_sample for n in names})
        if any(len(names_then) != replicas for names_then in per_sample):
            failures.append(f"engine {model}: {[len(n) for n in per_sample]} engine(s) in the"
                            f" samples after warm-up, {replicas} always running expected")
        elif len(names) != replicas:
            failures.append(f"engine {model}: restarted ({', '.join(names)})")
    # Whatever lived through the window and answered each time is measured.
    lived = [n for n in sorted(set.intersection(*(set(s["procs"]) for s in after)))
             if n not in parts and len({s["procs"][n]["pid"] for s in after}) == 1
             and not any(s["procs"][n].get("missing") for s in after)]
    for name in [*judged, *lived]:
        _judge(name, [s["procs"][name] for s in after], out)
    return out


def _engine_model(name: str) -> str | None:
    """``engine MODEL pid N`` -> MODEL."""
    words = name.split()
    return words[1] if len(words) == 4 and words[0] == "engine" else None


def _judge(name: str, series: list[dict[str, Any]], out: dict[str, Any]) -> None:
    # Non-overlapping windows, so a short run still compares first and last.
    width = max(1, min(WINDOW, len(series) // 2))
    head, tail = series[:width], series[-width:]
    rss0 = statistics.median(p["rss_mb"] for p in head)
    rss1 = statistics.median(p["rss_mb"] for p in tail)
    rss_pct = round(100.0 * (rss1 - rss0) / rss0, 2)
    out["rss_growth_pct"][name] = rss_pct
    gc0 = statistics.median(p["gc_objects"] for p in head)
    gc1 = statistics.median(p["gc_objects"] for p in tail)
    out["gc_objects_growth_pct"][name] = round(100.0 * (gc1 - gc0) / gc0, 2)
    if rss_pct > RSS_LIMIT_PCT:
        out["failures"].append(f"{name}: RSS +{rss_pct} % ({rss0} -> {rss1} MB)")
    half = max(1, len(series) // 2)
    for what, key in (("open_files", "open_files_growth"), ("tasks", "tasks_growth")):
        # In-flight requests only add connections and tasks, and a few
        # samples can all catch some: the floors of each half are stable.
        floor0 = min(p[what] for p in series[:half])
        floor1 = min(p[what] for p in series[half:])
        out[key][name] = floor1 - floor0
        allowed = max(COUNT_LIMIT_ABS, COUNT_LIMIT_PCT / 100.0 * floor0)
        if floor1 - floor0 > allowed:
            out["failures"].append(f"{name}: {what} {floor0} -> {floor1}")


def request_failures(counts: dict[str, dict[str, int]]) -> list[str]:
    """The load's verdict: requests were sent, and no more than 1 % of them failed."""
    sent = sum(sum(per.values()) for kind, per in counts.items() if kind != "key_rotation")
    # A failed key rotation counts against the run, as a failed request does.
    failed = sum(per.get("failed", 0) for per in counts.values())
    if not sent:
        return ["no request was sent"]
    return [f"{failed} of {sent} requests failed"] if failed > 0.01 * sent else []


def engine_starts(samples: list[dict[str, Any]]) -> dict[str, int]:
    """Distinct engine processes seen per model: how often on-demand models came back."""
    seen: dict[str, set[int]] = {}
    for s in samples:
        for name, p in s["procs"].items():
            if name.startswith("engine "):
                seen.setdefault(name.split()[1], set()).add(p["pid"])
    return {model: len(pids) for model, pids in sorted(seen.items())}


def print_table(samples: list[dict[str, Any]]) -> None:
    names = sorted({n for s in samples for n in s["procs"]})
    print("\nRSS MB / open files / tasks per sample (minute):", file=sys.stderr)
    for name in names:
        row = []
        for s in samples:
            p = s["procs"].get(name)
            row.append("-" if p is None or p.get("missing") else
                       f"{p['rss_mb']:.0f}/{p['open_files']}/{p['tasks']}")
        print(f"  {name:34} " + " ".join(f"{c:>11}" for c in row), file=sys.stderr)


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


async def soak(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    # A soak started in the background (`&`, nohup) ignores SIGINT; both
    # signals must still stop the parts, or they outlive the run.
    main_task = asyncio.current_task()
    assert main_task is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, main_task.cancel)
    traced = set(args.trace.split(",")) if args.tracemalloc else set()
    deployment = await asyncio.to_thread(
        start_deployment, work, args.database_url, args.tracemalloc, traced
    )
    load = Load(deployment, args.rate, args.seed)
    samples: list[dict[str, Any]] = []
    try:
        await load.setup_keys()
        await load.wait_ready()
        seconds = args.minutes * 60.0
        started = time.monotonic()
        load.started = started
        runner = asyncio.create_task(load.run(seconds))
        load.runner = runner
        fds = FdFloor()
        fd_counter = asyncio.create_task(fds.run())
        for i in range(int(seconds // args.sample_s) + 1):
            await asyncio.sleep(max(0.0, started + i * args.sample_s - time.monotonic()))
            procs = await sample(deployment, fds)
            samples.append({"t_s": round(time.monotonic() - started, 1), "procs": procs})
            brief = ", ".join(f"{n.split(' pid')[0]} {p.get('rss_mb', '?')}"
                              for n, p in sorted(procs.items()) if not n.startswith("engine"))
            print(f"soak: sample {i} at {samples[-1]['t_s']:.0f} s: {brief} MB;"
                  f" requests ok {load.tally.total('ok')}, failed {load.tally.total('failed')}",
                  file=sys.stderr, flush=True)
            for name, p in sorted(procs.items()):
                for site, kib, blocks in p.get("allocation_growth", [])[:4]:
                    print(f"  {name}: {kib:+.0f} KiB {blocks:+d} blocks at {site}",
                          file=sys.stderr)
        await runner
        fd_counter.cancel()
    finally:
        await load.close()
        await asyncio.shield(asyncio.to_thread(stop_parts, deployment.parts))
    figures = growth(samples)
    figures["failures"] += request_failures(load.tally.counts)
    print_table(samples)
    for line in figures["failures"] + load.tally.errors[:10]:
        print(f"soak: {line}", file=sys.stderr)
    return {
        "minutes": args.minutes,
        "rate": args.rate,
        "warmup_samples": warmup_samples(len(samples)),
        "ok": not figures["failures"],
        "rss_growth_pct": figures["rss_growth_pct"],
        "open_files_growth": figures["open_files_growth"],
        "tasks_growth": figures["tasks_growth"],
        "gc_objects_growth_pct": figures["gc_objects_growth_pct"],
        "failures": figures["failures"],
        "requests": load.tally.counts,
        "engine_starts": engine_starts(samples),
        "samples": [{"t_s": s["t_s"], "procs": {
            n: {k: v for k, v in p.items() if k not in ("pid", "top_tasks", "allocation_growth")}
            for n, p in s["procs"].items()}} for s in samples],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second")
    parser.add_argument("--sample-s", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--database-url", help="postgresql://... (default: SQLite)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs)")
    parser.add_argument("--tracemalloc", type=int, default=0, metavar="FRAMES",
                        help="run the --trace parts under tracemalloc and print, each sample,"
                        " the allocation sites that grew most (slower; for finding a leak)")
    parser.add_argument("--trace", default="serve",
                        help="parts to trace: serve, gateway, sim-fleet (comma-separated)")
    parser.add_argument("--quick", action="store_true", help="same as --minutes 3")
    args = parser.parse_args()
    if args.quick:
        args.minutes = 3.0
    work = Path(tempfile.mkdtemp(prefix="llmgw-soak-"))
    try:
        result = asyncio.run(soak(args, work))
    except asyncio.CancelledError:
        print("soak: stopped by a signal", file=sys.stderr)
        return 130
    finally:
        if args.keep:
            print(f"soak: logs in {work}/logs", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
