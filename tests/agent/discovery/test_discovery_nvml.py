"""NVML source against the fake: MIG modes, NOT_SUPPORTED answers, vanishing GPUs."""

from __future__ import annotations

from types import SimpleNamespace

import pynvml
import pytest
from tests.agent.discovery.smi_helpers import list_text, xml_bytes, xml_fixtures
from tests.agent.helpers import fake_migs

from llmgw.agent.discovery import LastSeen, discover, inventory_from
from llmgw.agent.discovery.base import SourceReading, SourceUnavailable
from llmgw.agent.discovery.fake import FakeGpu, FakeMig, FakeNvml, FakeProcess, fake_from_cards
from llmgw.agent.discovery.nvidia_smi import join
from llmgw.agent.discovery.nvml import (
    DRIVER_NOT_LOADED,
    GPU_IS_LOST,
    LIB_RM_VERSION_MISMATCH,
    NOT_FOUND,
    UNKNOWN,
    NvmlSource,
    profile_from_attributes,
)
from llmgw.agent.discovery.smi_list import parse_list
from llmgw.agent.discovery.smi_xml import parse_xml
from llmgw.errors import DiscoveryError
from llmgw.wire import NodeInventory

A100 = "NVIDIA A100-SXM4-80GB"


def a100(n: int = 0, *, mig: tuple[int, int] | None = None, instances: int = 0) -> FakeGpu:
    return FakeGpu(
        uuid=f"GPU-a100-{n}",
        name=A100,
        memory_total_mib=81920,
        mig_mode=mig,
        migs=fake_migs(n, instances, memory_used_mib=13),
        utilization_pct=55,
        temperature_c=33,
        power_mw=61_500,
    )


def read(
    fake: FakeNvml, source: NvmlSource | None = None, cache: LastSeen | None = None
) -> NodeInventory:
    snap = (source or NvmlSource(fake, cache=cache)).read()
    return inventory_from(snap, hostname="n1", cache=cache or LastSeen())


@pytest.mark.parametrize("count", [1, 7])
def test_mig_on_gives_instances(count: int) -> None:
    inv = read(FakeNvml([a100(mig=(1, 1), instances=count)]))
    assert [d.label for d in inv.devices] == [f"0/mig{i}" for i in range(count)]
    assert [d.number for d in inv.devices] == [1000 + i for i in range(count)]
    assert {d.gpu_class for d in inv.devices} == {"a100-80g-mig-1g.10gb"}
    for device in inv.devices:
        assert device.utilization_pct is None  # NOT_SUPPORTED on instances: omitted, not 0
        assert (device.temperature_c, device.power_w) == (33, 61.5)  # the card's
        assert device.memory_total_mib == 9984 and device.mig is not None
    assert inv.source == "nvml" and inv.cuda_version == "12.4"


def test_mig_on_with_no_instances_is_one_unplaceable_card() -> None:
    (card,) = read(FakeNvml([a100(mig=(1, 1))])).devices
    assert (card.label, card.gpu_class, card.placeable) == ("0", "a100-80g", False)
    assert (
        card.unplaceable_reason is not None and "no instances are carved" in card.unplaceable_reason
    )


@pytest.mark.parametrize(
    ("mode", "words"), [((0, 1), "disabled -> enabled"), ((1, 0), "enabled -> disabled")]
)
def test_mode_change_pending_reset_is_unplaceable(mode: tuple[int, int], words: str) -> None:
    devices = read(FakeNvml([a100(mig=mode, instances=2 if mode[0] else 0)])).devices
    # Enabling: the card, whole; disabling: its instances, until the reset.
    assert [d.label for d in devices] == (["0/mig0", "0/mig1"] if mode[0] else ["0"])
    for device in devices:
        assert device.placeable is False and (device.mig is None) == (not mode[0])
        assert device.unplaceable_reason is not None and words in device.unplaceable_reason


def test_sparse_mig_slots_are_skipped_and_instances_ordered_by_ids() -> None:
    gpu = a100(mig=(1, 1))
    gpu.migs = [
        FakeMig(uuid="MIG-b", profile="3g.40gb", gpu_instance_id=2, slot=5, memory_total_mib=40448),
        FakeMig(uuid="MIG-a", profile="4g.40gb", gpu_instance_id=1, slot=3, memory_total_mib=40448),
    ]
    inv = read(FakeNvml([a100(n=9), gpu]))
    assert [(d.label, d.uuid, d.gpu_class) for d in inv.devices] == [
        ("0", "GPU-a100-9", "a100-80g"),
        ("1/mig0", "MIG-a", "a100-80g-mig-4g.40gb"),
        ("1/mig1", "MIG-b", "a100-80g-mig-3g.40gb"),
    ]
    assert inv.devices[0].utilization_pct == 55


