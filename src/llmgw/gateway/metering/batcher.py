"""Usage per key, model and minute, accumulated in memory and sent in batches.

One row per (minute, key, model) instead of one per request: the store sees a
few writes per flush interval whatever the request rate, and a crash loses at
most what accumulated since the last flush. Rows that could not be sent are
merged back and retried; if the control plane stays away, the oldest minutes
are dropped beyond a bound rather than growing without limit.
"""

from __future__ import annotations

import logging
import time

from llmgw import wire

log = logging.getLogger(__name__)

_Row = list[int]  # requests, prompt, completion, cached, errors
_Key = tuple[int, str, str]  # minute, key id, model


class UsageBatcher:
    def __init__(self, max_rows: int) -> None:
        self._rows: dict[_Key, _Row] = {}
        self._max_rows = max_rows
        self.dropped = 0
        # Model -> when a request for it last ended (unix time), since the
        # last load report: what keeps a LoRA adapter loaded and orders its
        # eviction (control.adapters); the per-minute rows are too coarse.
        self.last_used: dict[str, float] = {}

    def add(
        self,
        minute: int,
        key_id: str,
        model: str,
        prompt: int,
        completion: int,
        cached: int,
        error: bool,
    ) -> None:
        self.last_used[model] = time.time()
        row = self._rows.get((minute, key_id, model))
        if row is None:
            if len(self._rows) >= self._max_rows:
                self._drop_oldest()
            self._rows[(minute, key_id, model)] = [1, prompt, completion, cached, int(error)]
            return
        row[0] += 1
        row[1] += prompt
        row[2] += completion
        row[3] += cached
        row[4] += error

    def take_last_used(self) -> dict[str, float]:
        used, self.last_used = self.last_used, {}
        return used

    def drain(self) -> list[wire.UsageRecord]:
        rows, self._rows = self._rows, {}
        return [
            wire.UsageRecord(
                minute=minute,
                key_id=key_id,
                model=model,
                requests=row[0],
                prompt_tokens=row[1],
                completion_tokens=row[2],
                cached_tokens=row[3],
                errors=row[4],
            )
            for (minute, key_id, model), row in rows.items()
        ]

    def restore(self, records: list[wire.UsageRecord]) -> None:
        """Put back records whose delivery failed, merging with newer counts."""
        for record in records:
            key = (record.minute, record.key_id, record.model)
            row = self._rows.get(key)
            if row is None:
                if len(self._rows) >= self._max_rows:
                    self._drop_oldest()
                self._rows[key] = [0, 0, 0, 0, 0]
                row = self._rows[key]
            row[0] += record.requests
            row[1] += record.prompt_tokens
            row[2] += record.completion_tokens
            row[3] += record.cached_tokens
            row[4] += record.errors

    def __len__(self) -> int:
        return len(self._rows)

    def _drop_oldest(self) -> None:
        oldest = min(key[0] for key in self._rows)
        doomed = [key for key in self._rows if key[0] == oldest]
        for key in doomed:
            del self._rows[key]
        self.dropped += len(doomed)
        log.warning("usage buffer full: dropped %d rows of minute %d", len(doomed), oldest)
