"""A replica's concurrency, as the catalog states it, reaches the gateways' routing table."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.control.planekit import opened_plane, ready_replica

from llmgw.control.concurrency import replica_concurrency
from llmgw.wire import GatewayConfig, ModelSpec, ReplicaState, SimParams


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (ModelSpec(name="m", engine="vllm"), None),  # its default is no latency bound
        (ModelSpec(name="m", engine="vllm", engine_args=["--max-num-seqs", "16"]), 16),
        (ModelSpec(name="m", engine="vllm", engine_args=["--max-num-seqs=24"]), 24),
        (ModelSpec(name="m", engine="vllm", engine_args=["--max-num-seqs=24"],
                   max_concurrency=8), 8),  # the entry's own word wins
        (ModelSpec(name="m", engine="sglang", engine_args=["--max-running-requests", "32"]), 32),
        (ModelSpec(name="m", engine="llama-server", engine_args=["-np", "4"]), 4),
        (ModelSpec(name="m", engine="llama-server", engine_args=["--parallel"]), None),
        (ModelSpec(name="m", engine="sim"), None),
        (ModelSpec(name="m", engine="sim", sim=SimParams(decode_ms_per_token=5)), None),
        (ModelSpec(name="m", engine="sim", sim=SimParams(max_running=6)), 6),
    ],
)  # fmt: skip
def test_what_the_catalog_says(spec: ModelSpec, expected: int | None) -> None:
    assert replica_concurrency(spec) == expected


async def test_it_reaches_the_gateways_and_a_change_restarts_no_engine(tmp_path: Path) -> None:
    async with opened_plane(tmp_path, credentials=False) as (cp, _):
        spec = ModelSpec(name="m", engine="sim", max_concurrency=4)
        await cp.catalog.put([spec, ModelSpec(name="free", engine="sim")])
        received = GatewayConfig.model_validate_json(cp.gateways.config().model_dump_json())
        assert {r.name: r.max_concurrency for r in received.routing.models} == {
            "m": 4, "free": None,
        }  # fmt: skip
        replica = ready_replica(cp, "m")
        version = cp.state.routing_version
        await cp.catalog.put([spec.model_copy(update={"max_concurrency": 2})])
        assert (replica.generation, replica.state) == (1, ReplicaState.READY)
        assert cp.state.routing_version > version
        routes = {r.name: r for r in cp.gateways.config().routing.models}
        assert routes["m"].max_concurrency == 2
