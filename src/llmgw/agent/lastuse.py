"""When each weights cache entry was last used, kept on disk.

Eviction deletes the least recently used weights first. Kept only in memory,
that order would reset with every agent restart (an upgrade, a crash) and the
next eviction would pick by creation time: the model used an hour ago could go
before one untouched for a month. The index is a small JSON file next to the
entries, replaced atomically; an entry it does not know (made by an older
agent, or the index lost) counts as used when it was created.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("llmgw.agent.weights")


class LastUse:
    def __init__(self, path: Path, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.clock = clock
        self._times: dict[str, float] | None = None

    def get(self, key: str, default: float) -> float:
        return self._load().get(key, default)

    def mark(self, key: str) -> None:
        self._load()[key] = self.clock()
        self._save()

    def forget(self, key: str) -> None:
        if self._load().pop(key, None) is not None:
            self._save()

    def _load(self) -> dict[str, float]:
        if self._times is None:
            self._times = {}
            try:
                raw = json.loads(self.path.read_text())
            except FileNotFoundError:
                raw = {}
            except (OSError, ValueError) as exc:
                log.warning("ignoring unreadable %s: %s", self.path, exc)
                raw = {}
            if isinstance(raw, dict):
                self._times = {
                    str(k): float(v) for k, v in raw.items() if isinstance(v, (int, float))
                }
        return self._times

    def _save(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self._times, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError as exc:
            # The order is advice, not a condition for serving: a full disk
            # (the very case eviction is for) must not fail a replica's start.
            log.warning("cannot record weights use in %s: %s", self.path, exc)
