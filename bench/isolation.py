"""Isolation between tenants: one floods a model at 5x its capacity, another's TTFT must hold.

Issue 33, item 4. Two tenants (two keys, each its own team for fairness),
one model on simulated engines behind a real gateway:

* tenant B sends a light open-loop stream of streamed chat requests
  (Poisson, ``--b-rate``); its TTFT p90 is measured once on an idle fleet
  (B alone) and once while tenant A floods the model at ``--flood`` times its
  capacity (Poisson too, open loop: A's clients do not slow down when
  answers do);
* the model's capacity is what its engine runs at once over how long one
  request takes there (``max_running`` / service time, measured in the idle
  phase), so "5x" is 5x what the engine can answer, not a guess;
* the same flood runs twice: through a gateway that knows the replica's
  concurrency (``max_concurrency`` in the route: the gateway holds the queue,
  llmgw.gateway.admission) and, as the control, through one that does not
  (the engine queues everything first come, first served, which is the
  behaviour before the hold queue). Each on a fresh engine.

``isolation_ttft_p90_ratio`` = B's TTFT p90 under the flood over B's p90 on
the idle fleet, with the hold queue; the verdict holds at <= 2. Tenant A's
answered, refused (429) and timed-out (503) requests are printed beside it:
the hold queue sheds A's excess, which is what keeps B's answers fast.

Processes: the engines (one process), the gateways (another, static config
through a MemoryLink: no control plane in the measurement), tenant A's
clients (a third) and this one, tenant B's clients. On this 2-core machine
they share the CPUs with whatever else runs; B's TTFTs include that.

    python bench/isolation.py [--quick] [--flood 5] [--b-rate 2] [--phase-s 30]

Last line: one JSON object with isolation_ttft_p90_ratio, the control's
ratio, the p90s, tenant A's outcome counts and the verdict.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from simfleet import children

from llmgw.sim import benchstats, loadgen
from llmgw.sim.workloads import TimedRequest
from llmgw.wire import SimParams

if TYPE_CHECKING:
    from simfleet.gateways import GatewaySpec

MODEL = "sim"
KEY_A = "sk-llmgw-bench-isolation-a-0123456789abcdefghijkl"
KEY_B = "sk-llmgw-bench-isolation-b-0123456789abcdefghijkl"
# Each tenant connects from a loopback address of its own, as tenants on
# other machines do: the gateway's server caps open connections per address
# (llmgw.addresscap), and one address for both would make A's flood refuse
# B's connections before any queue saw them.
HOST_A = "127.0.0.3"
HOST_B = "127.0.0.2"
RATIO_TARGET = 2.0


@dataclass(frozen=True)
class Setup:
    max_running: int = 4  # the engine's concurrency, told to the gated gateway
    decode_ms: float = 10.0
    output_tokens: int = 32
    prompt_words: int = 150
    b_rate: float = 2.0  # requests/s
    flood: float = 5.0  # times the model's capacity
    phase_s: float = 30.0
    warm_s: float = 3.0  # A floods this long before B's measured phase starts
    hold_wait_s: float = 5.0
    hold_reserve: float = 0.125  # GatewaySettings.hold_reserve, the gateway's default
    seed: int = 0

    def sim_params(self) -> SimParams:
        return SimParams(startup_s=0.0, decode_ms_per_token=self.decode_ms,
                         max_running=self.max_running)  # fmt: skip


QUICK = Setup(phase_s=12.0, warm_s=2.0)


# ---------------------------------------------------------------------------
# The gateways' process
# ---------------------------------------------------------------------------


def _gateway_specs(spec: dict[str, Any]) -> list[GatewaySpec]:
    """One gateway per entry of ``spec["gateways"]``, each on its own engine."""
    from llmgw import secrets, wire
    from llmgw.gateway.settings import GatewaySettings

    keys = [wire.ApiKeyInfo(key_id=name, secret_hash=secrets.hash_secret(secret))
            for name, secret in (("tenant-a", KEY_A), ("tenant-b", KEY_B))]  # fmt: skip
    specs = []
    for i, item in enumerate(spec["gateways"]):
        route = wire.ModelRoute(
            name=MODEL, served_name=MODEL, routing="least-loaded",
            endpoints=[wire.Endpoint(replica_id=f"r{i}", url=item["engine"])],
            max_concurrency=item["max_concurrency"],
        )  # fmt: skip
        config = wire.GatewayConfig(
            routing=wire.RoutingTable(version=1, models=[route], gateways=1), keys=keys
        )
        settings = GatewaySettings(gateway_id=f"isolation-{i}", hold_wait_s=spec["hold_wait_s"],
                                   hold_reserve=spec["hold_reserve"])  # fmt: skip
        specs.append((config, settings))
    return specs


# ---------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------


def poisson(rate: float, start_s: float, length_s: float, setup: Setup, tenant: str,
            rng: random.Random, first_index: int = 0) -> list[TimedRequest]:  # fmt: skip
    """Open-loop arrivals of ``rate``/s in [start_s, start_s + length_s), each prompt distinct."""
    out: list[TimedRequest] = []
    at = start_s + rng.expovariate(rate)
    while at < start_s + length_s:
        index = first_index + len(out)
        # Distinct words up front: no prompt shares a cached prefix with another.
        words = " ".join(f"{tenant}{index}w{n}" for n in range(setup.prompt_words))
        out.append(TimedRequest(
            at_s=at, model=MODEL, messages=[{"role": "user", "content": words}],
            max_tokens=setup.output_tokens, group=tenant, index=index,
        ))  # fmt: skip
        at += rng.expovariate(rate)
    return out


def _p90(results: list[benchstats.RequestResult], censor_at: float) -> float | None:
    return benchstats.percentile(benchstats.ttfts(results, censor_at), 90)


def _outcomes(results: list[benchstats.RequestResult]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in results:
        kind = "ok" if r.error is None else r.error.split(":", 1)[0]
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def _examples(results: list[benchstats.RequestResult]) -> dict[str, str]:
    """One error message per kind of failure, so a reader knows whose refusal it was."""
    out: dict[str, str] = {}
    for r in results:
        if r.error is not None:
            out.setdefault(r.error.split(":", 1)[0], r.error[:160])
    return out


async def idle_phase(url: str, setup: Setup) -> dict[str, Any]:
    """B alone: its TTFT p90, and the service time that sizes the flood."""
    rng = random.Random(setup.seed)
    requests = poisson(setup.b_rate, 0.5, setup.phase_s, setup, "b", rng)
    run = await loadgen.run(requests, [url], api_key=KEY_B, drain_s=30.0, local_host=HOST_B)
    done = [r for r in run.results if r.error is None and r.done_at is not None]
    service = sorted(r.done_at - r.sent_at for r in done if r.done_at is not None)
    return {
        "ttft_p90_s": _p90(run.results, run.ended_at),
        "ttft_p50_s": benchstats.percentile(benchstats.ttfts(run.results, run.ended_at), 50),
        "service_s": service[len(service) // 2] if service else None,
        "outcomes": _outcomes(run.results),
    }


async def flood_phase(url: str, setup: Setup, capacity_rps: float) -> dict[str, Any]:
    """A floods at ``setup.flood`` x capacity; B as in the idle phase, once A's queue is up.

    A's clients run in a process of their own: on one event loop with B's,
    A's thousands of connections would delay the reading of B's first
    tokens, and B's TTFT would measure the load generator.
    """
    length = setup.warm_s + setup.phase_s
    spec = {"url": url, "rate": capacity_rps * setup.flood, "length": length,
            "drain": setup.hold_wait_s + 30.0, "setup": asdict(setup)}  # fmt: skip
    flooder = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--flood-client", json.dumps(spec),
        stdout=asyncio.subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    assert flooder.stdout is not None
    line = await flooder.stdout.readline()  # it floods from now on
    if not line.startswith(b"flooding"):
        raise RuntimeError(f"the flooding client did not start: {line!r}")
    light = poisson(setup.b_rate, setup.warm_s + 0.5, setup.phase_s, setup, "b",
                    random.Random(setup.seed))  # fmt: skip
    b = await loadgen.run(light, [url], api_key=KEY_B, drain_s=setup.hold_wait_s + 30.0,
                          local_host=HOST_B)  # fmt: skip
    out, _ = await flooder.communicate()
    a = json.loads(out)
    return {
        "ttft_p90_s": _p90(b.results, b.ended_at),
        "ttft_p50_s": benchstats.percentile(benchstats.ttfts(b.results, b.ended_at), 50),
        "b_outcomes": _outcomes(b.results),
        "a_rate_rps": a["rate_rps"],
        "a_answered_rps": a["answered_rps"],
        "a_outcomes": a["outcomes"],
        "errors": {**a["errors"], **_examples(b.results)},
    }


async def flood_client(spec: dict[str, Any]) -> dict[str, Any]:
    """Tenant A's clients (in their own process): open-loop arrivals at ``spec["rate"]``/s."""
    setup = Setup(**spec["setup"])
    length = spec["length"]
    flood = poisson(spec["rate"], 0.0, length, setup, "a", random.Random(setup.seed + 1))
    print("flooding", flush=True)
    a = await loadgen.run(flood, [spec["url"]], api_key=KEY_A, drain_s=spec["drain"],
                          local_host=HOST_A)  # fmt: skip
    answered = sum(1 for r in a.results
                   if r.error is None and r.done_at is not None and r.done_at <= length)
    return {
        "rate_rps": round(len(flood) / length, 2),
        # A's answers completed while it flooded: what the engine gave it.
        "answered_rps": round(answered / length, 2),
        "outcomes": _outcomes(a.results),
        "errors": _examples(a.results),
    }


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------


