"""The model catalog: reading entries from YAML/JSON and the rules across fields.

pydantic (``wire.ModelSpec``) checks each field on its own; the rules here
span fields and entries (MIG limits, ``gpus = tp * pp``, names unique across
the catalog). Every problem is collected and reported at once, one per line,
naming the model, the field and the rule: an operator fixing a 40-entry file
one error per ``apply`` would give up, and a message without the field sends
them hunting through the file.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import yaml
from pydantic import ValidationError as PydanticValidationError

from llmgw import memory
from llmgw.control.adaptercheck import adapter_problems
from llmgw.engine_env import env_problem
from llmgw.errors import ValidationError
from llmgw.wire import LLAMACPP_KINDS, EngineKind, ModelSpec, is_mig_class

# Environment names engines will see; anything else is either a typo or an
# attempt to smuggle something odd into a process environment.
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True, slots=True)
class CatalogDiff:
    """What ``apply`` would do to the catalog (``apply --dry-run`` shows it)."""

    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    # For each changed model, the top-level fields that differ.
    changed_fields: dict[str, list[str]] = field(default_factory=dict)


# ---------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------


def parse_models(text: str, *, source: str = "models.yaml") -> list[ModelSpec]:
    """Read catalog entries: a list, a single entry, or ``{models: [...]}``.

    YAML is a superset of JSON, so one parser reads both. Field errors of all
    entries are collected before raising, each naming the entry.
    """
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValidationError(f"{source}{where}: not valid YAML or JSON: {problem}") from None
    entries = _entries(document, source)
    specs: list[ModelSpec] = []
    problems: list[str] = []
    for position, entry in enumerate(entries, start=1):
        label = _entry_label(entry, position)
        if not isinstance(entry, dict):
            problems.append(f"{source}: {label}: must be a mapping of fields, got {_kind(entry)}")
            continue
        try:
            specs.append(ModelSpec.model_validate(entry))
        except PydanticValidationError as exc:
            for error in exc.errors():
                where = _field_path(error.get("loc", ()))
                problems.append(f"{source}: {label}: field {where!r}: {error['msg']}")
    if problems:
        raise ValidationError("\n".join(problems), field=None)
    return specs


def _entries(document: Any, source: str) -> list[Any]:
    if document is None:
        raise ValidationError(f"{source}: no models: the document is empty")
    if isinstance(document, list):
        entries = document
    elif isinstance(document, dict) and set(document) == {"models"}:
        entries = document["models"]
        if not isinstance(entries, list):
            raise ValidationError(
                f"{source}: field 'models': must be a list of entries, got {_kind(entries)}",
                field="models",
            )
    elif isinstance(document, dict):
        entries = [document]
    else:
        raise ValidationError(
            f"{source}: expected a list of models, one model, or {{models: [...]}},"
            f" got {_kind(document)}"
        )
    if not entries:
        raise ValidationError(f"{source}: no models: the list is empty")
    return entries


def _entry_label(entry: Any, position: int) -> str:
    name = entry.get("name") if isinstance(entry, dict) else None
    if isinstance(name, str) and name:
        return f"model {name!r} (entry {position})"
    return f"entry {position}"


def _field_path(loc: Iterable[int | str]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "(entry)"


def _kind(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return "a string"
    return type(value).__name__


# ---------------------------------------------------------------------------
# Cross-field and cross-entry rules
# ---------------------------------------------------------------------------


def validate_catalog(
    specs: list[ModelSpec],
    existing: dict[str, ModelSpec] | None = None,
    node_env_allow: Collection[str] = (),
) -> None:
    """Raise ValidationError listing every rule ``specs`` break, one per line.

    ``existing`` is the catalog the specs are applied to: an entry with the
    same name replaces its existing one, every other existing model keeps its
    name and aliases, so the new entries must not collide with them.
    ``node_env_allow``: env names some node's admin allows beyond an engine's
    own settings (llmgw.engine_env); that node's agent checks them again, and
    every other node refuses them.
    """
    problems: list[Problem] = []
    merged = {**(existing or {}), **{s.name: s for s in specs}}
    for spec in specs:
        if spec.is_adapter:
            problems.extend(_problem(spec, f, rule) for f, rule in adapter_problems(spec, merged))
            continue
        if spec.engine is EngineKind.EXTERNAL or spec.external is not None:
            problems.extend(_external_problems(spec))
            continue
        problems.extend(_shape_problems(spec))
        problems.extend(_argument_problems(spec, node_env_allow))
        problems.extend(_memory_problems(spec))
    # A changed base must still take the adapters already loaded on it.
    applied = {s.name for s in specs}
    for name, kept in (existing or {}).items():
        if name not in applied and kept.base in applied:
            problems.extend(
                _problem(kept, f, f"{rule} (after the change to {kept.base!r})")
                for f, rule in adapter_problems(kept, merged)
            )
    problems.extend(_name_problems(specs, existing or {}))
    if problems:
        raise ValidationError("\n".join(p.line for p in problems), field=problems[0].field)


class Problem(NamedTuple):
    field: str
    line: str


def _problem(spec: ModelSpec, field_name: str, rule: str) -> Problem:
    return Problem(field_name, f"model {spec.name!r}: field {field_name!r}: {rule}")


def _shape_problems(spec: ModelSpec) -> list[Problem]:
    problems: list[Problem] = []
    # One process opens one MIG instance, and instances have no NVLink
    # between them: a sharded replica on MIG could never start.
    for gpu_class in spec.gpu_classes:
        if not is_mig_class(gpu_class):
            continue
        for name in ("tp", "pp", "gpus", "nodes"):
            value = getattr(spec, name)
            if value > 1:
                problems.append(
                    _problem(
                        spec,
                        name,
                        f"must be 1 on MIG class {gpu_class!r} (got {value}): a replica on MIG"
                        " runs on exactly one instance",
                    )
                )
    if spec.gpus != spec.tp * spec.pp:
        problems.append(
            _problem(
                spec,
                "gpus",
                f"must equal tp * pp = {spec.tp} * {spec.pp} = {spec.tp * spec.pp}"
                f" (got {spec.gpus})",
            )
        )
    if spec.gpus % spec.nodes:
        problems.append(
            _problem(
                spec,
                "nodes",
                f"gpus ({spec.gpus}) must divide evenly over nodes ({spec.nodes}):"
                " every node of a replica holds the same number of devices",
            )
        )
    if spec.min_replicas > spec.max_replicas:
        problems.append(
            _problem(
                spec,
                "min_replicas",
                f"must not exceed max_replicas ({spec.min_replicas} > {spec.max_replicas})",
            )
        )
    elif spec.max_replicas < 1:
        problems.append(
            _problem(spec, "max_replicas", "must be at least 1, or the model can never serve")
        )
    if len(set(spec.gpu_classes)) != len(spec.gpu_classes):
        problems.append(_problem(spec, "gpu_classes", "lists a class twice"))
    # Prompt and answer share one replica's KV cache: a cap at or above its
    # size could never be reached, and reads as a limit that is not one.
    cap = spec.max_output_tokens
    if cap is not None and cap >= spec.kv_capacity_tokens:
        problems.append(
            _problem(
                spec,
                "max_output_tokens",
                f"must be below kv_capacity_tokens ({cap} >= {spec.kv_capacity_tokens}):"
                " the prompt needs room in the same context",
            )
        )
    return problems


# What only an engine llmgw runs reads: set on an external model, each would
# read as a setting that is not one (no replica is ever placed or started).
_ENGINE_ONLY = ("weights", "gpu_classes", "gpus", "tp", "pp", "nodes", "engine_args", "env",
                "secret_env", "memory_mib", "sim", "start_timeout_s")


def _external_problems(spec: ModelSpec) -> list[Problem]:
    """An entry naming servers llmgw does not run (ModelSpec.external)."""
    if spec.external is None:
        return [_problem(spec, "external", "engine external needs an 'external' block listing"
                         " the servers' urls")]
    problems: list[Problem] = []
    if spec.engine is not EngineKind.EXTERNAL:
        problems.append(_problem(spec, "engine", f"a model with 'external' runs no engine: remove"
                                 f" engine ({spec.engine.value}) or set it to external"))
    defaults = ModelSpec(name=spec.name, engine=EngineKind.EXTERNAL)
    for name in _ENGINE_ONLY:
        if getattr(spec, name) != getattr(defaults, name):
            problems.append(_problem(spec, name, "applies only to an engine llmgw runs; an"
                                     " external model's servers run elsewhere: remove it"))
    if spec.on_demand:
        problems.append(_problem(spec, "min_replicas", "must be at least 1: an external model's"
                                 " servers are always there, nothing is started on demand"))
    cap = spec.max_output_tokens
    if cap is not None and cap >= spec.kv_capacity_tokens:
        problems.append(_problem(spec, "max_output_tokens", f"must be below kv_capacity_tokens"
                                 f" ({cap} >= {spec.kv_capacity_tokens})"))
    return problems


def _argument_problems(spec: ModelSpec, node_env_allow: Collection[str]) -> list[Problem]:
    problems: list[Problem] = []
    # Engine arguments become argv items (never a shell line): a NUL cannot be
    # passed to exec at all, and a newline is almost always a YAML block
    # scalar that glued two options into one.
    for index, arg in enumerate(spec.engine_args):
        if not isinstance(arg, str):
            problems.append(_problem(spec, f"engine_args[{index}]", "must be a string"))
        elif "\x00" in arg or "\n" in arg or "\r" in arg:
            problems.append(
                _problem(spec, f"engine_args[{index}]", "must not contain NUL or a line break")
            )
    for key, value in spec.env.items():
        if not _ENV_NAME_RE.match(key):
            problems.append(
                _problem(
                    spec, f"env.{key}", "name must be letters, digits and _, not a digit first"
                )
            )
        if "\x00" in value:
            problems.append(_problem(spec, f"env.{key}", "value must not contain NUL"))
        # Variables the engine reads as settings over the agent's command
        # line, or that are not its settings at all (llmgw.engine_env, the
        # agent's own check): refused now, not when a replica fails.
        reason = env_problem(spec.engine, key, node_env_allow)
        if reason is not None:
            problems.append(_problem(spec, f"env.{key}", reason))
    return problems


def _memory_problems(spec: ModelSpec) -> list[Problem]:
    """A stated memory need too small for the engine's fixed part and its context.

    Such an engine would be failed for its budget as soon as it loaded, on
    every node, until the model is parked: refusing the entry says why now.
    """
    if spec.memory_mib is None or spec.engine not in LLAMACPP_KINDS:
        return []
    floor = memory.LLAMACPP_RUNTIME_MIB + memory.kv_cache_mib(spec)
    if spec.memory_mib >= floor:
        return []
    return [
        _problem(
            spec,
            "memory_mib",
            f"{spec.memory_mib} MiB is below what llama.cpp needs before its weights"
            f" ({floor} MiB: {memory.LLAMACPP_RUNTIME_MIB} MiB runtime and the KV cache of"
            f" {memory.context_tokens(spec)} tokens of context); raise it or lower the"
            " context (kv_capacity_tokens)",
        )
    ]


def _name_problems(specs: list[ModelSpec], existing: dict[str, ModelSpec]) -> list[Problem]:
    problems: list[Problem] = []
    # Names and aliases share one namespace: a request names either, and an
    # ambiguous one would be routed to whichever model the lookup met first.
    first_entry: dict[str, int] = {}
    for position, spec in enumerate(specs, start=1):
        if spec.name in first_entry:
            problems.append(
                _problem(
                    spec,
                    "name",
                    f"defined twice in this catalog (entries {first_entry[spec.name]} and"
                    f" {position})",
                )
            )
        else:
            first_entry[spec.name] = position

    # Who owns each name once the specs are applied: the new entries, then the
    # existing models they do not replace.
    owner: dict[str, str] = {}  # name or alias -> "model 'x'" / "alias of model 'x'"
    kept = {n: s for n, s in existing.items() if n not in first_entry}
    for name in kept:
        owner[name] = f"the name of model {name!r}"
    for name in first_entry:
        owner.setdefault(name, f"the name of model {name!r}")
    for name, spec in kept.items():
        for alias in spec.aliases:
            owner.setdefault(alias, f"an alias of model {name!r}")

    seen_aliases: dict[str, str] = {}
    for spec in specs:
        for alias in spec.aliases:
            if alias == spec.name:
                problems.append(_problem(spec, "aliases", f"alias {alias!r} repeats its own name"))
                continue
            taken = owner.get(alias)
            if taken is not None:
                problems.append(_problem(spec, "aliases", f"alias {alias!r} is already {taken}"))
            elif alias in seen_aliases and seen_aliases[alias] != spec.name:
                problems.append(
                    _problem(
                        spec,
                        "aliases",
                        f"alias {alias!r} is also an alias of model {seen_aliases[alias]!r}",
                    )
                )
            elif alias in seen_aliases:
                problems.append(_problem(spec, "aliases", f"alias {alias!r} is listed twice"))
            seen_aliases.setdefault(alias, spec.name)
    return problems


# ---------------------------------------------------------------------------
# Diff (apply --dry-run)
# ---------------------------------------------------------------------------


def diff_catalog(current: dict[str, ModelSpec], new: list[ModelSpec]) -> CatalogDiff:
    """Which of ``new`` would be added, changed or left as they are."""
    diff = CatalogDiff()
    for spec in sorted(new, key=lambda s: s.name):
        old = current.get(spec.name)
        if old is None:
            diff.added.append(spec.name)
            continue
        before, after = old.model_dump(mode="json"), spec.model_dump(mode="json")
        fields = sorted(k for k in after if before.get(k) != after[k])
        if fields:
            diff.changed.append(spec.name)
            diff.changed_fields[spec.name] = fields
        else:
            diff.unchanged.append(spec.name)
    return diff


# Fields only the gateway reads, through the routing table: changing them
# must not restart a model's engines (a new output cap is not worth a reload).
GATEWAY_FIELDS = frozenset({"aliases", "routing", "max_output_tokens", "max_concurrency"})


def engine_changed(old: ModelSpec, new: ModelSpec) -> bool:
    """Whether replicas started under ``old`` must restart to run ``new``."""
    return old.model_dump(exclude=set(GATEWAY_FIELDS)) != new.model_dump(
        exclude=set(GATEWAY_FIELDS)
    )


# Fields whose change alters where or how many devices a replica holds: a
# replica started under the old entry is replaced, not restarted in place.
PLACEMENT_FIELDS = frozenset({"gpu_classes", "gpus", "tp", "pp", "nodes"})


def placement_changed(old: ModelSpec, new: ModelSpec) -> bool:
    return any(getattr(old, f) != getattr(new, f) for f in PLACEMENT_FIELDS)
