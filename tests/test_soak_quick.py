"""The soak (bench/soak.py) in miniature, and how it judges growth.

The 30-minute run is `make soak`; here half a minute shows that every part
(serve, the standalone gateway, the sim fleet, each engine process) answers
SIGUSR1 with its figures while real load goes through both gateways.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from tests import benchscripts

ROOT = Path(__file__).resolve().parent.parent


def _soak() -> ModuleType:
    return benchscripts.load("soak")


def _samples(rss: list[float], files: list[int], tasks: list[int]) -> list[dict[str, Any]]:
    return [
        {"t_s": 60.0 * i, "procs": {"serve": {
            "pid": 7, "rss_mb": r, "open_files": f, "tasks": t, "gc_objects": 1000}}}
        for i, (r, f, t) in enumerate(zip(rss, files, tasks, strict=True))
    ]


def _growth(samples: list[dict[str, Any]], always_on: dict[str, int] | None = None
            ) -> dict[str, Any]:
    return _soak().growth(samples, parts=("serve",), always_on=always_on or {})


def test_growth_skips_warm_up_and_compares_first_and_last_windows() -> None:
    # Ten samples: two of warm-up (however much they grew), then flat within
    # 5 % but for in-flight noise on files and tasks.
    flat = _growth(_samples(
        [80, 120, 125, 126, 125, 127, 126, 128, 127, 129],
        [20, 30, 40, 31, 30, 45, 30, 30, 50, 31],
        [5, 9, 9, 12, 9, 9, 20, 9, 10, 9],
    ))  # fmt: skip
    assert flat["failures"] == []
    assert flat["rss_growth_pct"]["serve"] == pytest.approx(100 * (128 - 125) / 125, abs=0.01)
    assert flat["open_files_growth"]["serve"] == 0 and flat["tasks_growth"]["serve"] == 0
    leaking = _growth(_samples(
        [80, 100, 102, 104, 106, 108, 110, 112, 114, 116],
        [20, 30, 31, 32, 33, 34, 35, 36, 37, 38],
        [5, 9, 9, 9, 9, 9, 9, 9, 9, 9],
    ))  # fmt: skip
    assert leaking["rss_growth_pct"]["serve"] == pytest.approx(100 * (114 - 104) / 104, abs=0.01)
    assert leaking["open_files_growth"]["serve"] == 35 - 31  # floors of the two halves
    assert [f.split(":")[0] for f in leaking["failures"]] == ["serve", "serve"]


def test_a_part_that_restarted_fails_the_verdict() -> None:
    samples = _samples([100] * 6, [20] * 6, [5] * 6)
    samples[4]["procs"]["serve"]["pid"] = 8
    judged = _growth(samples)
    assert judged["rss_growth_pct"] == {}
    assert judged["failures"] == ["serve: restarted (pids [7, 8])"]


def test_a_part_that_missed_a_reading_or_is_gone_fails_the_verdict() -> None:
    samples = _samples([100] * 6, [20] * 6, [5] * 6)
    samples[3]["procs"]["serve"] = {"pid": 7, "missing": True}
    assert _growth(samples)["failures"] == ["serve: no reading in sample(s) [1] after warm-up"]
    del samples[3]["procs"]["serve"]
    assert _growth(samples)["failures"] == ["serve: not running in every sample after warm-up"]


def test_the_verdict_needs_samples_after_warm_up() -> None:
    assert _growth(_samples([100] * 3, [20] * 3, [5] * 3))["failures"] == [
        "1 sample(s) after warm-up: growth needs two or more"]


def _with_engines(samples: list[dict[str, Any]], pids: list[list[int]]) -> None:
    for sample, engines in zip(samples, pids, strict=True):
        for pid in engines:
            sample["procs"][f"engine soak-chat pid {pid}"] = {
                "pid": pid, "rss_mb": 50.0, "open_files": 10, "tasks": 3, "gc_objects": 500}


def test_an_always_on_engine_is_judged_and_its_restart_fails_the_verdict() -> None:
    samples = _samples([100] * 6, [20] * 6, [5] * 6)
    _with_engines(samples, [[11, 12]] * 6)
    steady = _growth(samples, {"soak-chat": 2})
    assert steady["failures"] == []
    assert set(steady["rss_growth_pct"]) == {"serve", "engine soak-chat pid 11",
                                             "engine soak-chat pid 12"}
    restarted = _samples([100] * 6, [20] * 6, [5] * 6)
    _with_engines(restarted, [[11, 12]] * 4 + [[11, 13]] * 2)
    judged = _growth(restarted, {"soak-chat": 2})
    assert judged["failures"] == ["engine soak-chat: restarted (engine soak-chat pid 11,"
                                  " engine soak-chat pid 12, engine soak-chat pid 13)"]
    gone = _samples([100] * 6, [20] * 6, [5] * 6)
    _with_engines(gone, [[11, 12]] * 4 + [[11]] * 2)
    assert _growth(gone, {"soak-chat": 2})["failures"] == [
        "engine soak-chat: [2, 2, 1, 1] engine(s) in the samples after warm-up,"
        " 2 always running expected"]


def test_the_fleets_always_on_models() -> None:
    assert _soak().always_on_engines() == {"soak-chat": 2, "soak-mini": 1, "soak-embed": 1}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_half_a_minute_of_soak_samples_every_process(test_output: Path) -> None:
    log = test_output / "soak-quick.log"
    with log.open("wb") as err:
        done = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "soak.py"), "--minutes", "0.5",
             "--sample-s", "10", "--rate", "2"],
            stdout=subprocess.PIPE, stderr=err, timeout=280, cwd=ROOT,
        )  # fmt: skip
    text = log.read_text()
    # 1 is a growth verdict, which half a minute cannot give reliably.
    assert done.returncode in (0, 1), text[-4000:]
    result = json.loads(done.stdout.decode().strip().splitlines()[-1])
    samples = result["samples"]
    assert len(samples) == 4
    for sample in samples:
        procs = sample["procs"]
        assert {"serve", "gateway", "sim-fleet"} <= set(procs), procs
        # The always-on models' engine processes: two chat, one mini, one embed.
        assert sum(name.startswith("engine ") for name in procs) >= 4, procs
        for name, figures in procs.items():
            assert not figures.get("missing"), f"{name} did not answer SIGUSR1"
            assert figures["tasks"] >= 1 and figures["open_files"] >= 3, (name, figures)
    assert set(result["rss_growth_pct"]) >= {"serve", "gateway", "sim-fleet"}
    sent = {kind: sum(c.values()) for kind, c in result["requests"].items()}
    assert sent.get("chat_stream", 0) > 0 and sent.get("embeddings", 0) > 0, result["requests"]
    failed = {kind: c["failed"] for kind, c in result["requests"].items() if c.get("failed")}
    assert failed == {}, text[-4000:]


def test_the_load_must_have_been_sent_and_answered() -> None:
    soak = _soak()
    assert soak.request_failures({"chat": {"ok": 200, "failed": 2}}) == []
    assert soak.request_failures({"chat": {"ok": 200, "failed": 3}}) == [
        "3 of 203 requests failed"]
    assert soak.request_failures({"key_rotation": {"ok": 3}}) == ["no request was sent"]
    assert soak.request_failures({}) == ["no request was sent"]
