"""The nvidia-smi source: run ``-L`` and ``-q -x`` and join them per card.

``-q -x`` gives memory, health, MIG instance ids and processes; ``-L`` gives
the MIG UUIDs and profile names that the XML lacks. Within a card both list
instances in the same order (GPU instance id, then compute instance id), so
the n-th ``<mig_device>`` is the n-th ``MIG`` line. The legacy UUID format
carries the ids itself and is joined on them instead.

The executable is a setting (``LLMGW_NVIDIA_SMI``) so a script can stand in
for it; it is run with an argv list and a timeout, never through a shell.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import replace

from llmgw.agent.discovery.base import (
    CardFacts,
    InstanceFacts,
    SourceName,
    SourceReading,
    SourceUnavailable,
)
from llmgw.agent.discovery.smi_list import ListedGpu, parse_list
from llmgw.agent.discovery.smi_xml import XmlCard, parse_xml
from llmgw.errors import DiscoveryError

ENV_EXECUTABLE = "LLMGW_NVIDIA_SMI"
DEFAULT_EXECUTABLE = "nvidia-smi"
# nvidia-smi answers in well under a second; one that hangs is usually stuck
# on a failing GPU, and the agent must keep reporting rather than wait.
DEFAULT_TIMEOUT_S = 15.0
# Exit codes that mean "no usable NVIDIA stack here" rather than "broken":
# 6 no devices found, 9 driver not loaded, 12 NVML library not found.
_ABSENT_CODES = frozenset({6, 9, 12})


def executable_from_env() -> tuple[str, bool]:
    """The executable to run, and whether someone chose it explicitly."""
    chosen = os.environ.get(ENV_EXECUTABLE, "").strip()
    return (chosen, True) if chosen else (DEFAULT_EXECUTABLE, False)


def _first_line(data: bytes) -> str:
    text = data.decode("utf-8", errors="replace").strip()
    return text.splitlines()[0][:200] if text else ""


class NvidiaSmiSource:
    name: SourceName = "nvidia-smi"

    def __init__(self, executable: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S):
        if executable:
            self.executable, self._explicit = executable, True
        else:
            self.executable, self._explicit = executable_from_env()
        self.timeout_s = timeout_s

    def _run(self, *args: str) -> bytes:
        argv = [self.executable, *args]
        shown = "nvidia-smi " + " ".join(args)
        try:
            done = subprocess.run(argv, capture_output=True, timeout=self.timeout_s, check=False)
        except FileNotFoundError:
            raise SourceUnavailable(
                f"{self.executable} not found", warning=self._explicit
            ) from None
        except subprocess.TimeoutExpired:
            raise DiscoveryError(f"{shown} did not answer within {self.timeout_s:g} s") from None
        except OSError as exc:
            raise SourceUnavailable(
                f"{shown} cannot be run: {exc.strerror or exc}", warning=True
            ) from None
        if done.returncode != 0:
            said = _first_line(done.stdout) or _first_line(done.stderr)
            message = f"{shown}: exit {done.returncode}" + (f": {said}" if said else "")
            if done.returncode in _ABSENT_CODES:
                raise SourceUnavailable(message, warning=True)
            raise DiscoveryError(message)
        return done.stdout

    def read(self) -> SourceReading:
        warnings: list[str] = []
        listed: list[ListedGpu] | None
        try:
            listed = parse_list(self._run("-L").decode("utf-8", errors="replace"))
        except DiscoveryError as exc:
            # The XML alone still describes whole cards; join() refuses
            # only when MIG instances would be left without a UUID.
            warnings.append(str(exc))
            listed = None
        log = parse_xml(self._run("-q", "-x"))
        warnings.extend(log.warnings)
        cards = join(listed, log.cards)
        return SourceReading(
            source="nvidia-smi",
            driver_version=log.driver_version,
            cuda_version=log.cuda_version,
            cards=cards,
            warnings=warnings,
        )


def _join_instances(listed: ListedGpu, xml: XmlCard) -> list[InstanceFacts]:
    where = f"GPU {listed.index} ({listed.uuid})"
    if len(listed.migs) != len(xml.migs):
        raise DiscoveryError(
            f"{where}: nvidia-smi -L lists {len(listed.migs)} MIG"
            f" device{'' if len(listed.migs) == 1 else 's'} but -q -x "
            f"lists {len(xml.migs)} (instances changed between the two calls?)"
        )
    joined: list[InstanceFacts] = []
    by_ids = {(m.gpu_instance_id, m.compute_instance_id): m for m in xml.migs}
    for position, named in enumerate(listed.migs):
        if named.legacy_ids is not None:
            found = by_ids.get(named.legacy_ids)
            if found is None:
                raise DiscoveryError(
                    f"{where}: MIG device {named.uuid} has no matching <mig_device> in -q -x"
                )
        else:
            found = xml.migs[position]
        # -q -x knows the ids and memory, -L the name; fresh lists, since
        # processes and Xid reasons are added to each instance later.
        joined.append(replace(found, uuid=named.uuid, profile=named.profile, processes=[],
                              unhealthy_reasons=[]))
    return joined


def join(listed: list[ListedGpu] | None, xml_cards: list[XmlCard]) -> list[CardFacts]:
    """Cards with their MIG instances named, or DiscoveryError when the two disagree."""
    if listed is None:
        for xml in xml_cards:
            if xml.migs:
                raise DiscoveryError(
                    f"GPU {xml.facts.index} has MIG instances but nvidia-smi -L, which "
                    "names them, failed"
                )
        return [xml.facts for xml in xml_cards]
    by_uuid = {gpu.uuid: gpu for gpu in listed}
    xml_uuids = [xml.facts.uuid for xml in xml_cards]
    if sorted(by_uuid) != sorted(xml_uuids) or len(set(xml_uuids)) != len(xml_uuids):
        raise DiscoveryError(
            f"nvidia-smi -L lists {len(listed)} GPU(s) and -q -x {len(xml_cards)}, "
            "and their UUIDs differ"
        )
    cards: list[CardFacts] = []
    for xml in xml_cards:
        named = by_uuid[xml.facts.uuid]
        card = xml.facts
        card.index = named.index
        if named.migs and not card.mig_current:
            raise DiscoveryError(
                f"GPU {named.index}: nvidia-smi -L lists MIG devices but -q -x says MIG is off"
            )
        card.instances = _join_instances(named, xml) if card.mig_current else []
        if xml.migs and not card.mig_current:
            raise DiscoveryError(f"GPU {named.index}: -q -x lists MIG devices but says MIG is off")
        cards.append(card)
    return cards
