"""Catalog parsing and validation: every rule, named by model, field and rule."""

from __future__ import annotations

import json

import httpx
import pytest
from tests.control.planekit import Plane, inventory, register, report_ok

from llmgw.control.catalog import diff_catalog, parse_models, placement_changed, validate_catalog
from llmgw.errors import ValidationError
from llmgw.wire import AgentReport, EngineKind, ModelSpec


def spec(name: str, **fields: object) -> ModelSpec:
    data: dict[str, object] = {"name": name, "engine": "sim", "gpu_classes": ["h100-80g"]}
    data.update(fields)
    return ModelSpec.model_validate(data)


def problems(specs: list[ModelSpec], existing: dict[str, ModelSpec] | None = None) -> list[str]:
    with pytest.raises(ValidationError) as caught:
        validate_catalog(specs, existing)
    return str(caught.value).splitlines()


# -- parsing ------------------------------------------------------------------


def test_parse_accepts_a_list_a_single_entry_and_a_models_key() -> None:
    as_list = parse_models("- name: a\n  engine: sim\n- name: b\n  engine: vllm\n")
    single = parse_models("name: a\nengine: sim\n")
    wrapped = parse_models("models:\n  - name: a\n    engine: llamacpp\n")
    assert [s.name for s in as_list] == ["a", "b"]
    assert as_list[1].engine is EngineKind.VLLM
    assert [s.name for s in single] == ["a"]
    assert wrapped[0].engine is EngineKind.LLAMACPP


def test_parse_reads_json() -> None:
    text = json.dumps({"models": [{"name": "j", "engine": "sim", "gpus": 2, "tp": 2}]})
    (parsed,) = parse_models(text, source="models.json")
    assert parsed.gpus == 2 and parsed.tp == 2


def test_parse_names_every_bad_field_of_every_entry() -> None:
    text = """
- name: good
  engine: sim
- name: bad-engine
  engine: tensorrt
- name: bad-args
  engine: sim
  engine_args: "--max-model-len 4096"
- name: typo
  engine: sim
  gpu: 2
"""
    with pytest.raises(ValidationError) as caught:
        parse_models(text, source="fleet.yaml")
    lines = str(caught.value).splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("fleet.yaml: model 'bad-engine' (entry 2): field 'engine':")
    assert "field 'engine_args'" in lines[1] and "model 'bad-args' (entry 3)" in lines[1]
    assert "field 'gpu'" in lines[2] and "Extra inputs are not permitted" in lines[2]


def test_parse_rejects_bad_yaml_empty_documents_and_scalars() -> None:
    with pytest.raises(ValidationError, match=r"^models.yaml line 3: not valid YAML or JSON"):
        parse_models("- name: a\n  engine: [sim\n")
    with pytest.raises(ValidationError, match="the document is empty"):
        parse_models("")
    with pytest.raises(ValidationError, match="the list is empty"):
        parse_models("models: []")
    with pytest.raises(ValidationError, match="got a string"):
        parse_models("just words")
    with pytest.raises(ValidationError, match=r"entry 1: must be a mapping of fields, got a list"):
        parse_models("- [1, 2]")


# -- validation ------------------------------------------------------------------


def test_a_valid_catalog_passes() -> None:
    validate_catalog(
        [
            spec("a", gpus=8, tp=8),
            spec("b", gpus=16, tp=8, pp=2, nodes=2),
            spec("c", gpu_classes=["a100-80g-mig-3g.40gb"], aliases=["c-small"]),
            spec(
                "d", gpu_classes=["cpu"], min_replicas=0, max_replicas=3, engine_args=["--x", "1"]
            ),
        ]
    )


def test_mig_class_refuses_every_field_above_one() -> None:
    lines = problems([spec("m", gpu_classes=["a100-80g-mig-3g.40gb"], gpus=4, tp=2, pp=2, nodes=2)])
    for name in ("tp", "pp", "gpus", "nodes"):
        assert any(
            line.startswith(
                f"model 'm': field '{name}': must be 1 on MIG class 'a100-80g-mig-3g.40gb'"
            )
            for line in lines
        ), name
    assert len(lines) == 4


