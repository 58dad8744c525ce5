"""Progress: an engine that answers /health but computes nothing is killed and failed.

The agents here run the real simulated engine (``llmgw.sim.engine``), whose
``stall_after_s`` stops its engine steps while /health answers 200 and
/metrics shows the running requests beside frozen token counters. They
probe and scrape every 0.1 s and call an engine stalled after 1 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from tests.agent.conftest import AgentFactory, WatchLog
from tests.agent.fakes import FakeControlPlane
from tests.agent.helpers import assign, cpu_slot, model
from tests.agent.test_agent import alive, wait_dead
from tests.agent.test_engines import ctx
from tests.agent.test_liveness import status_of
from tests.waiting import eventually

from llmgw.agent.engines import LlamaCppAdapter, SglangAdapter, SimAdapter, VllmAdapter
from llmgw.agent.engines.base import EngineLaunch, LaunchContext
from llmgw.agent.liveness import Liveness
from llmgw.agent.progress import (
    LLAMA_SERVER_METRICS,
    SGLANG_METRICS,
    VLLM_METRICS,
    MetricsError,
    ProgressMetrics,
    StallWatch,
    read_progress,
    read_samples,
)
from llmgw.agent.state import EngineRecord
from llmgw.errors import ConfigError
from llmgw.wire import EngineKind, ModelSpec, ReplicaState, ReplicaStatus, SimParams, WeightsSource

FAST = Liveness(interval_s=0.1, timeout_s=0.5, failures=3, window_s=1.5, stall_window_s=1.0)
STALLED = re.compile(
    r"^engine made no progress for (\d+) s with 1 request running \(token counters"
    r" unchanged\); killed"
)
STALLING = re.compile(r"^no progress since \d\d:\d\d:\d\d UTC: 1 request running \(")


# -- reading the metrics ---------------------------------------------------------------

VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="a } b \\" c"} 1500.0 1712345678000
vllm:generation_tokens_created{engine="0",model_name="m"} 1.7e9
vllm:prompt_tokens_total 4.0e3
vllm:prompt_tokens_totally_different 99
"""


def test_only_the_named_series_are_read_and_summed_over_labels() -> None:
    names = (VLLM_METRICS.running, *VLLM_METRICS.counters)
    assert read_samples(VLLM_PAGE, names) == {
        "vllm:num_requests_running": 3.0,
        "vllm:generation_tokens_total": 1500.0,
        "vllm:prompt_tokens_total": 4000.0,
    }


@pytest.mark.parametrize(
    ("page", "message"),
    [
        ("vllm:num_requests_running 1\n", "no vllm:prompt_tokens_total in the metrics"),
        ('vllm:num_requests_running{a="1" 1\n', "bad value or labels"),
        ("vllm:num_requests_running{} many\n", "bad value"),
        ("vllm:num_requests_running NaN\n", "is NaN"),
    ],
)
def test_a_page_without_a_readable_series_is_an_error(page: str, message: str) -> None:
    # Above all, a page without the running gauge must not read as an idle engine.
    with pytest.raises(MetricsError, match=message):
        read_samples(page, ("vllm:num_requests_running", "vllm:prompt_tokens_total"))


# -- the rule -----------------------------------------------------------------------


def test_stalled_needs_work_running_and_still_counters_for_the_window() -> None:
    watch = StallWatch(Liveness(stall_window_s=120))
    watch.observe(3, (100, 50), now=0.0, wall=0.0)
    assert not watch.stalling
    watch.observe(3, (100, 50), now=5.0)
    assert watch.stalling and not watch.stalled(now=119.9)
    assert watch.stalling_reason() == (
        "no progress since 00:00:00 UTC: 3 requests running (token counters unchanged)"
    )
    assert watch.stalled(now=120.0)
    assert watch.stalled_reason(now=125.2) == (
        "engine made no progress for 125 s with 3 requests running"
        " (token counters unchanged); killed"
    )
    watch.observe(3, (100, 51), now=126.0)  # one prompt token is progress
    assert not watch.stalling and not watch.stalled(now=300.0)


def test_an_idle_engine_is_never_stalled() -> None:
    watch = StallWatch(Liveness(stall_window_s=10))
    for second in range(0, 100, 5):
        watch.observe(0, (100, 50), now=float(second))
        assert not watch.stalling and not watch.stalled(now=float(second))
    # Work that arrives with the counters unchanged starts the window then,
    # not when the counters last moved.
    watch.observe(1, (100, 50), now=100.0)
    watch.observe(1, (100, 50), now=105.0)
    assert watch.stalling and not watch.stalled(now=109.9)
    assert watch.stalled(now=110.0)


