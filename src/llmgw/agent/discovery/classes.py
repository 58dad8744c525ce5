"""How a card gets its class name (DESIGN.md §3), and how operators override it.

A class is what a catalog entry asks for ("a100-80g"), so it must be the same
string on every node holding that kind of card, whatever driver generation
spelled the product name, and it must change when the memory does: an
A100 40 GB and an A100 80 GB take different models.

The rule, applied to the product name and the memory the card reports:

1. Lower-case the name and split it on spaces, hyphens and underscores.
2. Drop vendor and brand words (``nvidia``, ``geforce``, ``tesla``, ``quadro``),
   form factors and memory technologies (``sxm*``, ``pcie``, ``nvl``,
   ``hbm*``, ``gddr*``) and filler (``generation``): they say how the card is
   mounted, not what runs on it. Old drivers print "A100-SXM4-40GB" and new
   ones "NVIDIA A100-SXM4-40GB"; both become ``a100``.
3. Glue a short letter prefix to the number after it (``rtx 4090`` ->
   ``rtx4090``) and ``ti``/``super`` to the word before it (``gtx1660ti``),
   the way people write these names; join what is left with ``-``.
4. Append the memory in GB with a ``g``: the size printed in the name when
   there is one ("80GB"), otherwise the reported MiB rounded to the size the
   card is sold as (:func:`memory_gb`): L40S reports 46068 MiB and is a
   48 GB card, H200 reports 143771 MiB and is a 141 GB card.

Examples: ``a100-80g``, ``h100-80g``, ``h100-94g`` (NVL), ``h200-141g``,
``l40s-48g``, ``l4-24g``, ``t4-16g``, ``a10g-24g``, ``rtx4090-24g``,
``rtx4000-sff-ada-20g``.

A MIG instance's class is ``<card class>-mig-<profile>`` with the profile
verbatim from the driver (``a100-80g-mig-3g.40gb``, ``h200-141g-mig-1c.3g.71gb``,
``a100-80g-mig-1g.10gb+me``).

Overrides: a per-node map whose keys are a card UUID, a product name (as the
driver prints it, case-insensitive) or a derived class, and whose values are
the class to use instead. They are looked up in that order, so one odd card
can be renamed without renaming its siblings. MIG instances take their card's
overridden class as their prefix.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from llmgw.wire import MIG_CLASS_MARKER

_DROP_WORDS = frozenset({"nvidia", "geforce", "tesla", "quadro", "pcie", "nvl", "generation"})
_DROP_PATTERNS = (re.compile(r"^sxm\d*$"), re.compile(r"^hbm\d*e?$"), re.compile(r"^gddr\d*x?$"))
_MEMORY_IN_NAME = re.compile(r"^(\d{1,4})gb?$")
_SUFFIX_WORDS = frozenset({"ti", "super"})
_CLASS_OK = re.compile(r"[^a-z0-9.+-]+")

# Sizes NVIDIA sells cards and modules as, in GB. Reported memory is a little
# below the label (ECC, reserved regions, GB vs GiB), so the label is found by
# rounding up to the nearest of these -- but only when it is close, so that an
# unknown card is named by its own memory rather than a far-off label.
_SOLD_SIZES_GB = (
    1, 2, 3, 4, 5, 6, 8, 10, 11, 12, 16, 20, 24, 32, 40, 48, 64, 80, 94, 96,
    128, 141, 144, 180, 186, 192, 256, 288,
)  # fmt: skip
_LABEL_OVER = 1.02  # reported may exceed the label by this factor (GiB rounding)
_LABEL_UNDER = 1.10  # and fall short of it by at most this factor


def memory_gb(memory_total_mib: int) -> int:
    """The size a card with this much reported memory is sold as, in GB."""
    gib = memory_total_mib / 1024
    for size in _SOLD_SIZES_GB:
        if gib <= size * _LABEL_OVER:
            if size <= gib * _LABEL_UNDER:
                return size
            break
    # Half-up, not round(): banker's rounding turns 70.5 into 70.
    return max(1, math.floor(gib + 0.5))


def card_class(name: str, memory_total_mib: int) -> str:
    """The class of a whole card, by the rule in this module's docstring."""
    words = [w for w in re.split(r"[\s_-]+", name.lower()) if w]
    memory_from_name: int | None = None
    kept: list[str] = []
    for word in words:
        found = _MEMORY_IN_NAME.match(word)
        if found and memory_from_name is None and kept:
            memory_from_name = int(found.group(1))
            continue
        if word in _DROP_WORDS or any(p.match(word) for p in _DROP_PATTERNS):
            continue
        kept.append(word)
    glued: list[str] = []
    for word in kept:
        suffix = word in _SUFFIX_WORDS
        series = bool(glued) and glued[-1].isalpha() and len(glued[-1]) <= 3 and word[:1].isdigit()
        if glued and (suffix or series):
            glued[-1] += word
        else:
            glued.append(word)
    model = _CLASS_OK.sub("", "-".join(glued)).strip("-") or "gpu"
    size = memory_from_name or (memory_gb(memory_total_mib) if memory_total_mib > 0 else None)
    return f"{model}-{size}g" if size else model


def mig_class(card: str, profile: str) -> str:
    """``<card class>-mig-<profile>``, e.g. ``a100-80g-mig-3g.40gb``."""
    return f"{card}{MIG_CLASS_MARKER}{profile}"


def resolve_card_class(
    *,
    uuid: str,
    name: str,
    memory_total_mib: int,
    overrides: Mapping[str, str] | None,
) -> str:
    """The class for one card: an override when one matches, else the rule."""
    derived = card_class(name, memory_total_mib)
    if not overrides:
        return derived
    if uuid in overrides:
        return overrides[uuid]
    by_name = {key.lower(): value for key, value in overrides.items()}
    if name.lower() in by_name:
        return by_name[name.lower()]
    return overrides.get(derived, derived)
