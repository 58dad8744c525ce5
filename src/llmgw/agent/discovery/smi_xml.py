"""Parse ``nvidia-smi -q -x``: memory, health, MIG ids and processes per card.

The schema drifts across driver generations (DTD v10 to v13, and 418-era
output with no DOCTYPE and no MIG elements at all), and values are strings
with units, padding and sentinels ("19968 MiB", " 37 C ", "N/A",
"Requested functionality has been deprecated"). Every field is therefore read
through one of the helpers below, which answer None for anything that is not
a plain number; only the fields without which a card cannot be reported (its
UUID) make the whole answer an error.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

from llmgw.agent.discovery.base import CardFacts, HealthFacts, InstanceFacts, ProcessFacts
from llmgw.errors import DiscoveryError

_NUMBER = re.compile(r"^(-?\d+(?:\.\d+)?)\s*([A-Za-z%()/]*)$")
_UUID = re.compile(r"^GPU-[0-9A-Fa-f-]{1,64}$")
_TO_MIB = {"": 1.0, "mib": 1.0, "kib": 1 / 1024, "gib": 1024.0, "b": 1 / 1024**2}
# What the driver writes in place of a value when the card has gone away or is
# failing; seen anywhere inside a <gpu>, they mark the whole card.
_LOST = "gpu is lost"
_UNKNOWN = "unknown error"
# Uncorrectable ECC counters across schema generations (v11/v12, v13, <= Turing).
_UNCORRECTABLE = (
    "sram_uncorrectable",
    "dram_uncorrectable",
    "sram_uncorrectable_parity",
    "sram_uncorrectable_secded",
    "double_bit/total",
)


@dataclass
class XmlCard:
    facts: CardFacts  # index is the position in the XML; MIG uuid/profile unknown
    migs: list[InstanceFacts] = field(default_factory=list)


@dataclass
class XmlLog:
    driver_version: str | None
    cuda_version: str | None
    cards: list[XmlCard]
    # What was read but doubtful, for the inventory's warnings.
    warnings: list[str] = field(default_factory=list)


# An instance's memory, under each name the schema has given it: driver 590
# calls it "Shared FB Memory Usage" (shared by the compute instances of one
# GPU instance), and its XML may follow the text output.
_INSTANCE_MEMORY = ("fb_memory_usage", "shared_fb_memory_usage")


def _text(node: ET.Element, path: str) -> str | None:
    found = node.find(path)
    if found is None or found.text is None:
        return None
    return found.text.strip()


def _number(text: str | None) -> tuple[float, str] | None:
    if text is None:
        return None
    match = _NUMBER.match(text.strip())
    if not match:
        return None
    return float(match.group(1)), match.group(2).lower()


def _int(node: ET.Element, path: str) -> int | None:
    parsed = _number(_text(node, path))
    return int(parsed[0]) if parsed else None


def _float(node: ET.Element, path: str) -> float | None:
    parsed = _number(_text(node, path))
    return parsed[0] if parsed else None


def _mib(node: ET.Element, path: str) -> int | None:
    parsed = _number(_text(node, path))
    if parsed is None or parsed[1] not in _TO_MIB:
        return None
    return max(0, int(parsed[0] * _TO_MIB[parsed[1]]))


def _yes(node: ET.Element, path: str) -> bool | None:
    value = (_text(node, path) or "").lower()
    return {"yes": True, "no": False}.get(value)


def _mode(node: ET.Element, path: str) -> bool | None:
    value = (_text(node, path) or "").lower()
    return {"enabled": True, "disabled": False}.get(value)


def _sum_counters(node: ET.Element, base: str) -> int | None:
    values = [_int(node, f"{base}/{name}") for name in _UNCORRECTABLE]
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _power(gpu: ET.Element) -> float | None:
    for path in (
        "gpu_power_readings/power_draw",
        "gpu_power_readings/instant_power_draw",
        "gpu_power_readings/average_power_draw",
        "power_readings/power_draw",
    ):
        value = _float(gpu, path)
        if value is not None:
            return value
    return None


def _own_texts(node: ET.Element) -> str:
    """All values of the card itself; process names are anyone's to choose."""
    parts: list[str] = []
    stack = [node]
    while stack:  # iterative: a hostile document may nest deeper than recursion allows
        current = stack.pop()
        parts.append((current.text or "").lower())
        stack.extend(c for c in current if c.tag not in ("processes", "accounted_processes"))
    return " ".join(parts)


