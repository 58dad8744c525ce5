"""The node admin's escape hatch: catalog ``env`` names this node allows beyond an engine's own.

A catalog entry may set only an engine's own settings (llmgw.engine_env).
Where a node's admin has a reason to let the catalog set more (a driver's
``LD_LIBRARY_PATH`` on an odd machine), they list the names on that node
(``llmgw agent --engine-env-allow NAME``): the admin token alone never
widens what reaches an engine's environment. The adapter itself never sees
those names, so its checks stay the catalog's; they are checked here for
shape, device pinning and the names the agent manages, and added to the
launch under the pinning.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from llmgw.agent.engines.base import EngineAdapter, EngineLaunch, validate_env
from llmgw.agent.engines.nodeallowed import NodeAllowed
from llmgw.wire import ReplicaAssignment


class NodeEnvAllowed(NodeAllowed[dict[str, str]]):
    """``inner``, with the catalog's ``env`` names in ``allowed`` passed on unchecked by it."""

    def __init__(self, inner: EngineAdapter, allowed: Collection[str]) -> None:
        super().__init__(inner)
        self.allowed = frozenset(allowed)

    def _split(self, assignment: ReplicaAssignment) -> tuple[ReplicaAssignment, dict[str, str]]:
        env = assignment.model.env
        extra = {name: value for name, value in env.items() if name in self.allowed}
        if not extra:
            return assignment, {}
        validate_env(extra, assignment.model.engine, self.allowed)
        kept = {name: value for name, value in env.items() if name not in extra}
        model = assignment.model.model_copy(update={"env": kept})
        return assignment.model_copy(update={"model": model}), extra

    def _add(self, launch: EngineLaunch, extra: dict[str, str]) -> EngineLaunch:
        # Under what the adapter set (device pinning, the engine key).
        return dataclasses.replace(launch, env={**extra, **launch.env})
