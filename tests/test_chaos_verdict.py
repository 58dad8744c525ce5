"""The chaos suite's verdict (bench/chaoskit/verdict.py) on made-up runs: it must be able to fail.

A failure is excused only by a kill of the request's model while it was in
flight, arriving within seconds of the kill, and no more of them than the
killed replica held; a fault passes only with every figure it claims.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from tests import benchscripts

sys.path.insert(0, str(benchscripts.BENCH))

from chaoskit.load import Record
from chaoskit.rows import Lost
from chaoskit.run import Frame, Injected, Outcome
from chaoskit.verdict import Judged, Kill, excused, reasons

KILL = Kill(at=100.0, model="gemma", replica="gemma-r1", held=2)


def _failed(model: str = "gemma", sent: float = 99.0, done: float = 100.2, *,
            stream: bool = False, chunks: int = 0, code: str | None = None) -> Record:
    return Record(model, stream, sent, done=done, ok=False, code=code, chunks=chunks,
                  error="broken")


def test_a_failure_in_flight_on_the_killed_model_is_excused() -> None:
    cut = [_failed(), _failed(stream=True, chunks=3)]
    assert excused(cut, [KILL]) == cut


@pytest.mark.parametrize("record", [
    # A stream of another model, failed before its first chunk.
    _failed("chat", stream=True),
    # Sent after the kill: it could not have been on the dead replica.
    _failed(sent=100.5, done=101.0),
    # Done before the kill.
    _failed(sent=98.0, done=99.5),
    # In flight at the kill, but failed long after it: something else.
    _failed(sent=99.0, done=130.0, stream=True, chunks=5),
    # The gateway says no replica took it: never the kill's doing.
    _failed(code="upstream_unavailable"),
    _failed(stream=True, code="model_not_ready"),
])  # fmt: skip
def test_a_failure_the_kill_cannot_explain_is_not_excused(record: Record) -> None:
    assert excused([record], [KILL]) == []


def test_a_kill_excuses_no_more_failures_than_its_replica_held() -> None:
    # Three gemma requests failed at the kill; the dead replica held two:
    # the third was on the replica that lived.
    three = [_failed(done=100.1), _failed(done=100.2), _failed(done=100.3)]
    assert excused(three, [KILL]) == three[:2]
    assert excused(three, [KILL, Kill(100.0, "gemma", "gemma-r2", 1)]) == three


def test_the_frame_counts_unexcused_failures() -> None:
    outcome = Outcome("engine_kill")
    ok = Record("gemma", False, 99.0, done=99.5, ok=True)
    records = [ok, _failed(), _failed("chat", stream=True)]
    Frame._judge(outcome, records, Injected(ended=100.0, kills=[KILL]))
    assert (outcome.sent, outcome.failed, outcome.failed_unexcused) == (3, 2, 1)


def _judged(**changes: Any) -> Judged:
    good: dict[str, Any] = dict(
        sent=200, failed=1, failed_unexcused=0, answered_after=120, recovery_s=3.2,
        lost={"catalog": 0, "keys": 0, "events": 0, "usage": 1, "usage_extra": 0},
        usage_bound=4, figures={"first_answer_s": 1.5},
    )  # fmt: skip
    return Judged(**{**good, **changes})


def test_a_fault_that_went_well_passes() -> None:
    assert reasons(_judged()) == []


@pytest.mark.parametrize("changes, because", [
    ({"failed_unexcused": 1}, "failure(s) no kill explains"),
    ({"sent": 0, "answered_after": 0}, "no request was sent"),
    ({"answered_after": 0}, "nothing was answered after the fault"),
    ({"recovery_s": None}, "never whole again"),
    ({"lost": None}, "rows were not read"),
    ({"lost": {"catalog": 0, "keys": 1, "events": 0, "usage": 0, "usage_extra": 0}},
     "keys row(s) lost"),
    ({"lost": {"catalog": 0, "keys": 0, "events": 0, "usage": 5, "usage_extra": 0}},
     "usage of 5 answered request(s) lost (bound 4)"),
    ({"lost": {"catalog": 0, "keys": 0, "events": 0, "usage": 0, "usage_extra": 2}},
     "counted twice"),
    ({"figures": {"first_answer_s": None}}, "first_answer_s not measured"),
    ({"skipped": "needs root (mounts a tmpfs)"}, "not run"),
])  # fmt: skip
def test_a_fault_fails_its_verdict(changes: dict[str, Any], because: str) -> None:
    failed = reasons(_judged(**changes))
    assert any(because in reason for reason in failed), failed


def _chaos() -> ModuleType:
    return benchscripts.load("chaos")


def _outcome(name: str, **changes: Any) -> Outcome:
    outcome = Outcome(name, sent=100, failed=0, answered_after=50, recovery_s=2.0,
                      lost=Lost(0, 0, 0, 0, 0), usage_bound=3)
    for key, value in changes.items():
        setattr(outcome, key, value)
    return outcome


def test_the_suite_exits_1_when_a_fault_fails_or_did_not_run(
        capsys: pytest.CaptureFixture[str]) -> None:
    chaos = _chaos()
    good = {"engine_kill": _outcome("engine_kill"), "slow_clients": _outcome("slow_clients")}
    assert chaos.verdict(["engine_kill", "slow_clients"], good) == 0
    assert '"ok": true' in capsys.readouterr().out
    bad = {**good, "slow_clients": _outcome("slow_clients", failed=1, failed_unexcused=1)}
    assert chaos.verdict(["engine_kill", "slow_clients"], bad) == 1
    assert chaos.verdict(["engine_kill", "slow_clients"], {"engine_kill": good["engine_kill"]}) == 1
    skipped = {"disk_full": Outcome("disk_full", skipped="needs root")}
    assert chaos.verdict(["disk_full"], skipped) == 1


def test_reading_connections_of_a_process(tmp_path: Path) -> None:
    """connections_in counts what the engine's port holds open (the kill's bound)."""
    import socket

    import psutil
    from chaoskit.procs import connections_in

    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        me = psutil.Process()
        assert connections_in(me, port) == 0
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = server.accept()
            with accepted:
                assert connections_in(me, port) == 1
            del client