def test_instance_processes_are_their_own() -> None:
    gpu = a100(mig=(1, 1), instances=2)
    gpu.migs[1].processes = [FakeProcess(pid=42, used_mib=512, name="vllm")]
    inv = read(FakeNvml([gpu]))
    assert [[(p.pid, p.name, p.used_memory_mib) for p in d.processes] for d in inv.devices] == [
        [],
        [(42, "vllm", 512)],
    ]


def test_gpu_lost_between_reads_keeps_its_identity_and_turns_unhealthy() -> None:
    fake = FakeNvml([a100(0), a100(1)])
    cache = LastSeen()
    source = NvmlSource(fake, cache=cache)
    before = read(fake, source, cache)
    assert all(d.healthy for d in before.devices)
    fake.gpus[1].fail = {"*": GPU_IS_LOST}
    after = read(fake, source, cache)
    lost = after.devices[1]
    assert (lost.uuid, lost.gpu_class, lost.healthy) == ("GPU-a100-1", "a100-80g", False)
    assert "fallen off the bus" in lost.unhealthy_reasons[0]
    assert any("GPU 1" in w for w in after.warnings)
    assert after.devices[0].healthy


def test_gpu_lost_in_the_middle_of_a_read() -> None:
    gpu = a100(0)
    gpu.lost_after_calls = 4  # handle, uuid, name, memory... then gone
    (lost,) = read(FakeNvml([gpu])).devices
    assert lost.uuid == "GPU-a100-0" and not lost.healthy


def test_gpu_gone_before_its_handle_was_read() -> None:
    fake = FakeNvml([a100(0)])
    fake.gpus[0].fail = {"nvmlDeviceGetHandleByIndex": NOT_FOUND}
    (lost,) = read(fake).devices
    assert not lost.healthy and lost.uuid == "GPU-unknown-index-0"


def test_unknown_error_on_a_metric_marks_the_card() -> None:
    gpu = a100(0)
    gpu.fail = {"nvmlDeviceGetPowerUsage": UNKNOWN}
    (card,) = read(FakeNvml([gpu])).devices
    assert card.power_w is None and not card.healthy
    assert card.unhealthy_reasons == ["the driver reports unknown errors for this GPU"]


def test_health_from_nvml() -> None:
    gpu = a100(0)
    gpu.ecc_volatile_uncorrected = 3
    gpu.retired_pages_pending = True
    gpu.remapped_rows = (0, 1, 1, 1)
    (card,) = read(FakeNvml([gpu])).devices
    assert not card.healthy and len(card.unhealthy_reasons) == 4
    assert card.remapping_failed is True and card.retired_pages_pending is True


def test_remapped_rows_seen_before_mig_are_kept_under_mig() -> None:
    gpu = a100(0, mig=(0, 0))
    gpu.remapped_rows = (0, 0, 1, 0)  # a remap pending, seen while MIG was off
    fake = FakeNvml([gpu])
    cache = LastSeen()
    source = NvmlSource(fake, cache=cache)
    first = read(fake, source, cache)
    assert first.devices[0].remapped_rows_pending is True
    gpu.mig_mode = (1, 1)
    gpu.migs = [FakeMig(uuid="MIG-x", profile="7g.80gb", gpu_instance_id=0, memory_total_mib=80000)]
    (inst,) = read(fake, source, cache).devices
    assert inst.remapped_rows_pending is True and not inst.healthy  # NOT_SUPPORTED now, kept
    assert inst.utilization_pct is None


@pytest.mark.parametrize(
    ("code", "warns"), [(12, False), (DRIVER_NOT_LOADED, True), (LIB_RM_VERSION_MISMATCH, True)]
)
def test_nvml_absent(code: int, warns: bool) -> None:
    with pytest.raises(SourceUnavailable) as caught:
        NvmlSource(FakeNvml(init_error=code)).read()
    assert caught.value.warning is warns


class _NoCount(FakeNvml):
    def nvmlDeviceGetCount(self) -> int:
        raise pynvml.NVMLError(4)  # NO_PERMISSION


def test_device_count_failing_is_an_error() -> None:
    fake = _NoCount([a100(0)])
    with pytest.raises(DiscoveryError, match="device count"):
        NvmlSource(fake).read()
    assert not fake.initialised  # shut down even so


