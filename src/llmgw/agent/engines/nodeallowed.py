"""What a node's admin lets the catalog set beyond an engine adapter's own checks.

The wrappers (agent.engines.nodeargs, agent.engines.nodeenv) take what the
node allows out of an assignment before the adapter checks or builds it, so
that the adapter's own checks stay the catalog's, and put it into the
adapter's launch afterwards.
"""

from __future__ import annotations

import dataclasses
from typing import Generic, TypeVar

from llmgw.agent.engines.base import EngineAdapter, EngineLaunch, LaunchContext
from llmgw.wire import EngineKind, ReplicaAssignment

# What the node allows, as taken out of an assignment (empty: nothing).
Extra = TypeVar("Extra", list[str], dict[str, str])


class NodeAllowed(Generic[Extra]):
    """``inner``, with what :meth:`_split` takes out passed on unchecked by it."""

    def __init__(self, inner: EngineAdapter) -> None:
        self.inner = inner
        self.kind: EngineKind = inner.kind

    # What the wrapped engine is, the wrapper is: read through, never copied
    # (llama-server's depends on the binary the adapter found).
    @property
    def guards_every_route(self) -> bool:
        return self.inner.guards_every_route

    @property
    def adapters_at_start(self) -> bool:
        return self.inner.adapters_at_start

    def _split(self, assignment: ReplicaAssignment) -> tuple[ReplicaAssignment, Extra]:
        """The assignment without what the node allows, and that (checked here)."""
        raise NotImplementedError

    def _add(self, launch: EngineLaunch, extra: Extra) -> EngineLaunch:
        """The adapter's launch with ``extra`` in it."""
        raise NotImplementedError

    def validate(self, assignment: ReplicaAssignment) -> None:
        self.inner.validate(self._split(assignment)[0])

    def build(self, ctx: LaunchContext) -> EngineLaunch:
        assignment, extra = self._split(ctx.assignment)
        launch = self.inner.build(dataclasses.replace(ctx, assignment=assignment))
        return self._add(launch, extra) if extra else launch
