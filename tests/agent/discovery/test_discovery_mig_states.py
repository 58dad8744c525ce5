"""MIG states both sources must report alike, from the real A100 MIG capture edited into them.

The telegraf A100-SXM4-80GB capture (4x 1g.20gb) is changed the way the
driver changes its answer: MIG disabling pending a reset, nothing carved
with a process on the card, instance memory under driver 590's name. The
nvidia-smi path reads the edited XML; NVML reads a fake fed from the same
parse (fake_from_cards), as on a node where both tools answer.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from tests.agent.discovery.smi_helpers import list_text, stand_in, xml_bytes

from llmgw.agent.discovery import LastSeen, inventory_from
from llmgw.agent.discovery.base import SourceReading
from llmgw.agent.discovery.fake import fake_from_cards
from llmgw.agent.discovery.nvidia_smi import NvidiaSmiSource, join
from llmgw.agent.discovery.nvml import NvmlSource
from llmgw.agent.discovery.smi_list import parse_list
from llmgw.agent.discovery.smi_xml import parse_xml
from llmgw.wire import Device, NodeInventory

CAPTURE = "telegraf-a100-sxm4-80gb-mig-v12.xml"


def edited(change: object) -> ET.Element:
    root = ET.fromstring(xml_bytes(CAPTURE))
    change(root.find("gpu"))  # type: ignore[operator]
    return root


def add_process(gpu: ET.Element, pid: int, gi: str, ci: str) -> None:
    """A <process_info> as nvidia-smi lists it on the parent card (ids N/A on a whole card)."""
    processes = gpu.find("processes")
    assert processes is not None
    info = ET.SubElement(processes, "process_info")
    for tag, text in (("gpu_instance_id", gi), ("compute_instance_id", ci), ("pid", str(pid)),
                      ("type", "C"), ("process_name", "python3 -m vllm"),
                      ("used_memory", "9000 MiB")):
        ET.SubElement(info, tag).text = text


def whole_card_listing(root: ET.Element) -> str:
    gpu = root.find("gpu")
    assert gpu is not None
    return f"GPU 0: {gpu.findtext('product_name')} (UUID: {gpu.findtext('uuid')})\n"


def both(root: ET.Element, listing: str) -> tuple[NodeInventory, NodeInventory]:
    """The inventory through nvidia-smi and through NVML."""
    data = ET.tostring(root)
    via_smi = inventory_from(
        SourceReading(source="nvidia-smi", cards=join(parse_list(listing),
                                                      parse_xml(data).cards)),
        hostname="n", cache=LastSeen())
    fake = fake_from_cards(join(parse_list(listing), parse_xml(data).cards))
    via_nvml = inventory_from(NvmlSource(fake).read(), hostname="n", cache=LastSeen())
    return via_smi, via_nvml


def shape(devices: list[Device]) -> list[tuple[object, ...]]:
    return [(d.label, d.uuid, d.placeable, d.memory_total_mib, [p.pid for p in d.processes])
            for d in devices]


def test_a_mig_mode_card_shown_whole_lists_its_processes_on_both_paths() -> None:
    def nothing_carved(gpu: ET.Element) -> None:
        migs = gpu.find("mig_devices")
        assert migs is not None
        migs.clear()
        migs.text = "None"
        add_process(gpu, 4242, "N/A", "N/A")

    via_smi, via_nvml = both(edited(nothing_carved), whole_card_listing(edited(nothing_carved)))
    (card,) = via_smi.devices
    assert (card.label, card.placeable, [p.pid for p in card.processes]) == ("0", False, [4242])
    assert shape(via_nvml.devices) == shape(via_smi.devices)


def test_mig_disabling_pending_keeps_the_instances_until_the_reset() -> None:
    def disabling(gpu: ET.Element) -> None:
        pending = gpu.find("mig_mode/pending_mig")
        assert pending is not None
        pending.text = "Disabled"
        add_process(gpu, 5151, "3", "0")  # a replica on the first instance

    before = both(edited(lambda gpu: None), list_text(CAPTURE))[0]
    for inventory in both(edited(disabling), list_text(CAPTURE)):
        # The same devices as before the change was asked for: a replica on
        # one keeps the device (number and MIG UUID) it was placed on.
        assert [(d.number, d.uuid) for d in inventory.devices] == [
            (d.number, d.uuid) for d in before.devices]
        assert [d.label for d in inventory.devices] == ["0/mig0", "0/mig1", "0/mig2", "0/mig3"]
        assert [[p.pid for p in d.processes] for d in inventory.devices] == [[5151], [], [], []]
        # Nothing new goes there: they vanish at the reset.
        for device in inventory.devices:
            assert device.placeable is False and device.healthy
            assert device.unplaceable_reason is not None
            assert "enabled -> disabled" in device.unplaceable_reason
    via_smi, via_nvml = both(edited(disabling), list_text(CAPTURE))
    assert shape(via_nvml.devices) == shape(via_smi.devices)


def _rename_instance_memory(name: str | None) -> object:
    def change(gpu: ET.Element) -> None:
        for mig in gpu.iterfind("mig_devices/mig_device"):
            memory = mig.find("fb_memory_usage")
            assert memory is not None
            if name is None:
                mig.remove(memory)
            else:
                memory.tag = name
    return change


def test_instance_memory_is_read_under_driver_590s_shared_name() -> None:
    root = edited(_rename_instance_memory("shared_fb_memory_usage"))
    log = parse_xml(ET.tostring(root))
    assert [(m.memory_total_mib, m.memory_used_mib) for m in log.cards[0].migs] == [
        (19968, 12)] * 4
    assert log.warnings == []


def test_instance_memory_under_neither_name_is_a_warning(tmp_path: Path) -> None:
    root = edited(_rename_instance_memory(None))
    smi = stand_in(tmp_path, listing=list_text(CAPTURE), xml=ET.tostring(root))
    inventory = inventory_from(NvidiaSmiSource(str(smi)).read(), hostname="n", cache=LastSeen())
    assert [d.memory_total_mib for d in inventory.devices] == [0] * 4
    missing = [w for w in inventory.warnings if "shared_fb_memory_usage" in w]
    assert len(missing) == 4 and "MIG device 3/0" in missing[0], inventory.warnings