def test_gpus_must_equal_tp_times_pp_and_divide_over_nodes() -> None:
    lines = problems([spec("x", gpus=4, tp=2, pp=1), spec("y", gpus=3, tp=3, nodes=2)])
    assert lines == [
        "model 'x': field 'gpus': must equal tp * pp = 2 * 1 = 2 (got 4)",
        "model 'y': field 'nodes': gpus (3) must divide evenly over nodes (2):"
        " every node of a replica holds the same number of devices",
    ]


def test_min_above_max_and_zero_max_are_refused() -> None:
    lines = problems(
        [spec("a", min_replicas=3, max_replicas=2), spec("b", min_replicas=0, max_replicas=0)]
    )
    assert lines == [
        "model 'a': field 'min_replicas': must not exceed max_replicas (3 > 2)",
        "model 'b': field 'max_replicas': must be at least 1, or the model can never serve",
    ]


def test_engine_args_and_env_are_checked() -> None:
    lines = problems(
        [spec("a", engine_args=["--ok", "bad\nline", "nul\x00"], env={"1BAD": "v", "OK": "x\x00"})]
    )
    assert "model 'a': field 'engine_args[1]': must not contain NUL or a line break" in lines
    assert "model 'a': field 'engine_args[2]': must not contain NUL or a line break" in lines
    assert any("field 'env.1BAD'" in line for line in lines)
    assert "model 'a': field 'env.OK': value must not contain NUL" in lines


def test_llamacpp_env_the_engine_reads_over_its_command_line_is_refused() -> None:
    # llama_cpp.server reads PORT (and every setting, in any case) from its
    # environment over the agent's flags; llama-server its LLAMA_ARG_*.
    env = {"PORT": "9", "n_ctx": "64", "LLAMA_ARG_HOST": "0.0.0.0", "OMP_NUM_THREADS": "2"}
    lines = problems([spec("a", engine="llamacpp", env=env)])
    assert len(lines) == 3, lines  # OMP_NUM_THREADS is a setting a catalog may give
    assert lines[0] == (
        "model 'a': field 'env.PORT': llama_cpp.server reads PORT as its port setting, over the"
        " agent's command line, and the agent manages --port; remove it"
    )
    assert "field 'env.n_ctx': llama_cpp.server reads n_ctx as its n_ctx setting" in lines[1]
    env = {"VERBOSE": "false"}  # a setting the agent leaves alone goes in engine_args
    assert problems([spec("c", engine="llamacpp", env=env)]) == [
        "model 'c': field 'env.VERBOSE': llama_cpp.server reads VERBOSE as its verbose setting,"
        " over the agent's command line; use --verbose in engine_args instead"
    ]
    assert lines[2] == (
        "model 'a': field 'env.LLAMA_ARG_HOST': llama-server reads LLAMA_ARG_HOST as --host,"
        " which the agent manages; remove it"
    )
    # Other engines do not read PORT, and it is not their setting either.
    refused = problems([spec("b", engine="vllm", env={"PORT": "9"})])
    assert "PORT is not a vllm setting" in refused[0]


@pytest.mark.parametrize(
    ("engine", "name"),
    [("vllm", "LD_PRELOAD"), ("vllm", "LD_LIBRARY_PATH"), ("sglang", "PYTHONPATH"),
     ("llamacpp", "PYTHONSTARTUP"), ("sim", "BASH_ENV"), ("vllm", "VLLM_SERVER_DEV_MODE"),
     ("vllm", "VLLM_PLUGINS"), ("vllm", "VLLM_NCCL_SO_PATH"), ("vllm", "VLLM_LOGGING_CONFIG_PATH"),
     ("vllm", "VLLM_ALLOW_INSECURE_SERIALIZATION"), ("vllm", "VLLM_HOST_IP"),
     ("sglang", "SGLANG_GRPC_PORT"), ("sglang", "SGLANG_HTTP_SERVER_APP_PATH"),
     ("sglang", "SGLANG_PLUGINS"), ("llamacpp", "LLAMA_ARG_API_KEY_FILE"),
     ("llamacpp", "LLAMA_ARG_LOG_FILE"), ("llamacpp", "LLAMA_CPP_LIB_PATH"),
     ("vllm", "SGLANG_USE_CPU_ENGINE")],
)  # fmt: skip
def test_the_catalog_cannot_run_code_on_a_node_through_env(engine: str, name: str) -> None:
    lines = problems([spec("a", engine=engine, env={name: "/tmp/evil.so"})])
    assert len(lines) == 1 and f"field 'env.{name}'" in lines[0], lines
    # A node's admin may allow a name on their node; the control plane then
    # accepts it, since that node's agent checks it again, and no other runs it.
    if name not in ("LLAMA_ARG_API_KEY_FILE",):  # what the agent manages stays refused
        validate_catalog([spec("a", engine=engine, env={name: "x"})], None, {name})