def test_a_slow_engine_that_still_counts_tokens_is_not_stalled() -> None:
    watch = StallWatch(Liveness(stall_window_s=10))
    generated = 0
    for second in range(0, 100, 1):
        generated += second % 9 == 0  # a token every 9 s: slow, but inside the window
        watch.observe(4, (generated, 50), now=float(second))
        assert not watch.stalled(now=float(second))


# -- each engine's real metric semantics ---------------------------------------------------
# tests/fixtures/metrics: a /metrics page per scrape, as each engine exports
# it and moves it (see make_engine_series.py and record_sim.py there).

FIXTURES = Path(__file__).parent.parent / "fixtures" / "metrics"
SCRAPE_MARK = "# llmgw-scrape t="


def series(name: str) -> list[tuple[float, str]]:
    pages: list[tuple[float, str]] = []
    for chunk in (FIXTURES / name).read_text().split(SCRAPE_MARK)[1:]:
        when, _, page = chunk.partition("\n")
        pages.append((float(when), page))
    assert pages, name
    return pages


def stalled_at(name: str, metrics: ProgressMetrics, window_s: float) -> float | None:
    """When the check, fed the series scrape by scrape, calls the engine stalled."""
    watch = StallWatch(Liveness(stall_window_s=window_s))
    for when, page in series(name):
        try:
            running, counters = read_progress(page, metrics)
        except MetricsError:
            continue  # counts for nothing, as in the agent
        watch.observe(running, counters, now=when, wall=when)
        if watch.stalled(now=when):
            return when
    return None


@pytest.mark.parametrize(
    ("engine", "metrics", "window_s", "stuck_at"),
    [
        # vLLM: a 90 s chunked prefill counts nothing, within the 120 s window.
        ("vllm", VLLM_METRICS, 120.0, 150.0),
        # SGLang: nothing finishes for 300 s; its realtime counter moves.
        ("sglang", SGLANG_METRICS, 120.0, 150.0),
        # The simulator, recorded from the real engine at 2 s scrapes.
        ("sim", VLLM_METRICS, 2.5, 5.3),
    ],
)
def test_a_long_request_is_progress_and_a_stuck_engine_is_not(
    engine: str, metrics: ProgressMetrics, window_s: float, stuck_at: float
) -> None:
    assert stalled_at(f"{engine}-long-request.prom", metrics, window_s) is None
    assert stalled_at(f"{engine}-stuck.prom", metrics, window_s) == stuck_at


def test_sglang_finished_request_counters_would_kill_a_long_request() -> None:
    # What the check watched before: SGLang counts these only when a request
    # finishes, so one long request read as a stall once the window passed.
    finished_only = ProgressMetrics(
        running="sglang:num_running_reqs",
        counters=("sglang:generation_tokens_total", "sglang:prompt_tokens_total"),
    )
    assert stalled_at("sglang-long-request.prom", finished_only, 120.0) == 120.0
    assert stalled_at("sglang-long-request.prom", SGLANG_METRICS, 120.0) is None


def test_sglang_before_its_first_batch_has_no_counter_yet() -> None:
    # A labelled counter exports nothing until it first counts: that scrape is
    # an error (counted for nothing), never a counter standing at 0.
    (_, first), (_, second), *_ = series("sglang-fresh.prom")
    with pytest.raises(MetricsError, match="none of sglang:realtime_tokens_total"):
        read_progress(first, SGLANG_METRICS)
    assert read_progress(second, SGLANG_METRICS) == (1.0, (1024.0 + 225.0,))


def test_a_counter_without_a_sample_reads_as_zero_beside_one_that_has() -> None:
    page = "vllm:num_requests_running 2\nvllm:generation_tokens_total 7\n"
    assert read_progress(page, VLLM_METRICS) == (2.0, (7.0, 0.0))
    with pytest.raises(MetricsError, match="no vllm:num_requests_running"):
        read_progress("vllm:generation_tokens_total 7\n", VLLM_METRICS)


def test_records_from_before_counters_still_load() -> None:
    # An engine adopted after an upgrade: its record names generation and prompt.
    old_vllm = {"running": "vllm:num_requests_running", **_legacy("vllm")}
    assert ProgressMetrics.model_validate(old_vllm) == VLLM_METRICS
    # SGLang's old counters are the ones that stall; the record gets today's.
    old_sglang = {"running": "sglang:num_running_reqs", **_legacy("sglang")}
    assert ProgressMetrics.model_validate(old_sglang) == SGLANG_METRICS


