"""The environment that pins an engine to its devices."""

from __future__ import annotations

import pytest

from llmgw.agent.discovery import cpu_devices
from llmgw.agent.discovery.pinning import engine_env
from llmgw.errors import EngineError
from llmgw.wire import Device, MigInfo


def card(n: int) -> Device:
    return Device(number=n, label=str(n), uuid=f"GPU-{n}", name="NVIDIA L40S", gpu_class="l40s-48g")


def instance(card_index: int = 0, n: int = 1) -> Device:
    return Device(
        number=1000 + 100 * card_index + n,
        label=f"{card_index}/mig{n}",
        uuid=f"MIG-{card_index}-{n}",
        name="NVIDIA A100-SXM4-80GB MIG 3g.40gb",
        gpu_class="a100-80g-mig-3g.40gb",
        mig=MigInfo(
            parent_uuid=f"GPU-{card_index}",
            parent_index=card_index,
            gpu_instance_id=1,
            compute_instance_id=0,
            profile="3g.40gb",
        ),
    )


def test_whole_cards_by_uuid_in_pci_order() -> None:
    assert engine_env([card(2), card(3)], vulkan=False) == {
        "CUDA_VISIBLE_DEVICES": "GPU-2,GPU-3",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }


def test_vulkan_engine_on_whole_cards_gets_indices() -> None:
    env = engine_env([card(2), card(3)], vulkan=True)
    assert env["GGML_VK_VISIBLE_DEVICES"] == "2,3"
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-2,GPU-3"


def test_vulkan_order_maps_by_uuid_when_given() -> None:
    env = engine_env([card(2)], vulkan=True, vulkan_order=["GPU-2", "GPU-0"])
    assert env["GGML_VK_VISIBLE_DEVICES"] == "0"
    with pytest.raises(EngineError, match="Vulkan does not list GPU-3"):
        engine_env([card(3)], vulkan=True, vulkan_order=["GPU-2"])


def test_mig_instance_by_mig_uuid_and_no_vulkan_variable() -> None:
    env = engine_env([instance()], vulkan=False)
    assert env["CUDA_VISIBLE_DEVICES"] == "MIG-0-1"
    assert not any(key.startswith("GGML_VK") for key in env)


def test_vulkan_engine_on_a_mig_instance_is_refused() -> None:
    with pytest.raises(EngineError, match="Vulkan cannot see"):
        engine_env([instance()], vulkan=True)


def test_more_than_one_mig_instance_is_refused() -> None:
    with pytest.raises(EngineError, match="only device"):
        engine_env([instance(0, 0), instance(0, 1)], vulkan=False)
    with pytest.raises(EngineError, match="only device"):
        engine_env([instance(), card(1)], vulkan=False)


def test_cpu_slots_hide_the_gpus() -> None:
    slots = cpu_devices(2, "host")
    assert engine_env(slots[:1], vulkan=False) == {"CUDA_VISIBLE_DEVICES": ""}
    # A Vulkan build reads no CUDA variable: an empty Vulkan list hides the GPUs from it.
    assert engine_env([], vulkan=True) == {
        "CUDA_VISIBLE_DEVICES": "",
        "GGML_VK_VISIBLE_DEVICES": "",
    }
    with pytest.raises(EngineError, match="CPU slots and GPUs"):
        engine_env([slots[0], card(0)], vulkan=False)


def test_the_same_card_twice_is_refused() -> None:
    with pytest.raises(EngineError, match="twice"):
        engine_env([card(1), card(1)], vulkan=False)