@pytest.mark.parametrize(
    ("engine", "name"),
    [("vllm", "VLLM_CPU_KVCACHE_SPACE"), ("vllm", "VLLM_LOGGING_LEVEL"), ("vllm", "HF_HUB_OFFLINE"),
     ("sglang", "SGLANG_ENABLE_TORCH_COMPILE"), ("llamacpp", "LLAMA_ARG_THREADS"),
     ("llamacpp", "GGML_SCHED_MAX_COPIES"), ("sim", "OMP_NUM_THREADS"), ("vllm", "HF_TOKEN")],
)  # fmt: skip
def test_an_engines_own_settings_pass(engine: str, name: str) -> None:
    validate_catalog([spec("a", engine=engine, env={name: "1"})], None)


def test_duplicate_names_and_aliases_within_the_file() -> None:
    lines = problems(
        [
            spec("a", aliases=["shared", "a"]),
            spec("b", aliases=["shared", "a"]),
            spec("a"),
        ]
    )
    assert "model 'a': field 'name': defined twice in this catalog (entries 1 and 3)" in lines
    assert "model 'a': field 'aliases': alias 'a' repeats its own name" in lines
    assert "model 'b': field 'aliases': alias 'shared' is also an alias of model 'a'" in lines
    assert "model 'b': field 'aliases': alias 'a' is already the name of model 'a'" in lines


def test_names_collide_with_the_existing_catalog_but_a_replaced_entry_does_not() -> None:
    existing = {"old": spec("old", aliases=["legacy"]), "kept": spec("kept", aliases=["k"])}
    # Re-applying "old" with its own alias is fine: it replaces itself.
    validate_catalog([spec("old", aliases=["legacy"])], existing)
    lines = problems([spec("new", aliases=["k", "kept"])], existing)
    assert lines == [
        "model 'new': field 'aliases': alias 'k' is already an alias of model 'kept'",
        "model 'new': field 'aliases': alias 'kept' is already the name of model 'kept'",
    ]


def test_every_problem_is_reported_at_once_with_the_first_field() -> None:
    with pytest.raises(ValidationError) as caught:
        validate_catalog(
            [spec("a", gpus=2), spec("b", gpu_classes=["h100-80g-mig-1g.10gb"], tp=2, gpus=2)]
        )
    assert caught.value.field == "gpus"
    assert len(str(caught.value).splitlines()) == 3


# -- diff ------------------------------------------------------------------------


def test_diff_reports_added_changed_and_unchanged() -> None:
    current = {"a": spec("a"), "b": spec("b")}
    diff = diff_catalog(current, [spec("a"), spec("b", max_replicas=3), spec("c")])
    assert diff.added == ["c"]
    assert diff.changed == ["b"]
    assert diff.unchanged == ["a"]
    assert diff.changed_fields == {"b": ["max_replicas"]}


def test_placement_changed_only_for_shape_fields() -> None:
    assert placement_changed(spec("a"), spec("a", gpus=2, tp=2))
    assert not placement_changed(spec("a"), spec("a", max_replicas=4))


async def test_the_admin_api_accepts_a_name_only_a_registered_node_allows(plane: Plane) -> None:
    entry = {"name": "m", "engine": "sim", "env": {"LD_LIBRARY_PATH": "/opt/driver/lib"}}
    async with httpx.AsyncClient(base_url=f"{plane.url}/admin/v1", headers=plane.admin) as admin:
        refused = await admin.put("/models/m", json=entry)
        assert refused.status_code == 422 and "engine-env-allow" in refused.text
        # A node whose admin allows it (llmgw agent --engine-env-allow) reports so.
        node = inventory("n1").model_copy(update={"engine_env_allow": ["LD_LIBRARY_PATH"]})
        async with httpx.AsyncClient() as client:
            token = await register(client, plane.url, plane.join, "n1")
            await report_ok(client, plane.url, token, AgentReport(node="n1", inventory=node))
        accepted = await admin.put("/models/m", json=entry)
        assert accepted.status_code == 200, accepted.text
