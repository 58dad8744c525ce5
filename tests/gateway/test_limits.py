"""The catalog's max_output_tokens: from the catalog to the routing table to the upstream body."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tests.control.planekit import opened_plane, ready_replica
from tests.gateway.conftest import async_client, make_config, route, running_gateway

from llmgw.control.catalog import validate_catalog
from llmgw.errors import ValidationError
from llmgw.gateway.checks.limits import cap_output_tokens
from llmgw.gateway.link import MemoryLink
from llmgw.wire import GatewayConfig, ModelSpec, ReplicaState

CASES: list[tuple[dict[str, Any], int | None, dict[str, Any], bool]] = [
    # (client's limits, cap, limits sent upstream, re-encoded)
    ({}, None, {}, False),
    ({"max_tokens": 10_000}, None, {"max_tokens": 10_000}, False),
    ({}, 64, {"max_tokens": 64}, True),
    ({"max_tokens": None}, 64, {"max_tokens": 64}, True),
    ({"max_tokens": 16}, 64, {"max_tokens": 16}, False),
    ({"max_tokens": 64}, 64, {"max_tokens": 64}, False),
    ({"max_tokens": 4096}, 64, {"max_tokens": 64}, True),
    ({"max_tokens": 0}, 64, {"max_tokens": 0}, False),  # completions: echo only
    # max_completion_tokens alone: max_tokens carries it too (llama.cpp reads only that)
    ({"max_completion_tokens": 5}, 64, {"max_completion_tokens": 5, "max_tokens": 5}, True),
    ({"max_completion_tokens": 500}, 64, {"max_completion_tokens": 64, "max_tokens": 64}, True),
    ({"max_completion_tokens": None}, 64, {"max_completion_tokens": None, "max_tokens": 64}, True),
    # both: the smaller one wins, in both fields
    ({"max_tokens": 8, "max_completion_tokens": 500}, 64,
     {"max_tokens": 8, "max_completion_tokens": 8}, True),
    ({"max_tokens": 8, "max_completion_tokens": 8}, 64,
     {"max_tokens": 8, "max_completion_tokens": 8}, False),
]  # fmt: skip


@pytest.mark.parametrize(("limits", "cap", "sent", "changed"), CASES)
def test_cap_rule(
    limits: dict[str, Any], cap: int | None, sent: dict[str, Any], changed: bool
) -> None:
    payload = {"model": "m", "messages": [], **limits}
    assert cap_output_tokens(payload, cap) is changed
    assert payload == {"model": "m", "messages": [], **sent}


async def test_the_gateway_caps_what_it_sends(upstreams: Any, link: MemoryLink) -> None:
    engine = await upstreams("e1")
    capped = route("capped", [engine], served_name="capped", max_output_tokens=32)
    free = route("free", [engine], served_name="free")
    link.publish(make_config(1, [capped, free]))
    messages: Any = [{"role": "user", "content": "hi"}]
    async with running_gateway(link) as (_, url):
        client = async_client(url)
        await client.chat.completions.create(model="capped", messages=messages)
        await client.chat.completions.create(model="capped", messages=messages, max_tokens=4096)
        await client.chat.completions.create(model="capped", messages=messages, max_tokens=8)
        await client.chat.completions.create(
            model="capped", messages=messages, max_completion_tokens=5
        )
        await client.completions.create(model="capped", prompt="Once")
        await client.embeddings.create(model="capped", input="text")
        await client.chat.completions.create(model="free", messages=messages)
    sent = [(s.path, s.body.get("max_tokens"), s.body.get("max_completion_tokens"))
            for s in engine.seen]  # fmt: skip
    assert sent == [
        ("/v1/chat/completions", 32, None),
        ("/v1/chat/completions", 32, None),
        ("/v1/chat/completions", 8, None),
        ("/v1/chat/completions", 5, 5),
        ("/v1/completions", 32, None),
        ("/v1/embeddings", None, None),  # nothing to generate, nothing added
        ("/v1/chat/completions", None, None),
    ]


def test_catalog_refuses_a_cap_the_context_cannot_hold() -> None:
    ModelSpec(name="ok", engine="sim", max_output_tokens=1024, kv_capacity_tokens=8192)
    with pytest.raises(ValueError, match="max_output_tokens"):
        ModelSpec(name="zero", engine="sim", max_output_tokens=0)
    with pytest.raises(ValidationError) as refused:
        validate_catalog(
            [ModelSpec(name="big", engine="sim", max_output_tokens=8192, kv_capacity_tokens=8192)]
        )
    assert str(refused.value) == (
        "model 'big': field 'max_output_tokens': must be below kv_capacity_tokens"
        " (8192 >= 8192): the prompt needs room in the same context"
    )


async def test_the_cap_reaches_the_gateway_in_the_routing_table(tmp_path: Path) -> None:
    async with opened_plane(tmp_path, credentials=False) as (cp, _):
        await cp.catalog.put([
            ModelSpec(name="capped", engine="sim", max_output_tokens=256),
            ModelSpec(name="free", engine="sim"),
        ])  # fmt: skip
        config = cp.gateways.config()
    # As a standalone gateway receives it: JSON over the watch stream.
    received = GatewayConfig.model_validate_json(config.model_dump_json())
    caps = {r.name: r.max_output_tokens for r in received.routing.models}
    assert caps == {"capped": 256, "free": None}


async def test_a_new_cap_restarts_no_engine(tmp_path: Path) -> None:
    async with opened_plane(tmp_path, credentials=False) as (cp, _):
        spec = ModelSpec(name="m", engine="sim", max_output_tokens=256)
        await cp.catalog.put([spec])
        replica = ready_replica(cp, "m")
        version = cp.state.routing_version
        gateway_only = spec.model_copy(
            update={"max_output_tokens": 64, "aliases": ["small"], "routing": "least-loaded"}
        )
        assert await cp.catalog.put([gateway_only]) == ([], ["m"])
        assert (replica.generation, replica.state) == (1, ReplicaState.READY)
        assert cp.state.routing_version > version  # the gateways learn the new cap
        assert cp.gateways.config().routing.models[0].max_output_tokens == 64
        engine_side = gateway_only.model_copy(update={"engine_args": ["--flag"]})
        await cp.catalog.put([engine_side])
        assert (replica.generation, replica.state) == (2, ReplicaState.STARTING)
