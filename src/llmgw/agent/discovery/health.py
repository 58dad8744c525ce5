"""Whether a card can be trusted with work, and the wear it has collected.

A card that corrupts memory or is about to be reset does not fail loudly: the
engine on it returns wrong tokens or dies mid-stream. So the signals that mean
"this card needs a reset or a replacement" take it out of placement with the
reason spelled out, and everything else is reported as wear for people to read.

Uncorrectable ECC counts the *volatile* counter (since the last driver load):
the lifetime aggregate keeps old errors whose pages were retired or rows
remapped long ago, and a card that healed itself that way is fine to use.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.agent.discovery.base import CardFacts, HealthFacts


def reasons(health: HealthFacts) -> list[str]:
    """Why the card is unhealthy; an empty list means healthy."""
    found: list[str] = []
    if health.lost:
        found.append("fallen off the bus (GPU is lost): reset the GPU or reboot the node")
    if health.unknown_error:
        found.append("the driver reports unknown errors for this GPU")
    if health.ecc_volatile_uncorrected:
        found.append(
            f"{health.ecc_volatile_uncorrected} uncorrectable ECC error(s) since the driver loaded"
        )
    if health.retired_pages_pending:
        found.append("page retirement pending: reset the GPU to retire the bad pages")
    if health.remapped_rows_pending:
        found.append("row remapping pending: reset the GPU to remap the bad rows")
    if health.remapping_failed:
        found.append("row remapping failed: the GPU's memory cannot be repaired")
    if health.unrepairable_memory:
        found.append("the driver reports unrepairable memory: replace the GPU")
    if health.reset_required:
        found.append("the driver requires a GPU reset")
    found.extend(health.xid_errors)
    return found


@dataclass
class _Seen:
    utilization_pct: int | None = None
    remapped_rows_pending: bool | None = None
    remapping_failed: bool | None = None


class LastSeen:
    """Values a card stops reporting in MIG mode, kept from before.

    In MIG mode neither NVML nor nvidia-smi gives utilisation or remapped-row
    counts for the card. Wear does not go away when an operator carves the
    card, so the last values seen while they were readable are carried on
    (keyed by card UUID, which survives a reboot; the index does not).
    """

    def __init__(self) -> None:
        self._cards: dict[str, _Seen] = {}
        # Identity by index, so a card that vanishes mid-read is still reported
        # under its UUID (unhealthy) instead of as an anonymous entry.
        self._identity: dict[int, tuple[str, str, int]] = {}

    def remember_identity(
        self, index: int, uuid: str, name: str, memory_total_mib: int | None = None
    ) -> None:
        """Note who sits at ``index``; unknown memory keeps the last figure for that card."""
        before = self._identity.get(index)
        if memory_total_mib is None:
            memory_total_mib = before[2] if before and before[0] == uuid else 0
        self._identity[index] = (uuid, name, memory_total_mib)

    def identity(self, index: int) -> tuple[str, str, int] | None:
        """(uuid, name, memory MiB) of the card last seen at this index."""
        return self._identity.get(index)

    def apply(self, card: CardFacts) -> None:
        """Remember what the card reports now; fill in what it does not."""
        seen = self._cards.setdefault(card.uuid, _Seen())
        health = card.health
        if card.utilization_pct is not None:
            seen.utilization_pct = card.utilization_pct
        elif not card.mig_current:
            # Only whole cards borrow an old figure; instances never carry
            # utilisation at all (a stale 0 would claim an idle device).
            card.utilization_pct = seen.utilization_pct
        if health.remapped_rows_pending is not None or health.remapping_failed is not None:
            seen.remapped_rows_pending = health.remapped_rows_pending
            seen.remapping_failed = health.remapping_failed
        else:
            health.remapped_rows_pending = seen.remapped_rows_pending
            health.remapping_failed = seen.remapping_failed

    def forget(self, uuid: str) -> None:
        self._cards.pop(uuid, None)
