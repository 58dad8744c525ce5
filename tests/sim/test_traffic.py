"""The demo traffic's mix: always-on models always, on-demand ones in bursts, shared prompts."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import orjson
import pytest

from llmgw.cli.up import UpOptions, run_up
from llmgw.cli.uptraffic import check_rate
from llmgw.errors import ConfigError
from llmgw.sim.traffic import QUIET_MARGIN_S, Traffic, TrafficKey, TrafficModel, active_models

STEADY = TrafficModel("steady", on_demand=False, idle_timeout_s=900)
LAZY = TrafficModel("lazy", on_demand=True, idle_timeout_s=30)
LATER = TrafficModel("later", on_demand=True, idle_timeout_s=30)


def _names(elapsed_s: float) -> set[str]:
    return {m.name for m in active_models([STEADY, LAZY, LATER], elapsed_s, burst_s=10)}


def test_on_demand_models_get_staggered_bursts_longer_apart_than_their_idle_timeout() -> None:
    cycle = 10 + 30 + QUIET_MARGIN_S
    assert _names(0) == {"steady", "later"}  # sorted by name: "later" bursts first
    assert _names(9.9) == {"steady", "later"}
    assert _names(10) == {"steady", "lazy"}  # one start at a time
    assert _names(25) == {"steady"}  # quiet past both idle timeouts
    assert _names(cycle) == {"steady", "later"}  # and again
    assert _names(cycle + 10) == {"steady", "lazy"}


def test_requests_mix_keys_and_share_system_prompts() -> None:
    keys = [TrafficKey("a", "sk-a", 0.7), TrafficKey("b", "sk-b", 0.3)]
    traffic = Traffic("http://x/v1", 5.0, keys, lambda: [STEADY], seed=1)
    sent = [traffic.request(0.0) for _ in range(400)]
    assert all(item is not None for item in sent)
    by_key = Counter(item[0].name for item in sent if item is not None)
    assert 220 < by_key["a"] < 340 and by_key["a"] + by_key["b"] == 400
    bodies = [orjson.loads(item[1]) for item in sent if item is not None]
    systems = Counter(b["messages"][0]["content"] for b in bodies)
    assert len(systems) == 6 and systems.most_common(1)[0][1] > 400 / 6  # a popular prefix
    assert {b["model"] for b in bodies} == {"steady"}
    assert 0.7 < sum(b["stream"] for b in bodies) / 400 < 0.95
    assert Traffic("http://x/v1", 5.0, keys, lambda: [LAZY], burst_s=10).request(20.0) is None


def test_traffic_needs_a_simulated_fleet_and_a_rate(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--traffic drives a simulated fleet"):
        run_up(UpOptions(data_dir=tmp_path, port=0, traffic=5.0))
    with pytest.raises(ConfigError, match="--traffic must be above 0"):
        check_rate(0, sim=True)
    assert not (tmp_path / "llmgw.db").exists()  # refused before the store was opened
