"""Liveness: a ready engine that stops answering its health probe is killed and failed.

The stub engine holds ``/health`` requests unanswered from a chosen moment
(``--health-stall-after``), for a while or for good, while its process lives
on, as a deadlocked engine does. The agents here probe every 0.1 s and give
up after 3 failed probes spanning 1.5 s.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from tests.agent.conftest import AgentFactory, WatchLog
from tests.agent.fakes import FakeControlPlane
from tests.agent.helpers import assign, cpu_slot
from tests.agent.test_agent import alive, stub_model, wait_dead
from tests.waiting import eventually

from llmgw.agent.app import Agent
from llmgw.agent.liveness import FailedProbes, Liveness
from llmgw.agent.state import EngineRecord
from llmgw.errors import ConfigError
from llmgw.wire import AgentReport, ModelSpec, ReplicaState, ReplicaStatus

FAST = Liveness(interval_s=0.1, timeout_s=0.3, failures=3, window_s=1.5)
HUNG = re.compile(
    r"^engine stopped answering /health for (\d+) s \((\d+) probes failed in a row,"
    r" last: no answer within 0\.3 s\); killed; last output: .*stub engine"
)
FAILING = "health probe /health failing since "


def status_of(report: AgentReport, replica_id: str = "r1") -> ReplicaStatus | None:
    return next((s for s in report.replicas if s.replica_id == replica_id), None)


def failing(state: ReplicaState) -> Callable[[AgentReport], bool]:
    def check(report: AgentReport) -> bool:
        status = status_of(report)
        return (
            status is not None
            and status.state == state
            and (status.reason or "").startswith(FAILING)
        )

    return check


def assert_hung_failure(status: ReplicaStatus, *, our_child: bool = True) -> None:
    assert status.reason is not None
    match = HUNG.match(status.reason)
    assert match, status.reason
    assert int(match.group(1)) >= 1  # the window (1.5 s), not one failed probe
    assert int(match.group(2)) >= FAST.failures
    # Stopped by the agent, not exited. An adopted engine's exit code is known
    # only when it is still the test process's child and nothing else reaped it.
    assert status.exit_code == -signal.SIGTERM or (not our_child and status.exit_code is None)
    assert status.log_tail


# -- the rule -----------------------------------------------------------------------


def test_hung_needs_both_the_failures_and_the_window() -> None:
    probes = FailedProbes(Liveness(interval_s=5, timeout_s=5, failures=3, window_s=30))
    probes.failed("HTTP 503", now=100.0, wall=0.0)
    probes.failed("HTTP 503", now=101.0)
    probes.failed("HTTP 503", now=102.0)
    assert not probes.hung(now=102.0)  # three failures in two seconds: a busy engine
    assert not probes.hung(now=129.9)
    assert probes.hung(now=130.0)
    assert probes.failing_reason("/health") == (
        "health probe /health failing since 00:00:00 UTC (3 probes failed in a row, last: HTTP 503)"
    )
    assert probes.hung_reason("/health", now=131.2) == (
        "engine stopped answering /health for 31 s (3 probes failed in a row,"
        " last: HTTP 503); killed"
    )
    assert probes.passed()  # one answer ends the run
    assert not probes.failing and not probes.passed()
    probes.failed("no answer within 5 s", now=200.0)
    assert not probes.hung(now=240.0)  # a single failure, however long ago


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"interval_s": 0}, "interval_s must be > 0"),
        ({"timeout_s": -1}, "timeout_s must be > 0"),
        ({"failures": 0}, "failures must be >= 1"),
        ({"window_s": float("nan")}, "window_s must be >= 0"),
    ],
)
def test_liveness_settings_are_checked(settings: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Liveness(**settings)  # type: ignore[arg-type]


def test_a_record_from_before_liveness_checks_is_not_probed() -> None:
    # Its health path may be one that must not be probed mid-generation.
    raw = {
        "replica_id": "r1",
        "generation": 1,
        "model": "m",
        "assignment": assign(stub_model(), [cpu_slot(0)]).model_dump(mode="json"),
        "port": 5000,
        "health_path": "/v1/models",
    }
    assert EngineRecord.model_validate(raw).liveness_path is None


# -- the agent ------------------------------------------------------------------------


async def ready_stub(
    fake_cp: FakeControlPlane, make_agent: AgentFactory, *stall: str
) -> tuple[Agent, ModelSpec, ReplicaStatus]:
    """An agent probing FAST, its stub engine ready; /health stalls after ``stall``."""
    agent = make_agent("n1", liveness=FAST)
    spec = stub_model(args=["--health-stall-after", *stall])
    fake_cp.assign_one(spec)
    ready = await fake_cp.wait_state("r1", ReplicaState.READY)
    assert ready.pid is not None
    return agent, spec, ready


async def test_engine_that_stops_answering_health_is_killed_and_failed(
    fake_cp: FakeControlPlane, make_agent: AgentFactory
) -> None:
    _, _, ready = await ready_stub(fake_cp, make_agent, "1")
    assert ready.reason is None
    # While the window runs it is still routed to, and says why it may not be.
    report = await fake_cp.wait_for(failing(ReplicaState.READY))
    status = status_of(report)
    assert status is not None and status.pid == ready.pid and alive(ready.pid)
    failed = await fake_cp.wait_state("r1", ReplicaState.FAILED)
    assert_hung_failure(failed)
    await wait_dead(ready.pid)


async def test_a_short_stall_is_reported_but_not_failed(
    fake_cp: FakeControlPlane, make_agent: AgentFactory, watch_log: WatchLog
) -> None:
    # Failed probes (one or two) span at most the stall plus one probe
    # timeout, 1.1 s: under the 1.5 s window.
    _, _, ready = await ready_stub(fake_cp, make_agent, "1", "--health-stall-for", "0.8")
    await fake_cp.wait_for(failing(ReplicaState.READY))
    recovered = await fake_cp.wait_state("r1", ReplicaState.READY)
    while recovered.reason is not None:
        recovered = await fake_cp.wait_state("r1", ReplicaState.READY)
    since = time.monotonic()
    # The agent went on probing for longer than the window, and each probe passed.
    await eventually(
        lambda: WatchLog.spans(watch_log.probes, since, 2.0), what="probes over 2 s"
    )
    assert set(WatchLog.since(watch_log.probes, since)) == {None}
    seen = [s for r in fake_cp.reports if (s := status_of(r)) is not None]
    assert ReplicaState.FAILED not in {s.state for s in seen}
    assert seen[-1].state == ReplicaState.READY and seen[-1].reason is None
    assert seen[-1].pid == ready.pid
    assert ready.pid is not None and alive(ready.pid)


async def test_a_draining_engine_is_checked_too(
    fake_cp: FakeControlPlane, make_agent: AgentFactory
) -> None:
    # In-flight requests to a hung draining engine would never finish, and
    # the control plane would wait out its whole drain timeout.
    _, spec, ready = await ready_stub(fake_cp, make_agent, "2.5")
    draining = assign(spec, [cpu_slot(0)])
    draining.draining = True
    fake_cp.assignments["n1"] = [draining]
    await fake_cp.wait_state("r1", ReplicaState.DRAINING)
    await fake_cp.wait_for(failing(ReplicaState.DRAINING))
    failed = await fake_cp.wait_state("r1", ReplicaState.FAILED)
    assert_hung_failure(failed)
    assert ready.pid is not None
    await wait_dead(ready.pid)


async def test_an_adopted_engine_is_checked_too(
    fake_cp: FakeControlPlane, make_agent: AgentFactory, tmp_path: Path
) -> None:
    agent, _, ready = await ready_stub(fake_cp, make_agent, "3")
    await agent.shutdown(stop_engines=False)  # as if the agent died
    assert alive(ready.pid)

    make_agent("n1", data_dir=tmp_path / "n1", liveness=FAST)
    adopted = await fake_cp.wait_state("r1", ReplicaState.READY)
    assert adopted.pid == ready.pid and adopted.reason is None
    failed = await fake_cp.wait_state("r1", ReplicaState.FAILED)
    assert failed.pid == ready.pid
    assert_hung_failure(failed, our_child=False)
    await wait_dead(ready.pid)