def _legacy(prefix: str) -> dict[str, str]:
    return {
        "generation": f"{prefix}:generation_tokens_total",
        "prompt": f"{prefix}:prompt_tokens_total",
    }


def test_the_stall_window_is_checked() -> None:
    with pytest.raises(ConfigError, match="stall_window_s must be > 0"):
        Liveness(stall_window_s=0)


# -- which engines are scraped ----------------------------------------------------------


def test_engines_with_metrics_declare_them_and_llama_cpp_server_declares_none() -> None:
    gpu = [cpu_slot(0)]
    vllm = VllmAdapter().build(ctx(assign(model("vllm"), gpu), gpu))
    assert vllm.progress == VLLM_METRICS
    sglang = SglangAdapter().build(ctx(assign(model("sglang"), gpu), gpu))
    assert sglang.progress == SGLANG_METRICS and "--enable-metrics" in sglang.argv
    spec = model("sim", weights=WeightsSource(kind="none"), gpu_classes=["cpu"])
    assert SimAdapter().build(ctx(assign(spec, gpu), gpu)).progress == VLLM_METRICS
    gguf = model("llamacpp")
    # llama-server with --metrics counts its llama_decode() calls (one per
    # batch); llama_cpp.server exports no metrics.
    server = LlamaCppAdapter(server_binary="llama-server").build(ctx(assign(gguf, gpu), gpu))
    assert server.progress == LLAMA_SERVER_METRICS and "--metrics" in server.argv
    assert LlamaCppAdapter("").build(ctx(assign(gguf, gpu), gpu)).progress is None
    # A rank that serves no HTTP exports no metrics either.
    headless = assign(model("vllm", tp=16, nodes=2), gpu, rank=1, leader="10.0.0.1")
    assert VllmAdapter().build(ctx(headless, gpu)).progress is None


def test_sglang_keeps_a_catalog_enable_metrics() -> None:
    gpu = [cpu_slot(0)]
    spec = model("sglang", engine_args=["--enable-metrics"])
    argv = SglangAdapter().build(ctx(assign(spec, gpu), gpu)).argv
    assert argv.count("--enable-metrics") == 1


def test_the_record_keeps_what_to_scrape_for_adoption() -> None:
    record = EngineRecord(
        replica_id="r1",
        generation=1,
        model="m",
        assignment=assign(sim_model(), [cpu_slot(0)]),
        port=5000,
        progress=VLLM_METRICS,
    )
    assert EngineRecord.model_validate_json(record.model_dump_json()).progress == VLLM_METRICS


# -- the agent ------------------------------------------------------------------------


class NoMetricsSim(SimAdapter):
    """The simulated engine, declared like llama.cpp: no metrics to scrape."""

    def build(self, ctx: LaunchContext) -> EngineLaunch:
        return dataclasses.replace(super().build(ctx), progress=None)


def sim_model(**params: object) -> ModelSpec:
    sim = SimParams.model_validate({"startup_s": 0.1, "decode_ms_per_token": 20.0, **params})
    spec = model(
        "sim",
        name="sim-model",
        weights=WeightsSource(kind="none"),
        gpu_classes=["cpu"],
        start_timeout_s=30.0,
    )
    return spec.model_copy(update={"sim": sim})


@dataclasses.dataclass
class Flight:
    chunks: list[bytes]  # received so far
    task: asyncio.Task[None]  # done when the answer ended


@contextlib.asynccontextmanager
async def streaming(port: int, max_tokens: int) -> AsyncIterator[Flight]:
    """A streamed completion in flight on the engine."""
    chunks: list[bytes] = []

    async def read() -> None:
        body = {"model": "sim-model", "prompt": "x", "max_tokens": max_tokens, "stream": True}
        async with aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{port}/v1/completions"
            async with http.post(url, json=body) as resp:
                assert resp.status == 200
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        chunks.append(line)

    task = asyncio.create_task(read())
    try:
        yield Flight(chunks, task)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
            await task


async def ready_sim(
    fake_cp: FakeControlPlane, make_agent: AgentFactory, adapter: SimAdapter, spec: ModelSpec
) -> ReplicaStatus:
    make_agent("n1", liveness=FAST, adapters={EngineKind.SIM: adapter})
    fake_cp.assign_one(spec)
    ready = await fake_cp.wait_state("r1", ReplicaState.READY)
    assert ready.port is not None and ready.pid is not None
    return ready


def serving(fake_cp: FakeControlPlane) -> list[ReplicaStatus]:
    """Every report of the replica since it became ready."""
    return [
        s for r in fake_cp.reports if (s := status_of(r)) is not None and s.ready_at is not None
    ]