def _health(gpu: ET.Element) -> HealthFacts:
    texts = _own_texts(gpu)
    pending_pages = [_yes(gpu, "retired_pages/pending_retirement")]
    pending_pages.append(_yes(gpu, "retired_pages/pending_blacklist"))
    known_pages = [p for p in pending_pages if p is not None]
    return HealthFacts(
        ecc_volatile_uncorrected=_sum_counters(gpu, "ecc_errors/volatile"),
        ecc_aggregate_uncorrected=_sum_counters(gpu, "ecc_errors/aggregate"),
        retired_pages_pending=any(known_pages) if known_pages else None,
        remapped_rows_pending=_yes(gpu, "remapped_rows/remapped_row_pending"),
        remapping_failed=_yes(gpu, "remapped_rows/remapped_row_failure"),
        reset_required=_yes(gpu, "gpu_reset_status/reset_required"),
        unrepairable_memory=_yes(gpu, "ecc_errors/unrepairable_memory"),
        lost=_LOST in texts,
        unknown_error=_UNKNOWN in texts,
    )


def _process(info: ET.Element, where: str) -> ProcessFacts:
    pid = _int(info, "pid")
    if pid is None or pid < 0:
        raise DiscoveryError(f"{where}: a process has no numeric <pid>")
    return ProcessFacts(
        pid=pid,
        name=_text(info, "process_name") or "",
        used_memory_mib=_mib(info, "used_memory") or 0,
        gpu_instance_id=_int(info, "gpu_instance_id"),
        compute_instance_id=_int(info, "compute_instance_id"),
    )


def _mig_device(node: ET.Element, where: str, warnings: list[str]) -> InstanceFacts:
    gi = _int(node, "gpu_instance_id")
    ci = _int(node, "compute_instance_id")
    if gi is None or ci is None or gi < 0 or ci < 0:
        raise DiscoveryError(f"{where}: a <mig_device> has no numeric instance ids")
    instance = InstanceFacts(uuid="", profile="", gpu_instance_id=gi, compute_instance_id=ci)
    memory = next((m for m in map(node.find, _INSTANCE_MEMORY) if m is not None), None)
    if memory is None:
        # Read silently, a missing figure is an instance with no memory.
        warnings.append(
            f"{where}: MIG device {gi}/{ci} gives its memory under neither"
            f" <{'> nor <'.join(_INSTANCE_MEMORY)}>; it reads as 0 MiB"
        )
    else:
        instance.memory_total_mib = _mib(memory, "total") or 0
        instance.memory_used_mib = _mib(memory, "used") or 0
    return instance


def _card(gpu: ET.Element, position: int, warnings: list[str]) -> XmlCard:
    where = f"nvidia-smi -q -x GPU {position}"
    uuid = _text(gpu, "uuid")
    if not uuid or not _UUID.match(uuid):
        raise DiscoveryError(f"{where}: <uuid> is missing or not a GPU UUID ({uuid!r:.60})")
    util = _int(gpu, "utilization/gpu_util")
    facts = CardFacts(
        index=position,
        uuid=uuid,
        name=_text(gpu, "product_name") or "unknown",
        memory_total_mib=_mib(gpu, "fb_memory_usage/total") or 0,
        memory_used_mib=_mib(gpu, "fb_memory_usage/used") or 0,
        utilization_pct=util if util is not None and 0 <= util <= 100 else None,
        temperature_c=_int(gpu, "temperature/gpu_temp"),
        power_w=_power(gpu),
        mig_current=_mode(gpu, "mig_mode/current_mig"),
        mig_pending=_mode(gpu, "mig_mode/pending_mig"),
        processes=[_process(p, where) for p in gpu.iterfind("processes/process_info")],
        health=_health(gpu),
        pci_bus_id=gpu.get("id"),
    )
    migs = [_mig_device(m, where, warnings) for m in gpu.iterfind("mig_devices/mig_device")]
    return XmlCard(facts=facts, migs=migs)


def parse_xml(data: bytes | str) -> XmlLog:
    """The cards in ``nvidia-smi -q -x`` output, in document order."""
    try:
        root = ET.fromstring(data)
    except ET.ParseError as exc:
        raise DiscoveryError(f"nvidia-smi -q -x is not well-formed XML: {exc}") from None
    except (ValueError, LookupError) as exc:
        # ValueError: a str with an encoding declaration it contradicts;
        # LookupError: a declared encoding Python does not know (found by
        # bench/fuzz.py: "<?xml version="1.0" encoding="U-8"?>").
        raise DiscoveryError(f"nvidia-smi -q -x cannot be read: {exc}") from None
    if root.tag != "nvidia_smi_log":
        raise DiscoveryError(
            f"nvidia-smi -q -x: root element is <{root.tag:.40}>, not <nvidia_smi_log>"
        )
    warnings: list[str] = []
    cards = [_card(gpu, n, warnings) for n, gpu in enumerate(root.iterfind("gpu"))]
    return XmlLog(
        driver_version=_text(root, "driver_version") or None,
        cuda_version=_text(root, "cuda_version") or None,
        cards=cards,
        warnings=warnings,
    )
