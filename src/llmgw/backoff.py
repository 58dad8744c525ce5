"""Waits between retries that double after each failure, up to a ceiling.

One rule for every loop that retries a peer (the agent's reports, the
gateway's config feed): a run of failures spaces the tries out so a peer that
is down is not hammered, and the first success starts the waits over.
"""

from __future__ import annotations


class Backoff:
    def __init__(self, first_s: float, most_s: float) -> None:
        self.first_s = first_s
        self.most_s = most_s
        self.next_s = first_s  # what the next failure waits

    def failed(self) -> float:
        """The wait before the next try; the one after it is twice as long."""
        wait = self.next_s
        self.next_s = min(wait * 2, self.most_s)
        return wait

    def cap(self, limit_s: float) -> None:
        """Wait no longer than ``limit_s`` after the next failure."""
        self.next_s = min(self.next_s, limit_s)

    def succeeded(self) -> None:
        self.next_s = self.first_s
