"""The fleet spec: a YAML document describing simulated nodes and the sim models to run.

A scale test or a demo wants "fifty 8-GPU H100 nodes in fabric ib-a, two of
each node's cards in MIG mode, one sick GPU per node" in one line, not fifty
inventories. The spec says it by groups::

    fabrics: [ib-a, ib-b]
    nodes:
      - count: 50
        class: h100-80g
        gpus: 8
        fabric: ib-a
        mig: {cards: 2, profile: 3g.40gb, instances: 2}
        unhealthy: 1
      - {count: 4, class: cpu, cpu_slots: 2, fabric: ib-b}
    models:            # optional: catalog entries, engine sim only
      - {name: sim-chat, engine: sim, gpu_classes: [h100-80g], min_replicas: 4, max_replicas: 4}

Every mistake is reported with the file and the field it is in
("fleet.yaml: nodes[0].mig.cards: 9 cards in MIG mode but the node has 8 gpus"),
never as a traceback: a spec is typed by hand.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmgw.errors import ValidationError
from llmgw.wire import CPU_CLASS, NAME_PATTERN, EngineKind, ModelSpec

# Cards per node and instances per card stay inside the placement numbering
# (wire.mig_number leaves 100 instance slots per card below 1000 cards).
MAX_GPUS_PER_NODE = 64
MAX_MIG_INSTANCES = 7  # the most any NVIDIA card carves (A100/H100: 7 x 1g)
MAX_NODES = 5000

_NAME_RE = re.compile(NAME_PATTERN)
_CLASS_RE = re.compile(r"^[a-z0-9][a-z0-9.+-]{0,80}$")
_PROFILE_RE = re.compile(r"^(\d+c\.)?\d+g\.\d+gb(\+me)?$")


def _matching(pattern: re.Pattern[str], value: str, what: str) -> str:
    if not pattern.match(value):
        raise ValueError(f"{value!r} is not {what}")
    return value


class _Spec(BaseModel):
    # A misspelt key ("unhealty: 1") must fail, not silently give a healthy fleet.
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class MigSpec(_Spec):
    """Cards of a node in MIG mode: the first ``cards`` cards, each carved alike."""

    cards: int = Field(ge=1, le=MAX_GPUS_PER_NODE)
    profile: str = "3g.40gb"
    # 0 is allowed on purpose: a card in MIG mode with nothing carved is a
    # state real fleets are in, and it must show as unplaceable with its reason.
    instances: int = Field(2, ge=0, le=MAX_MIG_INSTANCES)

    @field_validator("profile")
    @classmethod
    def _profile(cls, value: str) -> str:
        return _matching(_PROFILE_RE, value, "a MIG profile; write it as the driver does,"
                         " e.g. 3g.40gb, 1g.10gb+me or 1c.3g.40gb")


class NodeGroup(_Spec):
    """``count`` identical nodes."""

    count: int = Field(ge=1, le=MAX_NODES)
    gpu_class: str = Field(alias="class")
    gpus: int = Field(8, ge=0, le=MAX_GPUS_PER_NODE)
    # CPU slots for class ``cpu`` nodes (a node without GPUs offers slots).
    cpu_slots: int = Field(1, ge=0, le=256)
    fabric: str | None = None
    fabrics: list[str] = Field(default_factory=list)
    mig: MigSpec | None = None
    # The last ``unhealthy`` cards of each node report uncorrectable ECC errors.
    unhealthy: int = Field(0, ge=0, le=MAX_GPUS_PER_NODE)
    # Node names are ``<name>-<n>``; default: the class.
    name: str | None = None
    # GPU memory per card in MiB; default: the GB in the class name (h100-80g -> 80 GB).
    memory_mib: int | None = Field(None, ge=1)

    @field_validator("gpu_class")
    @classmethod
    def _class(cls, value: str) -> str:
        _matching(_CLASS_RE, value, "a GPU class: lower-case letters, digits and . + -,"
                  " e.g. h100-80g or cpu")
        if "-mig-" in value:
            raise ValueError(
                f"{value!r} is a MIG instance class; give the card's class and a `mig:` block"
            )
        return value

    @field_validator("name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        return value if value is None else _matching(_NAME_RE, value, "a valid node name prefix")

    @model_validator(mode="after")
    def _consistent(self) -> NodeGroup:
        if self.fabric is not None and self.fabrics:
            raise ValueError("give either fabric or fabrics, not both")
        if self.gpu_class == CPU_CLASS:
            if self.mig is not None or self.unhealthy:
                raise ValueError("a cpu node has no GPUs: remove mig and unhealthy")
            return self
        if self.gpus == 0:
            raise ValueError(f"a {self.gpu_class} node needs gpus >= 1 (or use class: cpu)")
        if self.mig is not None and self.mig.cards > self.gpus:
            raise ValueError(
                f"mig.cards: {self.mig.cards} cards in MIG mode but the node has {self.gpus} gpus"
            )
        if self.unhealthy > self.gpus:
            raise ValueError(f"unhealthy: {self.unhealthy} but the node has {self.gpus} gpus")
        if self.memory_mib is None and card_memory_gb(self.gpu_class) is None:
            raise ValueError(
                f"class {self.gpu_class!r} names no memory size (like h100-80g); give memory_mib"
            )
        return self

    @property
    def node_fabrics(self) -> list[str]:
        return [self.fabric] if self.fabric is not None else list(self.fabrics)

    @property
    def prefix(self) -> str:
        return self.name or self.gpu_class


class FleetSpec(_Spec):
    fabrics: list[str] = Field(default_factory=list)
    nodes: list[NodeGroup] = Field(min_length=1)
    models: list[ModelSpec] = Field(default_factory=list)

    @field_validator("fabrics")
    @classmethod
    def _fabric_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not _NAME_RE.match(name):
                raise ValueError(f"{name!r} is not a valid fabric name")
        if len(set(value)) != len(value):
            raise ValueError("a fabric is listed twice")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> FleetSpec:
        total = sum(g.count for g in self.nodes)
        if total > MAX_NODES:
            raise ValueError(f"nodes: {total} nodes in all; at most {MAX_NODES}")
        declared = set(self.fabrics)
        for i, group in enumerate(self.nodes):
            for fabric in group.node_fabrics:
                if not _NAME_RE.match(fabric):
                    raise ValueError(f"nodes[{i}].fabric: {fabric!r} is not a valid name")
                if declared and fabric not in declared:
                    raise ValueError(
                        f"nodes[{i}].fabric: {fabric!r} is not in fabrics"
                        f" ({', '.join(self.fabrics)})"
                    )
        for i, model in enumerate(self.models):
            if model.engine != EngineKind.SIM:
                raise ValueError(
                    f"models[{i}].engine: the simulated fleet runs only sim engines,"
                    f" not {model.engine.value!r}"
                )
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError("models: a model name is used twice")
        return self

    @property
    def node_count(self) -> int:
        return sum(g.count for g in self.nodes)


def card_memory_gb(gpu_class: str) -> int | None:
    """80 for ``h100-80g``; None when the class names no size."""
    found = re.search(r"-(\d{1,4})g$", gpu_class)
    return int(found.group(1)) if found else None


def parse_fleet_spec(text: str, source: str = "fleet spec") -> FleetSpec:
    """A FleetSpec from YAML (or JSON) text; ValidationError naming file and field."""
    try:
        data: Any = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValidationError(f"{source}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ValidationError(f"{source}: expected a mapping with a `nodes:` list")
    try:
        return FleetSpec.model_validate(data)
    except pydantic.ValidationError as exc:
        raise ValidationError(f"{source}: {describe_errors(exc)}") from None


def load_fleet_spec(path: str | Path) -> FleetSpec:
    """Read and check a fleet spec file (``spec.models`` are the sim catalog entries)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValidationError(f"cannot read fleet spec {path}: {exc.strerror or exc}") from None
    return parse_fleet_spec(text, source=str(path))


def describe_errors(exc: pydantic.ValidationError) -> str:
    """pydantic's errors as ``nodes[0].mig.cards: message`` lines joined by ``; ``."""
    parts = []
    for error in exc.errors():
        where = ""
        for item in error["loc"]:
            where += f"[{item}]" if isinstance(item, int) else (f".{item}" if where else str(item))
        message = str(error["msg"]).removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)