def _ratio(under: float | None, idle: float | None) -> float | None:
    if under is None or not idle:
        return None
    return round(under / idle, 3)


async def warm(urls: list[str], setup: Setup) -> None:
    """A few unmeasured requests through each gateway: the first ones of a process run its
    code cold, and a baseline taken from them would flatter the ratio."""
    rng = random.Random(setup.seed + 2)
    for url in urls:
        requests = poisson(5.0, 0.0, 2.0, setup, "warm", rng)
        await loadgen.run(requests, [url], api_key=KEY_B, drain_s=10.0, local_host=HOST_B)


async def measure(setup: Setup, gated_url: str, plain_url: str) -> dict[str, Any]:
    await warm([gated_url, plain_url], setup)
    idle = await idle_phase(gated_url, setup)
    service = idle["service_s"]
    if service is None:
        raise RuntimeError(f"no answer in the idle phase: {idle['outcomes']}")
    capacity = setup.max_running / service
    print(f"idle: B's TTFT p90 {idle['ttft_p90_s']:.4f} s, service {service:.3f} s,"
          f" capacity {capacity:.1f} req/s", file=sys.stderr)  # fmt: skip
    gated = await flood_phase(gated_url, setup, capacity)
    print(f"flood, hold queue: {json.dumps(gated)}", file=sys.stderr)
    plain = await flood_phase(plain_url, setup, capacity)
    print(f"flood, no hold queue (control): {json.dumps(plain)}", file=sys.stderr)
    ratio = _ratio(gated["ttft_p90_s"], idle["ttft_p90_s"])
    return {
        "isolation_ttft_p90_ratio": ratio,
        "isolation_control_ratio": _ratio(plain["ttft_p90_s"], idle["ttft_p90_s"]),
        "idle_ttft_p90_s": _round(idle["ttft_p90_s"]),
        "flood_ttft_p90_s": _round(gated["ttft_p90_s"]),
        "flood_ttft_p50_s": _round(gated["ttft_p50_s"]),
        "idle_ttft_p50_s": _round(idle["ttft_p50_s"]),
        "control_flood_ttft_p90_s": _round(plain["ttft_p90_s"]),
        "capacity_rps": round(capacity, 2),
        "flood_factor": setup.flood,
        "slots": setup.max_running,
        "hold_reserve": setup.hold_reserve,
        "a_answered_rps": gated["a_answered_rps"],
        "control_a_answered_rps": plain["a_answered_rps"],
        "a_rate_rps": gated["a_rate_rps"],
        "a_outcomes": gated["a_outcomes"],
        "b_outcomes": gated["b_outcomes"],
        "control_a_outcomes": plain["a_outcomes"],
        "control_b_outcomes": plain["b_outcomes"],
        "isolation_verdict": "pass" if ratio is not None and ratio <= RATIO_TARGET else "fail",
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def isolation(setup: Setup) -> dict[str, Any]:
    """Start the engines and gateways, measure, stop them: the result's fields."""
    procs: list[subprocess.Popen[str]] = []
    try:
        engines, urls = children.start_sim_engines(MODEL, setup.sim_params(), 2)
        procs.append(engines)
        spec = {"hold_wait_s": setup.hold_wait_s, "hold_reserve": setup.hold_reserve, "gateways": [
            {"engine": urls[0], "max_concurrency": setup.max_running},
            {"engine": urls[1], "max_concurrency": None},
        ]}  # fmt: skip
        gateways = children.spawn([sys.executable, __file__, "--serve-gateways", json.dumps(spec)])
        procs.append(gateways)
        gated, plain = children.read_urls(gateways, children.GATEWAY_MARKER, 2)
        return asyncio.run(measure(setup, gated, plain))
    finally:
        children.stop(procs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="short phases (a smoke run)")
    parser.add_argument("--flood", type=float, help="tenant A's rate, times the capacity")
    parser.add_argument("--b-rate", type=float, help="tenant B's requests per second")
    parser.add_argument("--phase-s", type=float, help="seconds each measured phase lasts")
    parser.add_argument("--slots", type=int, help="requests the engine runs at once (4)")
    parser.add_argument("--reserve", type=float, help="the gateway's hold_reserve (0.125)")
    parser.add_argument("--seed", type=int, help="the arrivals' seed (0)")
    parser.add_argument("--serve-gateways", help=argparse.SUPPRESS)
    parser.add_argument("--flood-client", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.flood_client:
        print(json.dumps(asyncio.run(flood_client(json.loads(args.flood_client)))))
        return 0
    if args.serve_gateways:
        from simfleet import gateways

        return gateways.run(_gateway_specs(json.loads(args.serve_gateways)))
    setup = QUICK if args.quick else Setup()
    overrides = {"flood": args.flood, "b_rate": args.b_rate, "phase_s": args.phase_s,
                 "hold_reserve": args.reserve, "seed": args.seed,
                 "max_running": args.slots}  # fmt: skip
    setup = Setup(**{**setup.__dict__, **{k: v for k, v in overrides.items() if v is not None}})
    result = isolation(setup)
    print(json.dumps(result))
    return 0 if result["isolation_verdict"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
