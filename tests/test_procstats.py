"""SIGUSR1 makes a long-running process write its own figures to stderr (llmgw.procstats)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc

import pytest

from llmgw import procstats


async def test_snapshot_counts_the_loops_tasks_and_open_files() -> None:
    before = procstats.snapshot("test")
    release = asyncio.Event()

    async def parked() -> None:
        await release.wait()

    tasks = [asyncio.create_task(parked()) for _ in range(5)]
    with contextlib.ExitStack() as files:
        for _ in range(3):
            files.enter_context(tempfile.TemporaryFile())
        await asyncio.sleep(0)
        after = procstats.snapshot("test")
    release.set()
    await asyncio.gather(*tasks)
    assert after["asyncio_tasks"] - before["asyncio_tasks"] == 5
    assert after["open_files"] - before["open_files"] == 3
    # The grouping names what grows.
    assert dict(map(tuple, after["top_tasks"]))[parked.__qualname__] == 5
    assert after["rss_bytes"] > 10 * 1024 * 1024
    assert after["pid"] == os.getpid() and after["part"] == "test"


def test_lines_round_trip_and_other_lines_are_not_figures() -> None:
    stats = {"part": "gateway", "pid": 1, "asyncio_tasks": 3}
    assert procstats.parse_line(procstats.format_line(stats)) == stats
    assert procstats.parse_line("INFO llmgw.gateway: listening") is None
    assert procstats.parse_line(f"{procstats.MARKER} not json") is None
    assert procstats.parse_line(f"{procstats.MARKER} [1, 2]") is None


def test_a_sim_engine_answers_sigusr1_and_lives_on() -> None:
    """The whole path on a real process: handler on its loop, line on its stderr.

    Without the handler SIGUSR1 kills the process (the default action), so
    this fails both ways a missing install can show.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw.sim.engine", "--model", "m", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert "listening on" in proc.stdout.readline()
        proc.send_signal(signal.SIGUSR1)
        stats = None
        deadline = time.monotonic() + 30
        while stats is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, f"stderr ended; exit code {proc.poll()}"
            stats = procstats.parse_line(line)
        assert stats is not None
        assert stats["part"] == "sim-engine" and stats["pid"] == proc.pid
        # The engine's server and its exit watcher at least.
        assert stats["asyncio_tasks"] >= 2
        assert stats["open_files"] >= 4 and stats["rss_bytes"] > 0
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_with_llmgw_tracemalloc_the_first_line_starts_tracing_and_later_ones_name_what_stays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert "allocation_growth" not in procstats.snapshot("test")
    monkeypatch.setenv(procstats.TRACE_ENV, "4")
    try:
        assert procstats.snapshot("test")["allocation_growth"] == []
        assert tracemalloc.is_tracing() and tracemalloc.get_traceback_limit() == 4
        held = [bytearray(1024) for _ in range(4000)]
        growth = procstats.snapshot("test")["allocation_growth"]
        del held
        after_release = procstats.snapshot("test")["allocation_growth"]
    finally:
        tracemalloc.stop()
    site, kib, blocks = growth[0]
    assert site.startswith(f"{os.path.basename(__file__)}:") and kib > 3000 and blocks >= 4000
    # What is freed is no longer held; nor is what the count itself is made of.
    assert all(row[1] < 1000 for row in after_release), after_release
    frames = [frame.split(":")[0] for row in growth for frame in row[0].split(" <- ")]
    assert "procstats.py" not in frames
