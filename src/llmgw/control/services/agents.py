"""The agents' feed: a node's report in, everything it must run out.

What a report changes is control.reports' rule (apply_report); this writes
what must survive a restart, batches the heartbeats, and notices the nodes
that stopped reporting.
"""

from __future__ import annotations

import logging
import time

from llmgw.control.adapters import AdapterIndex, prefetch_for
from llmgw.control.nodecerts import Issued
from llmgw.control.reports import (
    AssignmentJson,
    apply_report,
    weight_peers,
)
from llmgw.control.rows import gpu_rows, node_row, replica_row
from llmgw.control.services.core import Core
from llmgw.control.state import UNREACHABLE_AFTER_S, NodeRecord
from llmgw.control.telemetry import Reading
from llmgw.errors import AuthError
from llmgw.wire import AgentReport, AgentReportAnswer

log = logging.getLogger(__name__)

# Heartbeats are written in batches: 2,000 agents reporting every 5 s would
# otherwise be 400 write transactions a second for a value only read after a
# restart. Losing a few seconds of last_seen in a crash is harmless.
HEARTBEAT_FLUSH_S = 5.0
REPORT_INTERVAL_S = 5.0


class Agents:
    def __init__(self, core: Core) -> None:
        self.core = core
        self._pending_heartbeats: dict[str, float] = {}
        # Nodes unreachable at the last look (note_reachability); None before it.
        self._unreachable: frozenset[str] | None = None
        # The last set of other nodes' replica ids each node reported on.
        self._foreign_reported: dict[str, list[str]] = {}
        # The last refusal of a certificate per node, so each is an event once.
        self._certificate_refused: dict[str, str] = {}
        # The catalog's adapters by base, rebuilt on catalog writes: what
        # prefetch and llama-server assignments both read.
        self._adapters = AdapterIndex()
        self._assignment_json = AssignmentJson(self._adapters)

    async def report(
        self,
        node: NodeRecord,
        report: AgentReport,
        readings: tuple[Reading, ...] | None = None,
    ) -> bytes:
        """Take in a node's report; answer with everything it must run.

        ``readings``: its devices' telemetry, newer than the report's inventory
        (apply_report). The answer is an :class:`AgentReportAnswer`'s
        ``model_dump_json`` bytes, each assignment's JSON kept between reports
        (reports.AssignmentJson)."""
        issued = await self._take(node, report, readings)
        core = self.core
        shell = self._answer(node, issued).model_dump_json().encode()
        parts = self._assignment_json.for_node(core.state, node.name, core.engine_keys.key)
        # The node's name is the only field before the list, and a node name
        # holds no quote: the first occurrence is the field.
        return shell.replace(b'"assignments":[]', b'"assignments":[' + b",".join(parts) + b"]", 1)

    async def _take(
        self, node: NodeRecord, report: AgentReport, readings: tuple[Reading, ...] | None
    ) -> Issued:
        """Everything a report changes, written where it must be; the certificate it asked for."""
        core, state = self.core, self.core.state
        core.require_leader()
        if report.node != node.name:
            raise AuthError(f"this token speaks for node {node.name!r}, not {report.node!r}")
        now = time.time()
        effects = apply_report(
            state,
            node,
            report,
            now,
            trust_reported_fabrics=core.trust_reported_fabrics,
            vouch=lambda entries: core.digests.vouched(state, entries),
            readings=readings,
        )
        if effects.write_node:
            await core.writes.upsert_nodes([node_row(node)])
        else:
            self._pending_heartbeats[node.name] = now
        if effects.write_gpus:
            await core.writes.replace_gpus(node.name, gpu_rows(report.inventory))
        if effects.replicas:
            await core.writes.write_replicas([replica_row(r) for r in effects.replicas])
        if effects.agent_key_recorded:
            await core.event(
                "node",
                node.name,
                f"node {node.name} recorded its agent's key"
                " from a report; its agent may now register it again",
            )
        if effects.foreign and self._foreign_reported.get(node.name) != effects.foreign:
            # Once per distinct set, not once per report every 5 s.
            log.warning(
                "node %s reported on replicas not assigned to it (ignored): %s",
                node.name,
                ", ".join(effects.foreign),
            )
            await core.event(
                "node",
                node.name,
                f"node {node.name} reported on replicas not assigned to it; ignored",
                replicas=effects.foreign,
            )
        self._foreign_reported[node.name] = effects.foreign
        issued = await self._certificate(node, report)
        await core.digests.take_report(state, node, report)
        if effects.wake_reconciler:
            core.wake_reconciler()
        if effects.routing_changed:
            await state.bump_routing()
        return issued

    def _answer(self, node: NodeRecord, issued: Issued) -> AgentReportAnswer:
        """The answer without its assignments, which ``report`` splices in."""
        core, state = self.core, self.core.state
        certs = core.node_certs
        return AgentReportAnswer(
            node=node.name,
            assignments=[],
            report_interval_s=REPORT_INTERVAL_S,
            # A node waiting for approval reads no one's weights.
            weight_peers={}
            if node.pending_approval
            else weight_peers(state, node, core.digests.records, certs.scheme),
            weight_digests=core.digests.for_node(state, node),
            peer_token=None if node.pending_approval else core.peer_token,
            node_tls=certs.enabled,
            certificate=issued.certificate,
            certificate_ca=(
                certs.issuer.ca_pem.decode("ascii") if issued.certificate and certs.issuer else None
            ),
            certificate_refused=issued.refused,
            prefetch=prefetch_for(state, node.name, self._adapters),
        )

    async def _certificate(self, node: NodeRecord, report: AgentReport) -> Issued:
        """The certificate a report's CSR asked for, or why not (an event once per reason)."""
        certs = self.core.node_certs
        if report.csr is None or not certs.enabled:
            self._certificate_refused.pop(node.name, None)
            return Issued()
        await certs.claim(self.core.writes, node, time.time())
        issued = certs.issue(self.core.state, node, report.csr)
        if issued.refused is None:
            self._certificate_refused.pop(node.name, None)
        elif self._certificate_refused.get(node.name) != issued.refused:
            self._certificate_refused[node.name] = issued.refused
            log.warning("no server certificate for node %s: %s", node.name, issued.refused)
            await self.core.event(
                "node",
                node.name,
                f"node {node.name} gets no server"
                f" certificate: {issued.refused}; its server stays down"
                " until it has one",
            )
        return issued

    async def note_reachability(self, now: float) -> None:
        """Act on nodes turning unreachable (or back) by time passing alone.

        No event announces that reports stopped: without this look, the
        gateways' routing table kept a dead node's replicas until something
        else changed it, and every request to them failed. A change rebuilds
        the table and wakes the reconciler, which replaces a lost replica at
        once if its model has no other (scheduler/triage.py).
        """
        core = self.core
        unreachable = core.state.unreachable_nodes(now)
        before, self._unreachable = self._unreachable, unreachable
        if unreachable == before:
            return
        for name in sorted(unreachable - (before or frozenset())):
            if before is not None:
                await core.event(
                    "node",
                    name,
                    f"node {name} is unreachable: no report for"
                    f" more than {UNREACHABLE_AFTER_S:g} s",
                )
        await core.state.bump_routing()
        core.wake_reconciler()

    async def flush_heartbeats(self) -> None:
        pending, self._pending_heartbeats = self._pending_heartbeats, {}
        await self.core.writes.touch_nodes(pending)
