"""How many requests one replica of a model runs at once, as far as the catalog says.

The gateway holds a model's requests beyond that in its own queue, where it
can order them by class and share them fairly between teams
(llmgw.gateway.admission); an engine sent more queues them first come, first
served. Only a number the catalog states is used: the entry's
``max_concurrency``, else the engine's own limit where its arguments set it
(vLLM's and SGLang's ``--max-num-seqs``/``--max-running-requests``,
llama-server's ``--parallel``), else the simulator's ``max_running`` when the
entry sets it. An engine's built-in default is not used: vLLM's 256 or
1024 sequences say what its scheduler may batch, not where its latency
turns, and a cap guessed low would throttle a fleet that never asked for one.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmgw.wire import EngineKind, ModelSpec

# The engine argument that bounds its running requests, per engine.
_FLAGS: dict[EngineKind, tuple[str, ...]] = {
    EngineKind.VLLM: ("--max-num-seqs",),
    EngineKind.SGLANG: ("--max-running-requests",),
    EngineKind.LLAMA_SERVER: ("--parallel", "-np"),
}


def replica_concurrency(spec: ModelSpec) -> int | None:
    """Requests one replica of ``spec`` runs at once; None where the catalog does not say."""
    if spec.max_concurrency is not None:
        return spec.max_concurrency
    if spec.engine is EngineKind.SIM:
        sim = spec.sim
        stated = sim is not None and "max_running" in sim.model_fields_set
        return sim.max_running if sim is not None and stated else None
    flags = _FLAGS.get(spec.engine)
    return _flag_value(spec.engine_args, flags) if flags else None


def _flag_value(args: Sequence[str], flags: tuple[str, ...]) -> int | None:
    """The last value given to any of ``flags`` (``--flag N`` or ``--flag=N``), if a count."""
    found: int | None = None
    for i, arg in enumerate(args):
        name, eq, inline = arg.partition("=")
        if name not in flags:
            continue
        raw = inline if eq else (args[i + 1] if i + 1 < len(args) else "")
        if raw.isdigit() and int(raw) > 0:
            found = int(raw)
    return found
