"""bench/manymodels.py: its last line, and a verdict that fails when adapters thrash."""

from __future__ import annotations

import json

import pytest
from tests.benchscripts import load

KEYS = {"adapters", "ttft_p90_s_hot", "ttft_p90_s_cold", "loads_per_min",
        "whole_models_ttft_p90_s", "verdict"}  # fmt: skip


def last_line(capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    out = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("  hot ") for line in out)  # the per-band table
    return dict(json.loads(out[-1]))


def test_adapters_beat_whole_models_on_the_same_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load("manymodels")
    assert bench.main(["--minutes", "2"]) == 0
    result = last_line(capsys)
    assert set(result) >= KEYS and result["adapters"] == 100
    assert float(result["ttft_p90_s_cold"]) * 5 <= float(result["whole_models_ttft_p90_s"])


def test_one_slot_per_engine_thrashes_and_fails_the_verdict(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bench = load("manymodels")
    assert bench.main(["--minutes", "2", "--max-loras", "1"]) == 1
    result = last_line(capsys)
    assert result["verdict"] == {"ok": False, "rule": result["verdict"]["rule"]}  # type: ignore[index]
