"""The control plane: its shared state and one service per resource.

Everything that changes fleet state goes through a :class:`ControlPlane`
service: the catalog, nodes, replicas, API keys, credentials, and the feeds
that agents and gateways report into. Each updates the in-memory
:class:`FleetState` and writes what must survive a restart through the one
fenced writer they share (services.core), so the HTTP layers stay thin and
the same rules hold whichever API a change came through.
"""

from __future__ import annotations

import time

from llmgw.control.enginekeys import EngineKeys
from llmgw.control.leader import Leadership
from llmgw.control.rows import model_from_row, node_from_row, replica_from_row
from llmgw.control.scheduler.decisions import Policy
from llmgw.control.services.agents import Agents
from llmgw.control.services.allowances import Allowances
from llmgw.control.services.catalog import Catalog
from llmgw.control.services.core import Core
from llmgw.control.services.credentials import Credentials, NewCredentials
from llmgw.control.services.gateways import Gateways
from llmgw.control.services.keys import ApiKeys
from llmgw.control.services.nodes import Nodes
from llmgw.control.services.replicas import Replicas
from llmgw.control.services.teams import Teams
from llmgw.control.state import FleetState
from llmgw.control.store.repo import Store
from llmgw.control.weightdigests import SETTING as WEIGHT_DIGESTS

# What ensure_credentials returns, so the plane's callers need one import.
__all__ = ["ControlPlane", "NewCredentials"]


class ControlPlane(Core):
    """The composition root: the shared core (leadership, store, writes, events) and its services.

    The services see only the core and the siblings they name, never each
    other through this object, so what each one touches is in its constructor.
    """

    def __init__(
        self, store: Store, state: FleetState | None = None, leadership: Leadership | None = None
    ) -> None:
        super().__init__(store, state, leadership)
        # The reconciler's knobs (scheduler.decisions.Policy): the runtime's
        # reconciler and the admin plan read this one object, so a plan
        # parks and backs off as the passes it predicts do.
        self.policy = Policy()
        self.teams = Teams(self)
        self.keys = ApiKeys(self, self.teams)
        self.credentials = Credentials(self, self.keys)
        self.catalog = Catalog(self)
        self.nodes = Nodes(self, self.credentials)
        self.replicas = Replicas(self)
        self.agents = Agents(self)
        self.gateways = Gateways(self, self.keys, self.catalog, self.teams)
        # Each gateway worker's share of every key's and team's limits.
        self.allowances = Allowances(self, self.keys, self.teams)

    async def load(self, *, leading: bool = False) -> None:
        """Read the durable state into memory (at start and on becoming leader).

        ``leading``: this instance is taking over. Requests in flight are then
        learnt again from the gateways' reports, not from the store: a count
        its predecessor stored just before dying would otherwise pin a
        replica as busy until some gateway reported it. And a node's silence
        counts from now at the earliest: nobody could hear it meanwhile.
        """
        state = self.state
        # Every row read first, then swapped in with no await between: a
        # standby reloads every few seconds, and cleared before the reads its
        # admin API and summary answered an empty fleet meanwhile (a loaded
        # machine widened that window until a test's GET fell into it).
        node_rows = await self.store.list_nodes()
        model_rows = await self.store.list_models()
        replica_rows = await self.store.list_replicas()
        state.nodes.clear()
        state.models.clear()
        state.replicas.clear()
        for row in node_rows:
            state.nodes[row["name"]] = node_from_row(row)
        for row in model_rows:
            record = model_from_row(row)
            state.models[record.name] = record
        for row in replica_rows:
            replica = replica_from_row(row)
            state.replicas[replica.id] = replica
        self.replicas.loaded()
        if leading:
            for replica in state.replicas.values():
                replica.in_flight = 0
            # No node could report while no instance led (NodeRecord.listening_since).
            began = time.time()
            for node in state.nodes.values():
                node.listening_since = began
        await self.teams.load()
        await self.keys.load()
        # This leadership's shares start settling now, not at the first report.
        _ = self.allowances.book
        await self.credentials.load()
        await self.nodes.load()
        await self.node_certs.load_claims(self.store)
        self.engine_keys = await EngineKeys.load(self.store)
        self.digests.load(await self.store.get_setting(WEIGHT_DIGESTS))
        await state.bump_routing()

    async def ensure_credentials(self, *, first_api_key: bool = True) -> NewCredentials:
        """Create whatever credential is missing; return the new plaintexts."""
        return await self.credentials.ensure(first_api_key=first_api_key)
