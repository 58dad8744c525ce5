"""Disk room for weights: the reserve, what a fetch needs, and which unused weights go.

Without a check before a fetch, a 140 GB model started on a disk with 50 GB
free fails an hour later with ENOSPC half way, and weights of models no
longer placed on the node stay until the disk is full. So a fetch whose size
is known first asks for room: free space minus a reserve (the rest of the
machine, logs and the engines' own files need some too) minus what the other
downloads in flight have yet to write. Short of that, unused weights are
deleted least recently used first, only as many as needed; when even all of
them would not do, nothing is deleted and the fetch fails with the numbers.

Everything here is pure except :func:`disk_space`, the one place that asks
the filesystem (and the seam tests replace: a full disk cannot be staged).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from llmgw.agent.manifest import WeightsError
from llmgw.errors import ConfigError

GIB = 1024**3

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_PERCENT_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


class NotEnoughDisk(WeightsError):
    """The weights do not fit even after evicting every unused entry.

    Not a source's fault: a fetch that fails this way must not move on to the
    next peer or the origin, which need the same room.
    """


def size_text(n: float) -> str:
    """Decimal units, as disks are sold and ``df -H`` shows them: ``140.2 GB``."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def parse_size(text: str) -> int:
    """``10GiB``, ``500 GB``, ``1.5T``, ``0``: bytes; ConfigError otherwise."""
    match = _SIZE_RE.match(text)
    unit = _UNITS.get(match.group(2).lower()) if match else None
    if match is None or unit is None:
        raise ConfigError(f"{text!r} is not a size (e.g. 10GiB, 500GB, 0)")
    return int(float(match.group(1)) * unit)


@dataclass(frozen=True)
class DiskReserve:
    """Space a fetch leaves free: a share of the disk, at most ``size_bytes``.

    Either part may be None; with both, the smaller applies (5 % of a 16 TB
    array is 800 GB, more than anyone means to keep free; 10 GiB of a 100 GB
    root disk is a tenth of it).
    """

    fraction: float | None = 0.05
    size_bytes: int | None = 10 * GIB

    def bytes_of(self, total: int) -> int:
        options = []
        if self.fraction is not None:
            options.append(int(total * self.fraction))
        if self.size_bytes is not None:
            options.append(self.size_bytes)
        return min(options, default=0)

    @classmethod
    def parse(cls, text: str) -> DiskReserve:
        """``5%`` (of the disk) or a size (``20GiB``, ``0``)."""
        percent = _PERCENT_RE.match(text)
        if percent is not None:
            value = float(percent.group(1))
            if value >= 100:
                raise ConfigError(f"weights reserve {text!r}: a share must be below 100 %")
            return cls(fraction=value / 100, size_bytes=None)
        try:
            return cls(fraction=None, size_bytes=parse_size(text))
        except ConfigError:
            raise ConfigError(
                f"weights reserve {text!r}: expected a share of the disk (5%) or a size (10GiB, 0)"
            ) from None


@dataclass(frozen=True)
class DiskSpace:
    total: int
    free: int  # what an unprivileged process may still write


def disk_space(path: Path) -> DiskSpace:
    usage = shutil.disk_usage(path)
    return DiskSpace(total=usage.total, free=usage.free)


@dataclass(frozen=True)
class Unused:
    """A cache entry no replica uses and no fetch touches: it may be evicted."""

    key: str
    model: str
    size_bytes: int
    last_used: float


@dataclass(frozen=True)
class RoomCheck:
    """One fetch's question: does ``need`` fit, and what would have to go."""

    model: str
    where: Path
    need: int
    space: DiskSpace
    reserve: int
    pending: int  # still to be written by the other fetches in flight
    unused: Sequence[Unused]

    @property
    def room(self) -> int:
        return self.space.free - self.reserve - self.pending

    def victims(self) -> list[Unused] | None:
        """Least recently used first, just enough of them; None when all would not do."""
        short = self.need - self.room
        chosen: list[Unused] = []
        for entry in sorted(self.unused, key=lambda u: (u.last_used, u.key)):
            if short <= 0:
                break
            chosen.append(entry)
            short -= entry.size_bytes
        return chosen if short <= 0 else None

    def refusal(self) -> str:
        details = [f"reserve {size_text(self.reserve)}"]
        if self.pending > 0:
            details.append(f"{size_text(self.pending)} still to come for other downloads")
        if self.unused:
            total = sum(u.size_bytes for u in self.unused)
            details.append(f"unused weights that could be evicted: {size_text(total)}")
        return (
            f"not enough disk for weights of {self.model!r}: need {size_text(self.need)},"
            f" {size_text(self.space.free)} free in {self.where} ({'; '.join(details)});"
            " free space or move --data-dir"
        )
