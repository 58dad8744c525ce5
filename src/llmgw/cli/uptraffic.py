"""``llmgw up --sim ... --traffic RATE``: the demo keys and the traffic task (llmgw.sim.traffic).

The demo keys are ordinary API keys made through the control plane, so the
usage page shows them by name. Their secrets are kept in the data dir
(``traffic-keys.json``, owner-only, like ``up.json``) so that a restarted
demo reuses them instead of adding three keys per start; a kept key that was
revoked or deleted since is replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from pathlib import Path

from llmgw.control.plane import ControlPlane
from llmgw.errors import ConfigError
from llmgw.sim.traffic import DEMO_KEYS, Traffic, TrafficKey, TrafficModel

log = logging.getLogger(__name__)

KEYS_FILE = "traffic-keys.json"
MAX_RATE = 1000.0


def check_rate(rate: float | None, sim: bool) -> None:
    if rate is None:
        return
    if not sim:
        raise ConfigError("--traffic drives a simulated fleet: give --sim FLEET.yaml as well "
                          "(real engines on this machine would be swamped)")  # fmt: skip
    if not 0 < rate <= MAX_RATE:
        raise ConfigError(f"--traffic must be above 0 and at most {MAX_RATE:g} requests/s")


async def demo_keys(cp: ControlPlane, data_dir: Path) -> list[TrafficKey]:
    path = data_dir / KEYS_FILE
    kept: dict[str, dict[str, str]] = {}
    with contextlib.suppress(OSError, ValueError):
        kept = json.loads(path.read_text())
    live = {k.key_id for k in cp.keys.all() if not k.revoked}
    keys: list[TrafficKey] = []
    changed = False
    for name, weight in DEMO_KEYS:
        entry = kept.get(name)
        if not isinstance(entry, dict) or entry.get("key_id") not in live:
            info, secret = await cp.keys.create(name=name)
            entry = kept[name] = {"key_id": info.key_id, "secret": secret}
            changed = True
        keys.append(TrafficKey(name, entry["secret"], weight))
    if changed:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(kept, out, indent=2)
    return keys


def start_traffic(
    cp: ControlPlane, api_url: str, rate: float, keys: list[TrafficKey]
) -> asyncio.Task[None]:
    def catalog() -> list[TrafficModel]:
        # Read per request from the control plane's memory: a model applied
        # or deleted during the demo joins or leaves the traffic at once.
        return [
            TrafficModel(m.name, m.spec.on_demand, m.spec.idle_timeout_s)
            for m in cp.state.models.values()
            if not m.parked and m.spec.external is None
        ]

    traffic = Traffic(api_url, rate, keys, catalog)
    task = asyncio.create_task(traffic.run(), name="demo-traffic")
    task.add_done_callback(_log_exit)
    return task


def _log_exit(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("demo traffic stopped: %s", task.exception())
