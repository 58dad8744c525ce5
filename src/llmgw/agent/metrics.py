"""One node's Prometheus metrics, served on the agent's own server at /metrics.

Everything is read at scrape time from what the agent already holds: the
inventory of its last report (so a scrape never calls NVML or nvidia-smi;
the figures are as old as the report interval, seconds), its replica
runners, and the weights cache's entries. Nothing is counted on the side,
so there is nothing to keep in step.

Devices are labelled as every view names them: ``"3"`` for card 3,
``"0/mig1"`` for instance 1 of card 0, ``"cpu0"`` for a CPU slot. A MIG
instance's temperature and power are its card's (the seed's rule); its
utilisation has no source and is left out, never written as 0, and so is
any figure the device's source cannot give.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmgw import __version__
from llmgw.wire import Device, ReplicaState

if TYPE_CHECKING:
    from llmgw.agent.app import Agent

MIB = 1024 * 1024
REPLICA_STATES = tuple(state.value for state in ReplicaState)
DEVICE_LABELS = ["device", "class"]


class AgentMetrics:
    """The agent's families, rendered on demand (WeightsServer's /metrics)."""

    def __init__(self, agent: Agent) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_AgentCollector(agent))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _AgentCollector(Collector):
    def __init__(self, agent: Agent) -> None:
        self._agent = agent

    def collect(self) -> Iterator[Metric]:
        agent = self._agent
        info = GaugeMetricFamily("llmgw_agent_info", "This agent: its node name and version.",
                                 labels=["node", "version"])
        info.add_metric([agent.config.name, __version__], 1)
        yield info
        yield CounterMetricFamily("llmgw_agent_reports_sent", "Reports the control plane answered.",
                                  value=agent.reports_sent)
        inventory = agent.inventory
        if inventory is not None:
            if inventory.memory_total_mib is not None:
                yield GaugeMetricFamily("llmgw_agent_node_memory_total_bytes",
                                        "The node's RAM (CPU replicas are placed against it).",
                                        value=inventory.memory_total_mib * MIB)
            yield from device_families(inventory.devices)
        yield from self._replica_families()
        cached = GaugeMetricFamily(
            "llmgw_agent_weights_cache_bytes",
            "Bytes of complete weights in the node's cache, by model.", labels=["model"]
        )
        by_model: dict[str, int] = {}
        for _, entry in agent.weights.all_entries():
            by_model[entry.model] = by_model.get(entry.model, 0) + entry.size_bytes
        for model, size in sorted(by_model.items()):
            cached.add_metric([model], size)
        yield cached

    def _replica_families(self) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            "llmgw_agent_replica_state",
            "1 for the state each replica on this node is in, 0 for the others.",
            labels=["replica", "model", "state"],
        )
        restarts = CounterMetricFamily(
            "llmgw_agent_replica_restarts",
            "Times the replica was restarted in place (a changed catalog entry starts a new"
            " generation); a failed replica is replaced by a new one instead.",
            labels=["replica", "model"],
        )
        for runner in list(self._agent.runners.values()):
            status = runner.status()
            model = runner.assignment.model.name
            for name in REPLICA_STATES:
                state.add_metric([status.replica_id, model, name],
                                 1 if status.state.value == name else 0)
            restarts.add_metric([status.replica_id, model], status.generation - 1)
        yield state
        yield restarts


def device_families(devices: list[Device]) -> list[Metric]:
    """Per-device gauges, each written only where the device's source gives it."""
    total = GaugeMetricFamily("llmgw_agent_device_memory_total_bytes",
                              "Device memory (a MIG instance's own).", labels=DEVICE_LABELS)
    used = GaugeMetricFamily("llmgw_agent_device_memory_used_bytes",
                             "Device memory in use (a MIG instance's own).", labels=DEVICE_LABELS)
    temperature = GaugeMetricFamily(
        "llmgw_agent_device_temperature_celsius",
        "Temperature (a MIG instance shows its card's).", labels=DEVICE_LABELS)
    power = GaugeMetricFamily("llmgw_agent_device_power_watts",
                              "Power draw (a MIG instance shows its card's).", labels=DEVICE_LABELS)
    utilization = GaugeMetricFamily(
        "llmgw_agent_device_utilization_ratio",
        "Busy share of the last sample period, 0-1; absent where the device has no such"
        " figure (MIG instances, CPU slots).", labels=DEVICE_LABELS)  # fmt: skip
    healthy = GaugeMetricFamily(
        "llmgw_agent_device_healthy",
        "1 healthy, 0 unhealthy (ECC, pending retirement or remap, lost from the bus):"
        " an unhealthy device is neither used nor free.", labels=DEVICE_LABELS)  # fmt: skip
    placeable = GaugeMetricFamily(
        "llmgw_agent_device_placeable",
        "1 when the device can take work, 0 e.g. for a card in MIG mode with nothing carved.",
        labels=DEVICE_LABELS)  # fmt: skip
    ecc = CounterMetricFamily(
        "llmgw_agent_device_ecc_uncorrected_errors",
        "Uncorrected ECC errors over the card's life (aggregate; a MIG instance shows its"
        " card's), where the source gives them.", labels=DEVICE_LABELS)  # fmt: skip
    for device in devices:
        labels = [device.label, device.gpu_class]
        if device.memory_total_mib:
            total.add_metric(labels, device.memory_total_mib * MIB)
            used.add_metric(labels, device.memory_used_mib * MIB)
        if device.temperature_c is not None:
            temperature.add_metric(labels, device.temperature_c)
        if device.power_w is not None:
            power.add_metric(labels, device.power_w)
        if device.utilization_pct is not None and device.mig is None:
            utilization.add_metric(labels, device.utilization_pct / 100)
        healthy.add_metric(labels, 1 if device.healthy else 0)
        placeable.add_metric(labels, 1 if device.placeable else 0)
        if device.ecc_uncorrected is not None:
            ecc.add_metric(labels, device.ecc_uncorrected)
    return [total, used, temperature, power, utilization, healthy, placeable, ecc]