async def test_engine_that_stalls_with_a_request_running_is_killed_and_failed(
    fake_cp: FakeControlPlane, make_agent: AgentFactory
) -> None:
    ready = await ready_sim(fake_cp, make_agent, SimAdapter(), sim_model(stall_after_s=1.5))
    assert ready.port is not None and ready.pid is not None
    async with streaming(ready.port, max_tokens=10_000) as flight:
        # While the window runs it is still routed to, and says why it may not be.
        stalling = await fake_cp.wait_for(
            lambda r: (
                (s := status_of(r)) is not None
                and s.state == ReplicaState.READY
                and STALLING.match(s.reason or "") is not None
            )
        )
        assert flight.chunks  # the request made progress before the stall
        status = status_of(stalling)
        assert status is not None and status.pid == ready.pid and alive(ready.pid)
        failed = await fake_cp.wait_state("r1", ReplicaState.FAILED)
    assert failed.reason is not None
    match = STALLED.match(failed.reason)
    assert match, failed.reason
    assert int(match.group(1)) >= 1  # the window, not one still scrape
    # Stopped by the agent (SIGTERM, which the simulated engine answers by
    # exiting cleanly), not exited on its own: it would still be stuck.
    assert failed.exit_code == 0
    assert "stalls now (stall_after_s)" in failed.reason
    await wait_dead(ready.pid)


async def test_an_idle_engine_with_still_counters_is_left_alone(
    fake_cp: FakeControlPlane, make_agent: AgentFactory, watch_log: WatchLog
) -> None:
    # Its engine steps stop too: nothing tells it from a stuck engine but the
    # running gauge, which says there is nothing to make progress on.
    ready = await ready_sim(fake_cp, make_agent, SimAdapter(), sim_model(stall_after_s=0.2))
    since = time.monotonic()
    # The stall, then longer than the window: scraped all along, and each
    # scrape read still counters with nothing running.
    await eventually(
        lambda: WatchLog.spans(watch_log.scrapes, since, 2.5), what="scrapes over 2.5 s"
    )
    read = WatchLog.since(watch_log.scrapes, since)
    values = [got for got in read if not isinstance(got, Exception)]
    assert values and len(values) == len(read), read
    assert {running for running, _ in values} == {0.0}
    assert len({counters for _, counters in values}) == 1
    seen = serving(fake_cp)
    assert {s.state for s in seen} == {ReplicaState.READY}
    assert all(s.reason is None for s in seen)
    assert ready.pid is not None and alive(ready.pid)


async def test_a_slow_engine_that_makes_progress_is_left_alone(
    fake_cp: FakeControlPlane, make_agent: AgentFactory
) -> None:
    # A token every 0.4 s: several scrapes in a row see the same counters,
    # but never for the 1 s window.
    ready = await ready_sim(fake_cp, make_agent, SimAdapter(), sim_model(decode_ms_per_token=400))
    assert ready.port is not None
    async with streaming(ready.port, max_tokens=8) as flight:
        await asyncio.wait_for(asyncio.shield(flight.task), 10)
        assert b'"finish_reason":"length"' in flight.chunks[-1]  # all 8 tokens
    await fake_cp.wait_state("r1", ReplicaState.READY)
    seen = serving(fake_cp)
    assert ReplicaState.FAILED not in {s.state for s in seen}
    assert ready.pid is not None and alive(ready.pid)


async def test_an_engine_without_metrics_is_not_scraped(
    fake_cp: FakeControlPlane, make_agent: AgentFactory, watch_log: WatchLog
) -> None:
    # The same stall with a request running as above, but the launch names no
    # metrics (as llama.cpp's): only the health probe watches it, and /health
    # answers. Without the scrape nothing notices, which is the point here.
    ready = await ready_sim(fake_cp, make_agent, NoMetricsSim(), sim_model(stall_after_s=0.5))
    assert ready.port is not None
    since = time.monotonic()
    async with streaming(ready.port, max_tokens=10_000) as flight:
        # The stall, then longer than the window: probed all along, never scraped.
        await eventually(
            lambda: WatchLog.spans(watch_log.probes, since, 2.5), what="probes over 2.5 s"
        )
        assert flight.chunks and not flight.task.done()
    assert not watch_log.scrapes
    assert set(WatchLog.since(watch_log.probes, since)) == {None}
    seen = serving(fake_cp)
    assert {s.state for s in seen} == {ReplicaState.READY}
    assert all(s.reason is None for s in seen)
    assert ready.pid is not None and alive(ready.pid)