def test_profile_formula_rounds_half_up() -> None:
    attrs = SimpleNamespace(
        gpuInstanceSliceCount=3, computeInstanceSliceCount=3, memorySizeMB=71424
    )
    assert profile_from_attributes(attrs, 143771) == "3g.71gb"  # round() would say 70
    split = SimpleNamespace(
        gpuInstanceSliceCount=3, computeInstanceSliceCount=1, memorySizeMB=71424
    )
    assert profile_from_attributes(split, 143771) == "1c.3g.71gb"
    assert profile_from_attributes(SimpleNamespace(), 143771) is None


MIG_CAPTURES = [n for n in xml_fixtures() if "mig" in n or "unhealthy" in n]


@pytest.mark.parametrize("name", MIG_CAPTURES)
def test_both_sources_agree_on_the_same_capture(name: str) -> None:
    cards = join(parse_list(list_text(name)), parse_xml(xml_bytes(name)).cards)
    via_smi = inventory_from(
        SourceReading(source="nvidia-smi", cards=cards), hostname="n", cache=LastSeen()
    )
    cards = join(parse_list(list_text(name)), parse_xml(xml_bytes(name)).cards)
    via_nvml = read(fake_from_cards(cards))

    def shape(inv: NodeInventory) -> list[tuple[object, ...]]:
        return [
            (
                d.label,
                d.uuid,
                d.gpu_class,
                d.memory_total_mib,
                d.utilization_pct,
                d.placeable,
                [p.pid for p in d.processes],
            )
            for d in inv.devices
            if d.healthy  # a lost card reads differently through each tool
        ]

    assert shape(via_nvml) == shape(via_smi)
    sick = [(d.uuid, d.unhealthy_reasons) for d in via_smi.devices if not d.healthy]
    assert sick == [(d.uuid, d.unhealthy_reasons) for d in via_nvml.devices if not d.healthy]


def test_capture_without_a_pending_mode_is_no_change_pending_through_nvml() -> None:
    name = "synthetic-a100-80gb-mig-no-pending.xml"
    fake = fake_from_cards(join(parse_list(list_text(name)), parse_xml(xml_bytes(name)).cards))
    assert [g.mig_mode for g in fake.gpus] == [(1, 1), (1, 1)]
    *instances, empty = read(fake).devices
    assert [d.label for d in instances] == ["0/mig0", "0/mig1", "0/mig2", "0/mig3"]
    assert (empty.label, empty.gpu_class, empty.placeable) == ("1", "a100-80g", False)
    assert empty.unplaceable_reason is not None
    assert "no instances are carved" in empty.unplaceable_reason


def test_vanished_gpu_keeps_its_uuid_across_discover_calls() -> None:
    fake = FakeNvml([a100(0)])
    cache = LastSeen()
    assert discover(nvml=fake, nvidia_smi="/nonexistent", cache=cache).devices[0].healthy
    fake.gpus[0].fail = {"nvmlDeviceGetHandleByIndex": GPU_IS_LOST}
    (lost,) = discover(nvml=fake, nvidia_smi="/nonexistent", cache=cache).devices
    assert (lost.uuid, lost.healthy, lost.gpu_class) == ("GPU-a100-0", False, "a100-80g")


def test_instances_report_their_cards_ecc_counts() -> None:
    # Wear is the card's: every instance shows the card's counters, never its own zero.
    card = a100(mig=(1, 1), instances=3)
    card.ecc_aggregate_uncorrected = 2
    card.ecc_volatile_uncorrected = 0
    card.retired_pages_pending = False
    devices = read(FakeNvml([card])).devices
    assert [d.label for d in devices] == ["0/mig0", "0/mig1", "0/mig2"]
    assert [d.ecc_uncorrected for d in devices] == [2, 2, 2]
    assert {d.retired_pages_pending for d in devices} == {False}


def test_instances_in_an_nvidia_smi_capture_carry_the_cards_ecc_counts() -> None:
    name = "telegraf-a100-sxm4-80gb-mig-v12.xml"
    cards = join(parse_list(list_text(name)), parse_xml(xml_bytes(name)).cards)
    card_ecc = cards[0].health.ecc_aggregate_uncorrected
    via_smi = inventory_from(SourceReading(source="nvidia-smi", cards=cards), hostname="n",
                             cache=LastSeen())
    assert card_ecc is not None
    assert [d.ecc_uncorrected for d in via_smi.devices] == [card_ecc] * 4
