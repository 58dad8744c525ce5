"""discover(): NVML first, nvidia-smi next, CPU slots when neither exists."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.agent.discovery.smi_helpers import fixture_stand_in, stand_in

from llmgw.agent.discovery import LastSeen, discover
from llmgw.agent.discovery.classes import card_class, memory_gb, resolve_card_class
from llmgw.agent.discovery.fake import FakeGpu, FakeNvml
from llmgw.errors import ConfigError, DiscoveryError


def test_cpu_only_node_without_nvml_or_nvidia_smi(tmp_path: Path) -> None:
    inv = discover(
        cpu_slots=3, nvml=FakeNvml.absent(), nvidia_smi=str(tmp_path / "none"), hostname="box"
    )
    assert inv.source == "none"
    assert [(d.number, d.label, d.uuid, d.gpu_class, d.name) for d in inv.devices] == [
        (0, "cpu0", "CPU-box-0", "cpu", "cpu"),
        (1, "cpu1", "CPU-box-1", "cpu", "cpu"),
        (2, "cpu2", "CPU-box-2", "cpu", "cpu"),
    ]
    # The explicitly named executable is missing: worth a line, not an error.
    assert inv.warnings == [f"nvidia-smi: {tmp_path / 'none'} not found"]


def test_cpu_slot_ids_are_stable_across_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGW_NVIDIA_SMI", "/nonexistent/nvidia-smi")
    first = discover(nvml=FakeNvml.absent())
    again = discover(nvml=FakeNvml.absent())
    assert [d.uuid for d in first.devices] == [d.uuid for d in again.devices]
    assert len(first.devices) == 1 and first.hostname


def test_default_nvidia_smi_missing_is_silent(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("LLMGW_NVIDIA_SMI", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    inv = discover(nvml=FakeNvml.absent())
    assert inv.source == "none" and inv.warnings == []


def test_negative_cpu_slots_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="cpu_slots"):
        discover(cpu_slots=-1, nvml=FakeNvml.absent(), nvidia_smi="/nonexistent")


def test_nvml_wins_when_it_answers(tmp_path: Path) -> None:
    exe = fixture_stand_in(tmp_path, "telegraf-tesla-t4-v11-processes.xml")
    fake = FakeNvml([FakeGpu(uuid="GPU-x", name="NVIDIA L4", memory_total_mib=23034)])
    inv = discover(nvml=fake, nvidia_smi=str(exe), cache=LastSeen())
    assert inv.source == "nvml" and [d.gpu_class for d in inv.devices] == ["l4-24g"]


def test_nvidia_smi_when_nvml_is_unavailable(tmp_path: Path) -> None:
    exe = fixture_stand_in(tmp_path, "telegraf-a100-sxm4-80gb-mig-v12.xml")
    inv = discover(nvml=FakeNvml.absent(), nvidia_smi=str(exe), cache=LastSeen())
    assert inv.source == "nvidia-smi" and len(inv.devices) == 4
    assert inv.warnings == []


def test_nvml_driver_trouble_is_reported_while_nvidia_smi_answers(tmp_path: Path) -> None:
    exe = fixture_stand_in(tmp_path, "telegraf-tesla-t4-v11-processes.xml")
    inv = discover(nvml=FakeNvml(init_error=18), nvidia_smi=str(exe), cache=LastSeen())
    assert inv.source == "nvidia-smi"
    assert inv.warnings == ["nvml: NVML and driver versions differ (reboot after a driver upgrade)"]


def test_malformed_output_is_a_discovery_error(tmp_path: Path) -> None:
    exe = stand_in(tmp_path, listing="GPU 0: X (UUID: GPU-1)\n", xml=b"<nvidia_smi_log><gpu>")
    with pytest.raises(DiscoveryError, match="not well-formed"):
        discover(nvml=FakeNvml.absent(), nvidia_smi=str(exe))


def test_driver_not_loaded_gives_a_cpu_node_with_the_warning(tmp_path: Path) -> None:
    said = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
    exe = stand_in(tmp_path, listing=said, xml=said.encode(), list_rc=9, xml_rc=9)
    inv = discover(nvml=FakeNvml(init_error=9), nvidia_smi=str(exe), cpu_slots=2)
    assert [d.label for d in inv.devices] == ["cpu0", "cpu1"]
    assert inv.warnings == [
        "nvml: NVIDIA driver not loaded",
        f"nvidia-smi: nvidia-smi -L: exit 9: {said}",
    ]


def test_driver_without_gpus_is_a_cpu_node() -> None:
    inv = discover(nvml=FakeNvml([]), nvidia_smi="/nonexistent", cpu_slots=1)
    assert inv.source == "nvml" and [d.gpu_class for d in inv.devices] == ["cpu"]


# -- classes ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "mib", "cls"),
    [
        ("NVIDIA A100-SXM4-80GB", 81920, "a100-80g"),
        ("A100-SXM4-40GB", 40960, "a100-40g"),
        ("NVIDIA H100 80GB HBM3", 81559, "h100-80g"),
        ("NVIDIA H100 NVL", 95830, "h100-94g"),
        ("NVIDIA H200", 143771, "h200-141g"),
        ("NVIDIA L40S", 46068, "l40s-48g"),
        ("NVIDIA L4", 23034, "l4-24g"),
        ("NVIDIA GeForce RTX 4090", 24564, "rtx4090-24g"),
        ("NVIDIA B200", 183359, "b200-180g"),
        ("Tesla P100-PCIE-16GB", 16384, "p100-16g"),
        ("Mystery Card", 27000, "mystery-card-26g"),  # no sold size near: its own memory
        ("", 0, "gpu"),
    ],
)
def test_class_rule(name: str, mib: int, cls: str) -> None:
    assert card_class(name, mib) == cls


def test_memory_rounding_is_half_up() -> None:
    assert memory_gb(int(70.5 * 1024)) == 71 and memory_gb(1) == 1


def test_overrides_by_uuid_then_name_then_class() -> None:
    overrides = {"GPU-1": "special", "nvidia l40s": "l40s-lab", "a100-80g": "a100"}
    args = {"memory_total_mib": 46068}
    assert (
        resolve_card_class(uuid="GPU-1", name="NVIDIA L40S", overrides=overrides, **args)
        == "special"
    )
    assert (
        resolve_card_class(uuid="GPU-2", name="NVIDIA L40S", overrides=overrides, **args)
        == "l40s-lab"
    )
    assert (
        resolve_card_class(
            uuid="GPU-3", name="NVIDIA A100-SXM4-80GB", memory_total_mib=81920, overrides=overrides
        )
        == "a100"
    )


def test_overrides_reach_mig_instances(tmp_path: Path) -> None:
    exe = fixture_stand_in(tmp_path, "telegraf-a100-sxm4-80gb-mig-v12.xml")
    inv = discover(
        nvml=FakeNvml.absent(),
        nvidia_smi=str(exe),
        class_overrides={"a100-80g": "a100x"},
        cache=LastSeen(),
    )
    assert {d.gpu_class for d in inv.devices} == {"a100x-mig-1g.20gb"}
