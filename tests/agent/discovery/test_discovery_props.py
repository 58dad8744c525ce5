"""Property tests: any nvidia-smi output gives a valid inventory or a DiscoveryError.

Never another exception, and never a half-filled inventory: whatever comes
out must survive the wire model's own validation.
"""

from __future__ import annotations

import contextlib
import xml.etree.ElementTree as ET

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.agent.discovery.smi_helpers import list_text, xml_bytes, xml_fixtures

from llmgw.agent.discovery import LastSeen, inventory_from
from llmgw.agent.discovery.base import SourceReading
from llmgw.agent.discovery.nvidia_smi import join
from llmgw.agent.discovery.smi_list import parse_list
from llmgw.agent.discovery.smi_xml import parse_xml
from llmgw.errors import DiscoveryError
from llmgw.wire import NodeInventory

FIXTURES = xml_fixtures()
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def pipeline(listing: str, xml: bytes) -> NodeInventory | None:
    """The whole nvidia-smi path; None when it refused the input with DiscoveryError."""
    try:
        log = parse_xml(xml)
        cards = join(parse_list(listing), log.cards)
        snap = SourceReading(source="nvidia-smi", driver_version=log.driver_version, cards=cards)
        inv = inventory_from(snap, hostname="h", cache=LastSeen())
    except DiscoveryError as exc:
        assert str(exc)  # a message a person can read
        return None
    # Complete and valid, or not at all.
    again = NodeInventory.model_validate_json(inv.model_dump_json())
    assert again.devices
    for device in again.devices:
        assert device.gpu_class and device.uuid
        if device.mig is not None:
            assert device.utilization_pct is None and device.number >= 1000
    return inv


@SETTINGS
@given(name=st.sampled_from(FIXTURES), cut=st.floats(0.0, 1.0))
def test_truncated_xml(name: str, cut: float) -> None:
    data = xml_bytes(name)
    pipeline(list_text(name), data[: int(len(data) * cut)])


@SETTINGS
@given(
    name=st.sampled_from(FIXTURES),
    edits=st.lists(st.tuples(st.floats(0.0, 1.0), st.binary(max_size=8)), min_size=1, max_size=6),
)
def test_mutated_xml(name: str, edits: list[tuple[float, bytes]]) -> None:
    data = bytearray(xml_bytes(name))
    for where, junk in edits:
        at = int(len(data) * where)
        data[at : at + len(junk)] = junk
    pipeline(list_text(name), bytes(data))


VALUES = st.one_of(
    st.sampled_from(
        [
            "N/A",
            "Enabled",
            "Disabled",
            "Yes",
            "No",
            "GPU is lost",
            "Unknown Error",
            "19968 MiB",
            " 37 C ",
            "-5",
            "99999999999999999999",
            "0",
            "3",
            "None",
            "",
        ]
    ),
    st.text(max_size=12),
)
TAGS = st.sampled_from(
    [
        "uuid",
        "product_name",
        "mig_mode",
        "current_mig",
        "pending_mig",
        "mig_devices",
        "mig_device",
        "gpu_instance_id",
        "compute_instance_id",
        "fb_memory_usage",
        "total",
        "used",
        "processes",
        "process_info",
        "pid",
        "used_memory",
        "utilization",
        "gpu_util",
        "temperature",
        "gpu_temp",
        "remapped_rows",
        "remapped_row_pending",
        "ecc_errors",
        "volatile",
        "dram_uncorrectable",
        "index",
    ]
)


def _elements(depth: int) -> st.SearchStrategy[ET.Element]:
    def build(tag: str, text: str, children: list[ET.Element]) -> ET.Element:
        el = ET.Element(tag)
        el.text = text
        el.extend(children)
        return el

    kids = st.lists(_elements(depth - 1), max_size=4) if depth > 0 else st.just([])
    return st.builds(build, TAGS, VALUES, kids)


@st.composite
def random_logs(draw: st.DrawFn) -> tuple[str, bytes]:
    root = ET.Element("nvidia_smi_log")
    lines = []
    for n in range(draw(st.integers(0, 3))):
        gpu = ET.SubElement(root, "gpu")
        uuid = draw(st.sampled_from([f"GPU-{n}aa-{n}", "GPU-0", "bogus", ""]))
        ET.SubElement(gpu, "uuid").text = uuid
        gpu.extend(draw(st.lists(_elements(2), max_size=5)))
        lines.append(f"GPU {n}: Card {n} (UUID: {uuid})")
        for m in range(draw(st.integers(0, 3))):
            profile = draw(st.sampled_from(["1g.10gb", "1c.3g.71gb", "7g.80gb+me", "x"]))
            lines.append(f"  MIG {profile}  Device {m}: (UUID: MIG-{n}-{m})")
    return "\n".join(lines), ET.tostring(root)


@SETTINGS
@given(log=random_logs())
def test_random_structured_xml(log: tuple[str, bytes]) -> None:
    pipeline(*log)


@SETTINGS
@given(text=st.text(max_size=300))
def test_random_list_text(text: str) -> None:
    with contextlib.suppress(DiscoveryError):
        parse_list(text)


@SETTINGS
@given(name=st.sampled_from(FIXTURES), cut=st.floats(0.0, 1.0), junk=st.text(max_size=20))
def test_mutated_list_text(name: str, cut: float, junk: str) -> None:
    text = list_text(name)
    at = int(len(text) * cut)
    pipeline(text[:at] + junk + text[at + len(junk) :], xml_bytes(name))


@SETTINGS
@given(data=st.binary(max_size=400))
def test_random_bytes_as_xml(data: bytes) -> None:
    pipeline("", data)
