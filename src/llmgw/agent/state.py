"""On-disk records of the engines this agent started, for adoption after a restart.

The agent may die (upgrade, crash, ``kill -9`` of ``llmgw up``) while its
engines keep serving in their own sessions. A record per replica -- with the
pid *and* the process's start time, because a pid alone may by then belong to
an unrelated process -- lets the next agent find each engine and adopt it
instead of restarting it (minutes of weight loading on a real GPU).

The file is replaced atomically (write, fsync, rename): a crash while saving
leaves the previous version, never a torn one.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field
from pydantic import ValidationError as PydanticValidationError

from llmgw.agent.progress import ProgressMetrics
from llmgw.wire import EngineDialect, ReplicaAssignment

log = logging.getLogger("llmgw.agent.state")


class EngineRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")

    replica_id: str
    generation: int
    model: str
    assignment: ReplicaAssignment
    port: int
    pid: int | None = None
    birth: str | None = None  # supervisor.process_birth: pid-reuse guard
    health_path: str | None = "/health"
    # Probed while the engine serves (EngineLaunch.serving_probe). None also
    # for a record written before liveness checks: such an engine is not
    # probed, since its health path may not be safe to probe mid-generation.
    liveness_path: str | None = None
    # Scraped while it serves (EngineLaunch.progress); None: not scraped.
    progress: ProgressMetrics | None = None
    # The adapter's dialect, reported again by an agent that adopts the engine.
    dialect: EngineDialect | None = None
    # It listens with TLS (EngineLaunch.tls): probed, and reported, as https.
    # Behind a guard: the guard listens with TLS, the engine on loopback never.
    tls: bool = False
    # Behind a guard (agent.engineguard): the loopback port the engine
    # listens on, while ``port`` is the guard's. None: the engine listens on
    # ``port`` itself.
    engine_port: int | None = None
    started_at: float | None = None
    ready_at: float | None = None
    # The engine's memory budget (agent.memguard), held again on adoption.
    memory_budget_mib: int | None = None
    failed: bool = False
    exit_code: int | None = None
    reason: str | None = None


class _StateFile(BaseModel):
    version: int = 1
    engines: dict[str, EngineRecord] = Field(default_factory=dict)


class StateStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._records: dict[str, EngineRecord] = {}

    def load(self) -> dict[str, EngineRecord]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            self._records = {}
            return {}
        try:
            self._records = dict(_StateFile.model_validate_json(raw).engines)
        except PydanticValidationError as exc:
            # Keep the bad file for a person to read; starting empty means the
            # engines it named run unsupervised, which the log line says.
            keep = self.path.with_suffix(".corrupt")
            os.replace(self.path, keep)
            log.error("engine state %s unreadable (%s); kept as %s", self.path, exc, keep)
            self._records = {}
        return dict(self._records)

    def records(self) -> dict[str, EngineRecord]:
        return dict(self._records)

    def put(self, record: EngineRecord) -> None:
        self._records[record.replica_id] = record
        self._save()

    def remove(self, replica_id: str) -> None:
        if self._records.pop(replica_id, None) is not None:
            self._save()

    def _save(self) -> None:
        data = _StateFile(engines=self._records).model_dump_json(indent=1).encode()
        write_atomic(self.path, data, mode=0o600)


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replace ``path`` with ``data`` so that readers see the old or the new file, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
