"""A node with fake GPUs whose real agent serves /metrics, in a process of its own.

The simulated fleet's agents run no server (docs/metrics.md), so the
per-device families need one agent that does: this is the real ``Agent``
with the fake NVML (a card in MIG mode with two instances, a whole card, a
card with uncorrected ECC errors) and in-process sim engines. Killing the
process is a node lost at once, engines and all.

    python -m tests.deploy.gpu_node UP_JSON DATA_DIR SERVER_PORT

It may start before ``llmgw up`` has written UP_JSON (where it finds the
control plane and the join token), so that its imports overlap with up's.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from tests.agent.helpers import fake_gpu_node
from tests.waiting import eventually_sync

from llmgw.agent.app import Agent, AgentConfig
from llmgw.agent.discoverer import Discoverer
from llmgw.agent.engines.sim import SimAdapter
from llmgw.sim.inprocess import InProcessEngines
from llmgw.wire import EngineKind

NAME = "gpu-node"


def wait_for(up_json: Path, within_s: float = 120.0) -> dict[str, str]:
    eventually_sync(up_json.exists, within_s, what=str(up_json), every_s=0.1)
    return dict(json.loads(up_json.read_text()))


async def main(up_json: Path, data_dir: Path, server_port: int) -> None:
    info = wait_for(up_json)
    agent = Agent(
        AgentConfig(control_plane=info["admin_url"], data_dir=data_dir, name=NAME,
                    join_token=info["join_token"], fabrics=["ib-a"], server_port=server_port,
                    report_interval_s=1.0, stop_grace_s=1.0),
        inventory_provider=Discoverer(nvml=fake_gpu_node("node-")),
        adapters={EngineKind.SIM: SimAdapter()},
        supervisor=InProcessEngines(),
    )
    await agent.start()
    await agent.run()


if __name__ == "__main__":
    up_json, where, port = sys.argv[1:4]
    asyncio.run(main(Path(up_json), Path(where), int(port)))
