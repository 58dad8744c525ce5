"""Generated fleets and catalogs: node records as agents would report them.

Schedulers are tested against fake inventory (no peer tests placement on
real GPUs), and the benchmark, the property tests and demos of ``ctl plan``
need the same kinds of node: whole cards, MIG instances, cards in MIG mode
with nothing carved, unhealthy cards, CPU slots, fabrics and weights. The
devices go through discovery's own code (``build_devices``, ``cpu_devices``)
fed with made-up card facts, as the simulated fleet's do (sim/inventory.py),
so numbering, labels, classes and reasons are the agent's: a second,
hand-written copy of the MIG rules here would drift from them.
Pure: no I/O, seeded randomness only.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping

from llmgw.agent.discovery.base import CardFacts, HealthFacts, InstanceFacts
from llmgw.agent.discovery.devices import build_devices
from llmgw.agent.discovery.inventory import cpu_devices
from llmgw.control.state import FleetState, ModelRecord, NodeRecord
from llmgw.wire import (
    Device,
    EngineKind,
    ModelSpec,
    NodeInventory,
    NodeState,
    WeightsEntry,
)

CARD_MEMORY_MIB = {"h100-80g": 81559, "a100-80g": 81920, "l40s-48g": 46068, "l4-24g": 23034}
# What an unhealthy card reports: enough for discovery to call it unhealthy.
_ECC_ERRORS = HealthFacts(ecc_volatile_uncorrected=2)


def gpu_node(
    name: str,
    *,
    gpu_class: str = "h100-80g",
    gpus: int = 8,
    fabrics: Iterable[str] = ("ib-a",),
    mig: Mapping[int, tuple[str, int]] | None = None,
    unhealthy: Iterable[int] = (),
    weights: Iterable[str] = (),
    admin_state: NodeState = NodeState.READY,
    seen_at: float | None = 0.0,
) -> NodeRecord:
    """A node of ``gpus`` cards of one class.

    ``mig`` maps a card index to (profile, instances): that card is reported
    as its instances, or, with 0 instances, as a card out of placement.
    Cards are named after their class, which pins the class (an override
    by name, as an operator would write one).
    """
    mig = dict(mig or {})
    bad = set(unhealthy)
    memory = CARD_MEMORY_MIB.get(gpu_class, 40960)
    cards = []
    for card in range(gpus):
        profile, count = mig.get(card, ("", 0))
        cards.append(
            CardFacts(
                index=card,
                uuid=f"GPU-{name}-{card}",
                name=gpu_class,
                memory_total_mib=memory,
                mig_current=card in mig,
                mig_pending=card in mig,
                instances=[
                    InstanceFacts(
                        uuid=f"MIG-{name}-{card}-{instance}",
                        profile=profile,
                        gpu_instance_id=instance,
                        compute_instance_id=0,
                        memory_total_mib=memory // max(1, count),
                    )
                    for instance in range(1, count + 1)
                ],
                health=_ECC_ERRORS if card in bad else HealthFacts(),
            )
        )
    devices = build_devices(cards, class_overrides={gpu_class: gpu_class})
    return _node(name, devices, fabrics, weights, admin_state, seen_at)


def cpu_node(
    name: str,
    *,
    slots: int = 1,
    fabrics: Iterable[str] = (),
    weights: Iterable[str] = (),
    admin_state: NodeState = NodeState.READY,
    seen_at: float | None = 0.0,
) -> NodeRecord:
    """A node without GPUs: ``slots`` devices of class ``cpu``."""
    return _node(name, cpu_devices(slots, name), fabrics, weights, admin_state, seen_at)


def _node(
    name: str,
    devices: list[Device],
    fabrics: Iterable[str],
    weights: Iterable[str],
    admin_state: NodeState,
    seen_at: float | None,
) -> NodeRecord:
    return NodeRecord(
        name=name,
        registered_at=seen_at or 0.0,
        admin_state=admin_state,
        fabrics=list(fabrics),
        inventory=NodeInventory(hostname=name, source="fake", devices=devices),
        weights=[WeightsEntry(model=m) for m in weights],
        last_seen=seen_at,
    )


def model(
    name: str,
    *,
    gpus: int = 1,
    classes: Iterable[str] = ("h100-80g",),
    nodes: int = 1,
    min_replicas: int = 1,
    max_replicas: int | None = None,
    idle_timeout_s: float = 900.0,
    engine: EngineKind = EngineKind.SIM,
) -> ModelSpec:
    """A catalog entry of a valid shape: tp = devices per node, pp = nodes."""
    return ModelSpec(
        name=name,
        engine=engine,
        gpu_classes=list(classes),
        gpus=gpus,
        tp=gpus // nodes,
        pp=nodes,
        nodes=nodes,
        min_replicas=min_replicas,
        max_replicas=max(min_replicas, 1) if max_replicas is None else max_replicas,
        idle_timeout_s=idle_timeout_s,
    )


def fleet(nodes: Iterable[NodeRecord], models: Iterable[ModelSpec], now: float = 0.0) -> FleetState:
    state = FleetState()
    for node in nodes:
        state.nodes[node.name] = node
    for spec in models:
        state.models[spec.name] = ModelRecord(spec=spec, created_at=now, updated_at=now)
    return state


def generate(
    *,
    nodes: int = 2000,
    models: int = 1000,
    gpus_per_node: int = 8,
    fabrics: int = 4,
    mig_share: float = 0.10,
    unhealthy_share: float = 0.005,
    seed: int = 1,
    now: float = 0.0,
) -> FleetState:
    """A large mixed fleet and catalog (the benchmark's; see bench/scheduler.py).

    Classes by node, a share of cards in MIG mode (3g.40gb x2 or 1g.10gb x7,
    a few with nothing carved), one fabric per node, some unhealthy cards, a
    few cordoned and unreachable nodes. Models: mostly 1-2 GPUs, some 4 and
    8, a few 2-node x 8, MIG models, and on-demand ones.
    """
    rng = random.Random(seed)
    # In this order: each part draws from the one seeded generator.
    node_records = _nodes(rng, nodes, gpus_per_node, fabrics, mig_share, unhealthy_share, now)
    specs = _models(rng, models)
    _cache_weights(rng, node_records, specs)
    return fleet(node_records, specs, now)


_CLASSES = ["h100-80g", "a100-80g", "l40s-48g", "l4-24g"]
_CLASS_WEIGHTS = [4, 3, 2, 1]


def _nodes(
    rng: random.Random,
    nodes: int,
    gpus_per_node: int,
    fabrics: int,
    mig_share: float,
    unhealthy_share: float,
    now: float,
) -> list[NodeRecord]:
    classes, class_weights = _CLASSES, _CLASS_WEIGHTS
    node_records = []
    for index in range(nodes):
        gpu_class = rng.choices(classes, class_weights)[0]
        mig: dict[int, tuple[str, int]] = {}
        if gpu_class in ("h100-80g", "a100-80g"):
            for card in range(gpus_per_node):
                if rng.random() < mig_share * 1.4:
                    roll = rng.random()
                    mig[card] = (
                        ("3g.40gb", 2)
                        if roll < 0.6
                        else ("1g.10gb", 7)
                        if roll < 0.95
                        else ("3g.40gb", 0)
                    )
        unhealthy = [c for c in range(gpus_per_node) if rng.random() < unhealthy_share]
        name = f"node-{index:05d}"
        roll = rng.random()
        state = (
            NodeState.CORDONED
            if roll < 0.01
            else NodeState.DRAINING
            if roll < 0.015
            else NodeState.READY
        )
        seen: float | None = now if rng.random() > 0.005 else now - 1000.0
        node_records.append(
            gpu_node(
                name,
                gpu_class=gpu_class,
                gpus=gpus_per_node,
                fabrics=[f"ib-{index % fabrics}"],
                mig=mig,
                unhealthy=unhealthy,
                admin_state=state,
                seen_at=seen,
            )
        )
    return node_records


def _models(rng: random.Random, models: int) -> list[ModelSpec]:
    classes, class_weights = _CLASSES, _CLASS_WEIGHTS
    specs = []
    for index in range(models):
        roll = rng.random()
        gpu_class = rng.choices(classes, class_weights)[0]
        name = f"model-{index:04d}"
        if roll < 0.05:
            base = rng.choice(["h100-80g", "a100-80g"])
            spec = model(
                name,
                classes=[f"{base}-mig-{rng.choice(['3g.40gb', '1g.10gb'])}"],
                min_replicas=rng.randint(1, 3),
            )
        elif roll < 0.07:
            spec = model(name, gpus=16, nodes=2, classes=[rng.choice(["h100-80g", "a100-80g"])])
        elif roll < 0.12:
            spec = model(name, gpus=8, classes=[gpu_class], min_replicas=rng.randint(1, 2))
        elif roll < 0.25:
            spec = model(name, gpus=4, classes=[gpu_class], min_replicas=rng.randint(1, 2))
        elif roll < 0.45:
            spec = model(
                name,
                gpus=2,
                classes=[gpu_class, rng.choice(classes)] if rng.random() < 0.3 else [gpu_class],
                min_replicas=rng.randint(1, 3),
            )
        elif roll < 0.55:
            spec = model(name, gpus=1, classes=[gpu_class], min_replicas=0, max_replicas=2)
        else:
            spec = model(
                name, gpus=1, classes=[gpu_class], min_replicas=rng.randint(1, 4), max_replicas=6
            )
        specs.append(spec)
    return specs


def _cache_weights(
    rng: random.Random, node_records: list[NodeRecord], specs: list[ModelSpec]
) -> None:
    # Weights: each model is already cached on a few nodes of its class.
    by_class: dict[str, list[NodeRecord]] = {}
    for node in node_records:
        for device in node.inventory.devices if node.inventory else []:
            by_class.setdefault(device.gpu_class, [])
            if not by_class[device.gpu_class] or by_class[device.gpu_class][-1] is not node:
                by_class[device.gpu_class].append(node)
    for spec in specs:
        pool = by_class.get(spec.gpu_classes[0], [])
        for node in rng.sample(pool, min(len(pool), 3)):
            node.weights.append(WeightsEntry(model=spec.name))
