"""Parse ``nvidia-smi -L``: the one output that names MIG instances.

``-q -x`` has no MIG UUID and no profile name, so this list is what turns an
XML ``<mig_device>`` into something an engine can be pinned to. Two line
formats exist, both handled::

    GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-8e10...)
      MIG 1g.10gb     Device  0: (UUID: MIG-3fff...)            R470 and later
    GPU 0: A100-SXM4-40GB (UUID: GPU-5c89...)
      MIG 1g.5gb Device 0: (UUID: MIG-GPU-5c89.../7/0)          R450/R460

"Device N" is a position, not an identity: inside a container or a job the
same instance is "Device 0". Only the UUIDs are kept as identities.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from llmgw.errors import DiscoveryError

_GPU_LINE = re.compile(r"^GPU\s+(\d{1,4}):\s+(.+?)\s+\(UUID:\s+(GPU-[0-9A-Fa-f-]{1,64})\)\s*$")
_MIG_LINE = re.compile(
    r"^\s+MIG\s+(\S+)\s+Device\s+(\d{1,3}):\s+\(UUID:\s+(MIG-[^()\s]{1,100})\)\s*$"
)
# go-nvlib's MigProfileInfo.String(): [Cc.]Gg.Mgb with +me, +me.all, -me, +gfx.
PROFILE_PATTERN = re.compile(
    r"^(?:\d{1,2}c\.)?\d{1,2}g\.\d{1,4}gb(?:[+-][a-z]{1,8}(?:\.[a-z]{1,8})?)*$"
)
_LEGACY_MIG_UUID = re.compile(r"^MIG-(GPU-[0-9A-Fa-f-]+)/(\d+)/(\d+)$")


@dataclass
class ListedMig:
    profile: str
    uuid: str
    # Only the legacy format carries these; the modern UUID is opaque.
    legacy_ids: tuple[int, int] | None = None


@dataclass
class ListedGpu:
    index: int
    name: str
    uuid: str
    migs: list[ListedMig] = field(default_factory=list)


def _snippet(line: str) -> str:
    return repr(line[:80] + ("..." if len(line) > 80 else ""))


def parse_list(text: str) -> list[ListedGpu]:
    """The cards and MIG instances in ``nvidia-smi -L`` output, in listed order."""
    gpus: list[ListedGpu] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        gpu = _GPU_LINE.match(line)
        if gpu:
            gpus.append(ListedGpu(index=int(gpu.group(1)), name=gpu.group(2), uuid=gpu.group(3)))
            continue
        mig = _MIG_LINE.match(line)
        if not mig:
            raise DiscoveryError(f"nvidia-smi -L line {number} is not understood: {_snippet(line)}")
        if not gpus:
            raise DiscoveryError(f"nvidia-smi -L line {number} names a MIG device before any GPU")
        profile, uuid = mig.group(1), mig.group(3)
        if not PROFILE_PATTERN.match(profile):
            raise DiscoveryError(
                f"nvidia-smi -L line {number}: {profile[:40]!r} is not a MIG profile name"
            )
        legacy = _LEGACY_MIG_UUID.match(uuid)
        ids: tuple[int, int] | None = None
        if legacy:
            if legacy.group(1) != gpus[-1].uuid:
                raise DiscoveryError(
                    f"nvidia-smi -L line {number}: MIG device {uuid} is listed under "
                    f"{gpus[-1].uuid}, not its own card"
                )
            ids = (int(legacy.group(2)), int(legacy.group(3)))
        gpus[-1].migs.append(ListedMig(profile=profile, uuid=uuid, legacy_ids=ids))
    indices = [g.index for g in gpus]
    if len(set(indices)) != len(indices):
        raise DiscoveryError(f"nvidia-smi -L lists a GPU index twice: {indices}")
    return gpus
