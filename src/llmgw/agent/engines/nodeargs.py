"""The node admin's escape hatch for an engine flag that runs a model's own code.

``--trust-remote-code`` (vLLM, SGLang) makes the engine import the Python
files of the model's repository: whoever names the weights source in the
catalog (the admin token) would run code on every node the model lands on.
The weights are held to the digests recorded from their source
(docs/security.md, Trusted weights), but the source is whatever the catalog
names. So the adapters refuse the flag like the flags the agent manages, and
only a node's own admin may let it through on that node
(``llmgw agent --engine-flag-allow trust-remote-code``): the admin token
alone never turns it on.

Only flags that take no value can be allowed (:data:`NODE_ALLOWABLE`); the
flags that import code by a module path or a file (``--worker-cls``,
``--middleware``...) stay refused everywhere, since a node admin who wants
such code runs it as a plugin installed with the engine, not as a path
the catalog names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable

from llmgw.agent.engines import sglang, vllm
from llmgw.agent.engines.base import EngineAdapter, EngineLaunch, FlagRules
from llmgw.agent.engines.nodeallowed import NodeAllowed
from llmgw.errors import ConfigError
from llmgw.wire import EngineKind, ReplicaAssignment

# Flags a node's admin may allow, each a switch without a value.
NODE_ALLOWABLE = frozenset({"--trust-remote-code"})
# How each engine reads its flags (abbreviations, ``_`` for ``-``), so that an
# allowed flag is recognised in every spelling the engine accepts.
_RULES: dict[EngineKind, FlagRules] = {
    EngineKind.VLLM: vllm.MANAGED_FLAGS,
    EngineKind.SGLANG: sglang.MANAGED_FLAGS,
}


def parse_allowed(items: Iterable[str]) -> frozenset[str]:
    """``--engine-flag-allow`` values (``trust-remote-code``, ``--trust_remote_code``,
    comma-separated lists) as the flags they name; ConfigError for any other flag."""
    flags = set()
    for item in items:
        for name in item.split(","):
            name = name.strip().lstrip("-").replace("_", "-")
            if not name:
                continue
            flag = f"--{name}"
            if flag not in NODE_ALLOWABLE:
                allowable = ", ".join(sorted(f.removeprefix("--") for f in NODE_ALLOWABLE))
                raise ConfigError(f"--engine-flag-allow {name!r}: a node may allow only"
                                  f" {allowable}")
            flags.add(flag)
    return frozenset(flags)


class NodeFlagsAllowed(NodeAllowed[list[str]]):
    """``inner``, with the catalog's ``engine_args`` that set a flag in ``allowed``
    passed on unchecked by it (appended to its launch)."""

    def __init__(self, inner: EngineAdapter, allowed: Collection[str]) -> None:
        super().__init__(inner)
        self.allowed = frozenset(allowed) & NODE_ALLOWABLE
        self._rules = _RULES.get(inner.kind)

    def _split(self, assignment: ReplicaAssignment) -> tuple[ReplicaAssignment, list[str]]:
        rules, args = self._rules, assignment.model.engine_args
        if rules is None or not self.allowed:
            return assignment, []
        extra = [item for item in args
                 if isinstance(item, str) and rules.managed_flag(item) in self.allowed]
        if not extra:
            return assignment, []
        kept = [item for item in args if item not in extra]
        model = assignment.model.model_copy(update={"engine_args": kept})
        return assignment.model_copy(update={"model": model}), extra

    def _add(self, launch: EngineLaunch, extra: list[str]) -> EngineLaunch:
        # After the adapter's own argv, where the catalog's args go anyway.
        return dataclasses.replace(launch, argv=[*launch.argv, *extra])
