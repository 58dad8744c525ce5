"""External models in the control plane: catalog rules, routing table, placement, health."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from llmgw.control.adminapi.patroni import StoreStatus
from llmgw.control.adminapi.summary import fleet_summary
from llmgw.control.adminapi.views.models import ReplicaTally, model_view
from llmgw.control.catalog import parse_models, validate_catalog
from llmgw.control.external import STALE_AFTER_S, endpoint_id
from llmgw.control.plane import ControlPlane
from llmgw.control.reconciler import Reconciler
from llmgw.control.scheduler.planner import plan
from llmgw.control.store.repo import Store
from llmgw.errors import ValidationError
from llmgw.sim.fleetgen import cpu_node, fleet
from llmgw.wire import (
    EngineDialect,
    EngineKind,
    GatewayLoadReport,
    ModelSpec,
    ReplicaLoad,
)

ISSUE = """
models:
  - name: team-vllm
    external:
      urls: ["http://10.0.0.5:8000", "http://10.0.0.6:8000"]
      model: meta-llama/Llama-3.1-8B-Instruct
      api_key_env: TEAM_VLLM_KEY
"""
URLS = ["http://10.0.0.5:8000", "http://10.0.0.6:8000"]
T0 = 1_000_000.0


def test_the_issues_entry_is_an_external_model() -> None:
    (spec,) = parse_models(ISSUE)
    validate_catalog([spec])
    assert spec.engine is EngineKind.EXTERNAL and spec.external is not None
    assert spec.external.urls == URLS and spec.external.api_key_env == "TEAM_VLLM_KEY"


def _problems(entry: str) -> str:
    with pytest.raises(ValidationError) as refused:
        validate_catalog(parse_models(entry))
    return str(refused.value)


def test_what_only_a_run_engine_reads_is_refused_with_the_field() -> None:
    text = _problems("""
- name: team
  external: {urls: ["https://api.example.com/openai"]}
  gpus: 2
  tp: 2
  engine_args: ["--x"]
  min_replicas: 0
""")
    for field in ("gpus", "tp", "engine_args", "min_replicas"):
        assert f"model 'team': field {field!r}" in text
    assert "external model" in text
    assert "field 'engine'" in _problems(
        "{name: t, engine: vllm, external: {urls: ['http://h:1']}}"
    )
    assert "needs an 'external' block" in _problems("{name: t, engine: external}")


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://h:8000/v1", "without it"),
        ("http://user:pw@h:8000", "api_key_env"),
        ("ftp://h", "http"),
        ("http://h:8000?x=1", "query"),
    ],
)
def test_urls_are_base_urls_without_secrets(url: str, says: str) -> None:
    with pytest.raises(ValidationError) as refused:
        parse_models(f"{{name: t, external: {{urls: ['{url}']}}}}")
    assert "external.urls" in str(refused.value) and says in str(refused.value)


def test_the_key_is_named_never_given() -> None:
    with pytest.raises(ValidationError) as refused:
        parse_models("{name: t, external: {urls: ['http://h:1'], api_key_env: 'sk-abc def'}}")
    assert "api_key_env" in str(refused.value)
    with pytest.raises(ValidationError):
        parse_models("{name: t, external: {urls: ['http://h:1'], api_key: 'sk-abc'}}")


async def test_the_routing_table_names_each_url_and_the_upstreams_name(
    cp: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TEAM_VLLM_KEY", "sk-upstream-secret-value")
    (spec,) = parse_models(ISSUE)
    await cp.catalog.put([spec])
    (route,) = cp.gateways.config().routing.models
    assert route.served_name == "meta-llama/Llama-3.1-8B-Instruct" and route.name == "team-vllm"
    assert [e.url for e in route.endpoints] == URLS
    for endpoint in route.endpoints:
        assert endpoint.external and endpoint.api_key_env == "TEAM_VLLM_KEY"
        assert endpoint.engine_key is None
        # No dialect declared: OpenAI's, so streams are asked for their usage.
        assert endpoint.dialect == EngineDialect()
    # The control plane never reads the variable: its value is nowhere.
    assert "sk-upstream-secret-value" not in cp.gateways.config().model_dump_json()
    assert "sk-upstream-secret-value" not in str(await cp.store.list_models())


async def test_the_scheduler_places_nothing_for_an_external_model(tmp_path: Path) -> None:
    store = await Store.open(f"sqlite:///{tmp_path / 't.db'}")
    try:
        (spec,) = parse_models(ISSUE)
        state = fleet([cpu_node("n1", slots=4, seen_at=T0)], [spec], T0)
        epoch = await store.bump_epoch()
        result = await Reconciler(state, store).run_pass(T0, epoch)
        assert result.placed == 0 and not state.replicas
        planned = plan(state, T0)
        assert planned.placements == 0 and planned.unplaceable == []
    finally:
        await store.close()


def _report(gateway: str, up: bool | None, reason: str | None = None, url: str = URLS[1]) -> (
    GatewayLoadReport
):
    load = ReplicaLoad(replica_id=endpoint_id("team-vllm", url), up=up, reason=reason)
    return GatewayLoadReport(gateway_id=gateway, replicas=[load])


async def test_health_from_the_gateways_reads_in_the_views_and_the_summary(
    cp: ControlPlane,
) -> None:
    (spec,) = parse_models(ISSUE)
    await cp.catalog.put([spec, ModelSpec(name="m", engine="sim", min_replicas=0)])
    record = cp.state.models["team-vllm"]

    def view(later: float = 0.0) -> tuple[int, int, int, str | None, list[str]]:
        v = model_view(record, ReplicaTally(), time.time() + later)
        return v.desired, v.ready, v.starting, v.reason, [u.state for u in v.external or []]

    # No gateway has looked yet.
    assert view() == (2, 0, 2, None, ["unknown", "unknown"])
    await cp.gateways.record_load(_report("g1", True, url=URLS[0]))
    await cp.gateways.record_load(_report("g1", False, "unreachable: connection refused"))
    assert view() == (2, 1, 0, f"{URLS[1]} is down: unreachable: connection refused",
                      ["up", "down"])  # fmt: skip
    summary = fleet_summary(cp.state, time.time(), StoreStatus([]))
    assert (summary.models.total, summary.models.short) == (2, 1)
    assert summary.unplaceable == []  # nothing to place: it is short of URLs up
    # Another gateway reaches it: up, since it can be routed to from there.
    await cp.gateways.record_load(_report("g2", True))
    assert view()[4] == ["up", "up"]
    assert fleet_summary(cp.state, time.time(), StoreStatus([])).models.short == 0
    # Reports from gateways gone quiet stop counting.
    assert view(later=STALE_AFTER_S + 1)[4] == ["unknown", "unknown"]
    # Probes of URLs no longer listed (an older config's) are ignored.
    await cp.gateways.record_load(_report("g1", False, url="http://10.9.9.9:1"))
    assert set(record.endpoint_health) == set(URLS)
