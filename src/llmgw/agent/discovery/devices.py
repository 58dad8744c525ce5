"""Facts about cards -> the placeable devices a node reports (DESIGN.md §3).

The MIG rules live here, once, for both sources:

* A card in MIG mode is reported as its instances, never as a card.
* Instances are numbered ``1000 + 100 * card + instance`` (``card/migN``), where
  *instance* is the position in the card's instance list sorted by GPU
  instance id, then compute instance id -- the order nvidia-smi and NVML use.
  The number is for people and placement within one snapshot; it changes
  when the card is re-carved. The MIG UUID is the identity.
* An instance's memory and processes are its own; temperature, power, health
  and wear are its card's; utilisation is None, never 0.
* Compute instances that share one GPU instance (``1c.3g.71gb`` and
  ``2c.3g.71gb``) each report the GPU instance's memory, because that is what
  an engine on either can use; :func:`memory_totals` counts it once.
* A card in MIG mode with nothing carved, or with MIG enabling waiting for a
  reset, is one device that is not placeable, with the reason. A pending mode
  the source does not give is no change pending (:func:`pending_mode`).
* A carved card with MIG disabling waiting for a reset is still its instances
  until the reset: replicas running on them keep the device they hold. The
  instances take no new work (they vanish at the reset), with the reason.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from llmgw.agent.discovery.base import CardFacts, InstanceFacts, ProcessFacts
from llmgw.agent.discovery.classes import mig_class, resolve_card_class
from llmgw.agent.discovery.health import reasons
from llmgw.errors import DiscoveryError
from llmgw.wire import Device, GpuProcess, MigInfo, device_label, mig_number

# The placement number leaves 100 instance slots per card and 1000 card
# indices below the MIG base: outside that the numbers would collide.
MAX_CARDS = 1000
MAX_INSTANCES = 100

NOTHING_CARVED = (
    "MIG mode is enabled but no instances are carved: create them with "
    "`nvidia-smi mig -cgi <profiles> -C` or mig-parted"
)


def pending_mode(card: CardFacts) -> bool | None:
    """The MIG mode the card will have after its next reset.

    An unknown pending mode means "no change pending": drivers and trimmed
    outputs leave ``<pending_mig>`` out, and reading its absence as "MIG off
    after a reset" would turn a card in MIG mode with nothing carved into a
    placeable whole card that no engine can open.
    """
    return card.mig_current if card.mig_pending is None else card.mig_pending


def _pending_reason(current: bool, pending: bool) -> str:
    now, then = ("enabled", "disabled") if current else ("disabled", "enabled")
    return f"MIG mode change pending ({now} -> {then}): reset the GPU or reboot to apply it"


def _processes(items: Iterable[ProcessFacts]) -> list[GpuProcess]:
    return [GpuProcess(pid=p.pid, name=p.name, used_memory_mib=p.used_memory_mib) for p in items]


def _card_device(card: CardFacts, gpu_class: str) -> Device:
    why = reasons(card.health)
    device = Device(
        number=card.index,
        label=device_label(card.index),
        uuid=card.uuid,
        name=card.name,
        gpu_class=gpu_class,
        memory_total_mib=card.memory_total_mib,
        memory_used_mib=card.memory_used_mib,
        utilization_pct=card.utilization_pct,
        temperature_c=card.temperature_c,
        power_w=card.power_w,
        healthy=not why,
        unhealthy_reasons=why,
        processes=_processes(card.processes),
        ecc_uncorrected=card.health.ecc_aggregate_uncorrected,
        retired_pages_pending=card.health.retired_pages_pending,
        remapped_rows_pending=card.health.remapped_rows_pending,
        remapping_failed=card.health.remapping_failed,
    )
    pending = pending_mode(card)
    if card.mig_current is not None and pending is not None:
        if card.mig_current != pending:
            device.placeable = False
            device.unplaceable_reason = _pending_reason(card.mig_current, pending)
        elif card.mig_current and not card.instances:
            device.placeable = False
            device.unplaceable_reason = NOTHING_CARVED
    if device.placeable is False:
        device.utilization_pct = None
    return device


def _attach_processes(card: CardFacts, ordered: list[InstanceFacts]) -> list[str]:
    """Give processes listed on the parent card to the instance they run on."""
    lost: list[str] = []
    by_ids = {(i.gpu_instance_id, i.compute_instance_id): i for i in ordered}
    for proc in card.processes:
        if proc.gpu_instance_id is None:
            lost.append(f"pid {proc.pid} on MIG card {card.index} has no instance id")
            continue
        target = by_ids.get((proc.gpu_instance_id, proc.compute_instance_id or 0))
        if target is None:
            # A CI id the instance list lacks: the GI alone still says where
            # its memory is held.
            target = next((i for i in ordered if i.gpu_instance_id == proc.gpu_instance_id), None)
        if target is None:
            lost.append(
                f"pid {proc.pid} on card {card.index} runs on GPU instance "
                f"{proc.gpu_instance_id}, which is not listed"
            )
            continue
        if proc not in target.processes:
            target.processes.append(proc)
    return lost


def _instance_devices(card: CardFacts, card_cls: str, warnings: list[str]) -> list[Device]:
    ordered = sorted(card.instances, key=lambda i: (i.gpu_instance_id, i.compute_instance_id))
    if len(ordered) > MAX_INSTANCES:
        raise DiscoveryError(f"card {card.index} lists {len(ordered)} MIG instances; at most 100")
    seen_ids = {(i.gpu_instance_id, i.compute_instance_id) for i in ordered}
    if len(seen_ids) != len(ordered):
        raise DiscoveryError(f"card {card.index} lists the same MIG instance ids twice")
    warnings.extend(_attach_processes(card, ordered))
    why = reasons(card.health)
    pending = pending_mode(card)
    leaving = None if pending else _pending_reason(True, False)
    devices = []
    for position, inst in enumerate(ordered):
        number = mig_number(card.index, position)
        inst_why = [*why, *inst.unhealthy_reasons]
        devices.append(
            Device(
                number=number,
                label=device_label(number),
                uuid=inst.uuid,
                name=f"{card.name} MIG {inst.profile}",
                gpu_class=mig_class(card_cls, inst.profile),
                memory_total_mib=inst.memory_total_mib,
                memory_used_mib=inst.memory_used_mib,
                utilization_pct=None,
                temperature_c=card.temperature_c,
                power_w=card.power_w,
                healthy=not inst_why,
                unhealthy_reasons=inst_why,
                mig=MigInfo(
                    parent_uuid=card.uuid,
                    parent_index=card.index,
                    gpu_instance_id=inst.gpu_instance_id,
                    compute_instance_id=inst.compute_instance_id,
                    profile=inst.profile,
                ),
                processes=_processes(inst.processes),
                ecc_uncorrected=card.health.ecc_aggregate_uncorrected,
                retired_pages_pending=card.health.retired_pages_pending,
                remapped_rows_pending=card.health.remapped_rows_pending,
                remapping_failed=card.health.remapping_failed,
                placeable=leaving is None,
                unplaceable_reason=leaving,
            )
        )
    return devices


def build_devices(
    cards: list[CardFacts],
    *,
    class_overrides: Mapping[str, str] | None = None,
    warnings: list[str] | None = None,
) -> list[Device]:
    """The devices of one snapshot, cards in index order, instances after their card's slot."""
    sink = warnings if warnings is not None else []
    indices = [c.index for c in cards]
    if len(set(indices)) != len(indices):
        raise DiscoveryError(f"two cards share an index: {sorted(indices)}")
    uuids = [c.uuid for c in cards] + [i.uuid for c in cards for i in c.instances]
    if len(set(uuids)) != len(uuids):
        raise DiscoveryError("two devices share a UUID")
    devices: list[Device] = []
    for card in sorted(cards, key=lambda c: c.index):
        if not 0 <= card.index < MAX_CARDS:
            raise DiscoveryError(f"card index {card.index} is outside 0..{MAX_CARDS - 1}")
        cls = resolve_card_class(
            uuid=card.uuid,
            name=card.name,
            memory_total_mib=card.memory_total_mib,
            overrides=class_overrides,
        )
        if card.mig_current and card.instances:
            devices.extend(_instance_devices(card, cls, sink))
        else:
            devices.append(_card_device(card, cls))
    return devices


@dataclass(frozen=True)
class MemoryTotals:
    total_mib: int
    used_mib: int


def memory_totals(devices: Iterable[Device]) -> MemoryTotals:
    """Memory on a node, each GPU instance's pool counted once.

    Compute instances of one GPU instance all report the pool they share, so
    summing devices naively would count it once per compute instance.
    """
    total = used = 0
    pools: set[tuple[str, int]] = set()
    for device in devices:
        if device.mig is not None:
            pool = (device.mig.parent_uuid, device.mig.gpu_instance_id)
            if pool in pools:
                continue
            pools.add(pool)
        total += device.memory_total_mib
        used += device.memory_used_mib
    return MemoryTotals(total_mib=total, used_mib=used)
