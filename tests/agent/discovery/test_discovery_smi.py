"""nvidia-smi source: real captures parse, MIG instances are joined and numbered."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.agent.discovery.smi_helpers import (
    FIXTURES,
    fixture_stand_in,
    list_text,
    stand_in,
    xml_bytes,
    xml_fixtures,
)

from llmgw.agent.discovery import LastSeen, inventory_from
from llmgw.agent.discovery.base import CardFacts, InstanceFacts, SourceReading, SourceUnavailable
from llmgw.agent.discovery.devices import NOTHING_CARVED, memory_totals
from llmgw.agent.discovery.nvidia_smi import NvidiaSmiSource, join
from llmgw.agent.discovery.smi_list import parse_list
from llmgw.agent.discovery.smi_xml import XmlCard, parse_xml
from llmgw.errors import DiscoveryError
from llmgw.wire import NodeInventory


def joined(xml_name: str) -> list[CardFacts]:
    return join(parse_list(list_text(xml_name)), parse_xml(xml_bytes(xml_name)).cards)


def inventory(xml_name: str, **kwargs: object) -> NodeInventory:
    log = parse_xml(xml_bytes(xml_name))
    snapshot = SourceReading(
        source="nvidia-smi",
        driver_version=log.driver_version,
        cuda_version=log.cuda_version,
        cards=joined(xml_name),
    )
    return inventory_from(snapshot, hostname="node-a", cache=LastSeen(), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", xml_fixtures())
def test_every_fixture_gives_a_valid_inventory(name: str) -> None:
    inv = inventory(name)
    assert inv.devices, name
    NodeInventory.model_validate_json(inv.model_dump_json())  # survives the wire
    for device in inv.devices:
        assert device.gpu_class and device.uuid.startswith(("GPU-", "MIG-"))
        if device.mig is not None:
            assert device.utilization_pct is None


def test_a100_80g_mig_capture_gives_its_four_instances() -> None:
    inv = inventory("telegraf-a100-sxm4-80gb-mig-v12.xml")
    assert [d.label for d in inv.devices] == ["0/mig0", "0/mig1", "0/mig2", "0/mig3"]
    assert [d.number for d in inv.devices] == [1000, 1001, 1002, 1003]
    assert {d.gpu_class for d in inv.devices} == {"a100-80g-mig-1g.20gb"}
    first = inv.devices[0]
    assert first.uuid == "MIG-0a1b2c3d-0000-5000-8000-000000000003"
    assert first.mig is not None
    assert first.mig.parent_uuid == "GPU-513536b6-7d19-9063-b049-1e69664bb298"
    assert (first.mig.gpu_instance_id, first.mig.compute_instance_id) == (3, 0)
    assert first.mig.profile == "1g.20gb"
    assert (first.memory_total_mib, first.memory_used_mib) == (19968, 12)
    # Heat and power are the card's; utilisation is omitted, not 0.
    assert (first.temperature_c, first.power_w, first.utilization_pct) == (27, 67.03, None)
    assert inv.driver_version == "535.54.03" and inv.cuda_version == "12.2"
    assert not any(d.gpu_class == "a100-80g" for d in inv.devices)  # never as a card


def test_a100_40g_mig_capture_on_an_older_schema() -> None:
    inv = inventory("netdata-a100-sxm4-40gb-mig-510-v11.xml")
    assert [(d.label, d.gpu_class) for d in inv.devices] == [
        ("0/mig0", "a100-40g-mig-3g.20gb"),
        ("0/mig1", "a100-40g-mig-3g.20gb"),
    ]
    assert [d.mig.gpu_instance_id for d in inv.devices if d.mig] == [1, 2]


def test_compute_instances_share_their_gpu_instance_memory_once() -> None:
    inv = inventory("synthetic-h200-mig-ci-split-processes.xml")
    by_label = {d.label: d for d in inv.devices}
    assert list(by_label) == ["0/mig0", "0/mig1", "0/mig2", "0/mig3", "0/mig4", "1"]
    assert by_label["0/mig0"].gpu_class == "h200-141g-mig-1c.3g.71gb"
    assert by_label["0/mig1"].gpu_class == "h200-141g-mig-2c.3g.71gb"
    assert by_label["1"].gpu_class == "h200-141g"
    # Each compute instance reports the pool it can use...
    assert by_label["0/mig0"].memory_total_mib == by_label["0/mig1"].memory_total_mib == 71424
    # ...and the node counts it once.
    totals = memory_totals(inv.devices)
    assert totals.total_mib == 71424 + 33280 + 2 * 16384 + 143771
    assert totals.used_mib == 16925 + 30012 + 2 * 13 + 2600


def test_mig_processes_go_to_the_instance_they_run_on() -> None:
    inv = inventory("synthetic-h200-mig-ci-split-processes.xml")
    pids = {d.label: [p.pid for p in d.processes] for d in inv.devices}
    assert pids == {
        "0/mig0": [],
        "0/mig1": [4242],
        "0/mig2": [5151],
        "0/mig3": [],
        "0/mig4": [],
        "1": [777],
    }
    whole = inv.devices[-1]
    assert whole.utilization_pct == 37 and whole.processes[0].used_memory_mib == 2048


def test_mig_enabled_with_nothing_carved_and_pending_change_stay_out_of_placement() -> None:
    inv = inventory("synthetic-a100-80gb-mig-empty-and-pending.xml")
    empty, pending = inv.devices
    assert (empty.label, empty.gpu_class, empty.placeable) == ("0", "a100-80g", False)
    assert empty.unplaceable_reason == NOTHING_CARVED
    assert empty.healthy  # not broken: just not usable yet
    assert pending.placeable is False
    assert pending.unplaceable_reason is not None and "pending" in pending.unplaceable_reason
    assert pending.utilization_pct is None


def test_mig_card_without_a_pending_mode_and_nothing_carved_stays_out_of_placement() -> None:
    # <pending_mig> absent (drivers and trimmed outputs omit it): no change pending.
    inv = inventory("synthetic-a100-80gb-mig-no-pending.xml")
    *instances, empty = inv.devices
    assert [d.label for d in instances] == ["0/mig0", "0/mig1", "0/mig2", "0/mig3"]
    assert all(d.placeable for d in instances)
    assert (empty.label, empty.gpu_class, empty.placeable) == ("1", "a100-80g", False)
    assert empty.unplaceable_reason == NOTHING_CARVED
    assert empty.healthy and empty.utilization_pct is None


def test_health_signals_from_xml() -> None:
    inv = inventory("synthetic-h100-unhealthy.xml")
    lost, ecc, failed, ok = inv.devices
    assert not lost.healthy and "fallen off the bus" in lost.unhealthy_reasons[0]
    assert not ecc.healthy
    assert any("2 uncorrectable ECC" in r for r in ecc.unhealthy_reasons)
    assert any("row remapping pending" in r for r in ecc.unhealthy_reasons)
    assert ecc.ecc_uncorrected == 2 and ecc.remapped_rows_pending is True
    assert not failed.healthy and failed.remapping_failed is True
    assert ok.healthy and ok.unhealthy_reasons == [] and ok.utilization_pct == 3


def test_retired_pages_and_correctable_errors_on_pascal_are_wear_not_sickness() -> None:
    (p100,) = inventory("netdata-tesla-p100-510-v11-retiredpages.xml").devices
    assert p100.gpu_class == "p100-16g" and p100.healthy
    assert p100.retired_pages_pending is False and p100.ecc_uncorrected == 0


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("telegraf-gtx1660ti-418-old.xml", "graphics-device-6g"),
        ("telegraf-gtx1070ti-v10-old.xml", "gtx1070ti-4g"),
        ("telegraf-tesla-t4-v11-processes.xml", "t4-16g"),
        ("telegraf-a10g-v11-processes.xml", "a10g-24g"),
        ("netdata-rtx4090-535-v12.xml", "rtx4090-24g"),
        ("telegraf-rtx4000-sff-ada-v13-processes.xml", "rtx4000-sff-ada-20g"),
        ("netdata-rtx-pro-6000-blackwell-580-trimmed.xml", "rtx-pro6000-blackwell"),
    ],
)
def test_whole_cards_from_every_schema_generation(name: str, cls: str) -> None:
    (card,) = inventory(name).devices
    assert (card.label, card.number, card.gpu_class, card.mig) == ("0", 0, cls, None)
    assert card.placeable and card.healthy


def test_oldest_driver_without_mig_elements() -> None:
    log = parse_xml(xml_bytes("telegraf-gtx1660ti-418-old.xml"))
    card = log.cards[0].facts
    assert (card.mig_current, card.mig_pending, log.cards[0].migs) == (None, None, [])
    assert log.driver_version == "418.43" and card.memory_total_mib == 5912


def test_padded_values_and_newest_power_fields() -> None:
    card = parse_xml(xml_bytes("netdata-rtx-pro-6000-blackwell-580-trimmed.xml")).cards[0].facts
    assert card.temperature_c == 37 and card.power_w == 66.84
    v13 = parse_xml(xml_bytes("telegraf-rtx4000-sff-ada-v13-processes.xml")).cards[0].facts
    assert v13.power_w is not None and len(v13.processes) == 4


def test_windows_processes_without_memory_figures() -> None:
    card = parse_xml(xml_bytes("netdata-rtx2080-windows-516-v11-processes.xml")).cards[0].facts
    assert len(card.processes) == 26 and {p.used_memory_mib for p in card.processes} == {0}


# -- nvidia-smi -L --------------------------------------------------------------


def test_legacy_list_format_carries_instance_ids() -> None:
    (gpu,) = parse_list(
        (FIXTURES / "cloud-native-docs-a100-40gb-mig-legacy-uuid-L.txt").read_text()
    )
    assert gpu.name == "A100-SXM4-40GB"
    assert [m.profile for m in gpu.migs] == ["1g.5gb"] * 7
    assert [m.legacy_ids for m in gpu.migs][:4] == [(7, 0), (8, 0), (9, 0), (11, 0)]
    assert gpu.migs[0].uuid == "MIG-GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f/7/0"


def test_legacy_list_joins_by_instance_ids_not_position() -> None:
    (gpu,) = parse_list(
        (FIXTURES / "cloud-native-docs-a100-40gb-mig-legacy-uuid-L.txt").read_text()
    )
    xml = XmlCard(
        facts=CardFacts(index=0, uuid=gpu.uuid, name=gpu.name, mig_current=True, mig_pending=True),
        migs=[],
    )
    # The XML lists them in another order: ids, not positions, must decide.
    for gi in (14, 13, 12, 11, 9, 8, 7):
        xml.migs.append(
            InstanceFacts(
                uuid="", profile="", gpu_instance_id=gi, compute_instance_id=0, memory_total_mib=gi
            )
        )
    (card,) = join([gpu], [xml])
    assert [(i.uuid.rsplit("/", 2)[1], i.memory_total_mib) for i in card.instances][:2] == [
        ("7", 7),
        ("8", 8),
    ]


def test_list_inside_a_job_renumbers_devices() -> None:
    (gpu,) = parse_list((FIXTURES / "deepops-dgx-a100-80gb-mig-L-inside-slurm-job.txt").read_text())
    assert [(m.profile, m.uuid) for m in gpu.migs] == [
        ("1g.10gb", "MIG-3fff3a97-95a9-5046-9053-4c0da3d1add7")
    ]


@pytest.mark.parametrize(
    "name",
    [
        "nvidia_gpu_exporter-nvidia-h100-80gb-hbm3__590.48.01-L.txt",
        "nvidia_gpu_exporter-nvidia-l40s__595.80-L.txt",
    ],
)
def test_plain_lists(name: str) -> None:
    (gpu,) = parse_list((FIXTURES / name).read_text())
    assert gpu.index == 0 and gpu.migs == [] and gpu.name.startswith("NVIDIA ")


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("garbage\n", "not understood"),
        ("  MIG 1g.10gb Device 0: (UUID: MIG-abc)\n", "before any GPU"),
        ("GPU 0: X (UUID: GPU-1)\n  MIG lots Device 0: (UUID: MIG-abc)\n", "not a MIG profile"),
        ("GPU 0: X (UUID: GPU-1)\nGPU 0: Y (UUID: GPU-2)\n", "twice"),
        (
            "GPU 0: X (UUID: GPU-1)\n  MIG 1g.5gb Device 0: (UUID: MIG-GPU-2/7/0)\n",
            "not its own card",
        ),
    ],
)
def test_bad_lists_are_refused_with_the_reason(text: str, why: str) -> None:
    with pytest.raises(DiscoveryError, match=why):
        parse_list(text)


# -- joining --------------------------------------------------------------------


def test_list_and_xml_that_disagree_are_an_error_not_a_guess() -> None:
    xml = parse_xml(xml_bytes("telegraf-a100-sxm4-80gb-mig-v12.xml")).cards
    listing = parse_list(list_text("telegraf-a100-sxm4-80gb-mig-v12.xml"))
    listing[0].migs.pop()
    with pytest.raises(DiscoveryError, match="lists 3 MIG devices but -q -x lists 4"):
        join(listing, xml)
    del listing[0].migs[1:]
    with pytest.raises(DiscoveryError, match="lists 1 MIG device but -q -x lists 4"):
        join(listing, xml)
    other = parse_list("GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-00000000-1111)\n")
    with pytest.raises(DiscoveryError, match="UUIDs differ"):
        join(other, xml)


def test_mig_lines_for_a_card_the_xml_says_is_not_in_mig_mode() -> None:
    xml = parse_xml(xml_bytes("telegraf-tesla-t4-v11-processes.xml")).cards
    text = list_text("telegraf-tesla-t4-v11-processes.xml")
    text += "  MIG 1g.5gb     Device  0: (UUID: MIG-11111111-2222-3333-4444-555555555555)\n"
    with pytest.raises(DiscoveryError, match="MIG is off"):
        join(parse_list(text), xml)


def test_list_index_numbers_the_cards() -> None:
    xml = parse_xml(xml_bytes("telegraf-tesla-t4-v11-processes.xml")).cards
    text = list_text("telegraf-tesla-t4-v11-processes.xml").replace("GPU 0:", "GPU 3:")
    (card,) = join(parse_list(text), xml)
    assert card.index == 3


# -- running the executable -------------------------------------------------------


def test_source_runs_the_stand_in(tmp_path: Path) -> None:
    exe = fixture_stand_in(tmp_path, "synthetic-h200-mig-ci-split-processes.xml")
    snap = NvidiaSmiSource(str(exe)).read()
    assert snap.source == "nvidia-smi" and snap.driver_version == "550.90.07"
    assert [len(c.instances) for c in snap.cards] == [5, 0]


def test_executable_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exe = fixture_stand_in(tmp_path, "telegraf-tesla-t4-v11-processes.xml")
    monkeypatch.setenv("LLMGW_NVIDIA_SMI", str(exe))
    assert NvidiaSmiSource().read().cards[0].name == "Tesla T4"


def test_missing_executable_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(SourceUnavailable) as caught:
        NvidiaSmiSource(str(tmp_path / "nope")).read()
    assert caught.value.warning  # chosen explicitly, so worth saying


def test_driver_not_loaded_is_unavailable_with_a_warning(tmp_path: Path) -> None:
    said = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
    exe = stand_in(tmp_path, listing=said, xml=said.encode(), list_rc=9, xml_rc=9)
    with pytest.raises(SourceUnavailable, match="exit 9: NVIDIA-SMI has failed"):
        NvidiaSmiSource(str(exe)).read()


def test_other_exit_codes_are_errors(tmp_path: Path) -> None:
    exe = stand_in(tmp_path, listing="", xml=b"", list_rc=15, xml_rc=15, stderr="GPU is lost")
    with pytest.raises(DiscoveryError, match="exit 15: GPU is lost"):
        NvidiaSmiSource(str(exe)).read()


def test_a_hung_nvidia_smi_times_out(tmp_path: Path) -> None:
    exe = stand_in(tmp_path, listing="", xml=b"", sleep_s=5)
    with pytest.raises(DiscoveryError, match=r"did not answer within 0\.5 s"):
        NvidiaSmiSource(str(exe), timeout_s=0.5).read()


def test_failed_list_is_a_warning_for_whole_cards(tmp_path: Path) -> None:
    exe = stand_in(
        tmp_path, listing="", xml=xml_bytes("telegraf-tesla-t4-v11-processes.xml"), list_rc=3
    )
    snap = NvidiaSmiSource(str(exe)).read()
    assert snap.cards[0].name == "Tesla T4" and snap.warnings == ["nvidia-smi -L: exit 3"]


def test_failed_list_is_an_error_when_instances_need_names(tmp_path: Path) -> None:
    exe = stand_in(
        tmp_path, listing="", xml=xml_bytes("telegraf-a100-sxm4-80gb-mig-v12.xml"), list_rc=3
    )
    with pytest.raises(DiscoveryError, match=r"-L, which names them, failed"):
        NvidiaSmiSource(str(exe)).read()
