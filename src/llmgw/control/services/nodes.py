"""Nodes: registration with a join token, the node tokens, approval, fabrics and states.

What a node reports once registered is the agents' feed (services.agents);
this is everything an agent or an operator does to the node itself.
"""

from __future__ import annotations

import time

from llmgw import secrets
from llmgw.control import approval
from llmgw.control.registration import agent_key_hash, check_registering_again
from llmgw.control.rows import gpu_rows, node_row
from llmgw.control.services.core import Core, found
from llmgw.control.services.credentials import Credentials
from llmgw.control.state import NodeRecord
from llmgw.errors import AuthError, NotFoundError, ValidationError
from llmgw.nodetls import normal_address
from llmgw.wire import AgentRegistration, AgentRegistrationAnswer, NodeState


class Nodes:
    def __init__(self, core: Core, credentials: Credentials) -> None:
        self.core = core
        self.credentials = credentials
        # serve --approve-nodes: new nodes wait for an operator (llmgw.control.approval).
        self.approve_nodes = False
        self._node_by_token_hash: dict[str, str] = {}
        # How many nodes the index was built from: it is built again on a miss
        # only when that changed, never once per unknown token (each would
        # cost a pass over the fleet, for whoever sends tokens at random).
        self._indexed_nodes = -1

    async def load(self) -> None:
        """Mark the loaded nodes held for approval, and those with pinned fabrics."""
        store, nodes = self.core.store, self.core.state.nodes
        self._indexed_nodes = -1  # the nodes were read again: index them on the next miss
        for name in approval.parse(await store.get_setting(approval.SETTING)):
            if name in nodes:
                nodes[name].pending_approval = True
        for name in approval.parse(await store.get_setting(approval.PINNED_SETTING)):
            if name in nodes:
                nodes[name].fabrics_pinned = True

    def for_token(self, token: str | None) -> NodeRecord:
        """The node a token speaks for.

        Looked up by hash: the tokens are 256 random bits, so comparing their
        SHA-256 digests through a dict leaks nothing a timing attack could use,
        and it keeps a report from hashing once per node of the fleet.
        """
        if not token:
            raise AuthError("a node token is required")
        nodes = self.core.state.nodes
        digest = secrets.hash_secret(token)
        name = self._node_by_token_hash.get(digest)
        if name is None and self._indexed_nodes != len(nodes):
            self._node_by_token_hash = {
                n.token_hash: n.name for n in nodes.values() if n.token_hash
            }
            self._indexed_nodes = len(nodes)
            name = self._node_by_token_hash.get(digest)
        node = nodes.get(name) if name else None
        if node is None or node.token_hash != digest:
            raise AuthError("unknown node token")
        return node

    def admit(self, join_token: str | None) -> None:
        """Refuse a registration whose join token could never pass (unknown, revoked,
        expired), before its body is read: AuthError.

        Its uses are counted by :meth:`register`, which alone can tell a node's
        own agent registering again (that may pass a used-up token) from a
        new node.
        """
        self.core.require_leader()
        if not join_token:
            raise AuthError(
                "a registration carries its join token in the Authorization header"
                " (Authorization: Bearer llmgw-join-...); an agent that sends it in the"
                " body only is older than this control plane: upgrade it"
            )
        self.credentials.join_tokens.check(join_token, time.time(), retry=True)

    async def register(
        self, reg: AgentRegistration, join_token: str | None = None
    ) -> AgentRegistrationAnswer:
        """Register ``reg.node`` with ``join_token`` (over HTTP: the header's) or,
        inside the process, the registration's own."""
        core, join_tokens = self.core, self.credentials.join_tokens
        core.require_leader()
        now = time.time()
        secret = join_token or reg.join_token
        if secret is None or join_tokens.find(secret) is None:
            raise AuthError("invalid join token")
        existing = core.state.nodes.get(reg.node)
        registered = existing if existing is not None and existing.token_hash else None
        if registered is not None:
            # Only its own agent, whose answer was lost: it gets a fresh token
            # and the node keeps its state, GPUs and replicas (see
            # llmgw.control.registration for why the join token is not enough).
            check_registering_again(registered, reg.agent_key)
        join = join_tokens.check(secret, now, retry=registered is not None)
        if registered is None:
            # Counted (and written) before the node exists: a crash in between
            # costs a use, never grants one more.
            join.uses += 1
            await self.credentials.save_join_tokens()
        token = secrets.new_secret(secrets.NODE_PREFIX)
        node = existing or NodeRecord(name=reg.node, registered_at=time.time())
        node.token_hash = secrets.hash_secret(token)  # the old token stops working
        self._node_by_token_hash[node.token_hash] = node.name
        if registered is None:
            node.agent_key_hash = agent_key_hash(reg.agent_key)
            if self.approve_nodes:
                node.pending_approval = True
                node.admin_state = NodeState.CORDONED
        if reg.inventory is not None:
            node.inventory = reg.inventory
        core.state.nodes[node.name] = node
        await core.writes.upsert_nodes([node_row(node)])
        if reg.inventory is not None:
            await core.writes.replace_gpus(node.name, gpu_rows(reg.inventory))
        if registered is not None:
            await core.event("node", node.name, f"node {node.name} registered again by its"
                             " own agent (same agent key); its previous node token is revoked")
        elif node.pending_approval:
            await core.writes.set_setting(approval.SETTING, approval.dump(core.state.nodes))
            await core.event("node", node.name, f"node {node.name} registered; held cordoned"
                             f" until approved (llmgw ctl nodes approve {node.name})")
        else:
            await core.event("node", node.name, f"node {node.name} registered")
        return AgentRegistrationAnswer(node=node.name, node_token=token)

    async def approve(self, name: str) -> NodeRecord:
        """Accept a node held by --approve-nodes: uncordon it and let it copy weights."""
        core = self.core
        core.require_leader()
        node = found(core.state.nodes, name, "node")
        if not node.pending_approval:
            raise ValidationError(f"node {name} is not waiting for approval", field="node")
        node.pending_approval = False
        node.admin_state = NodeState.READY
        # Accepted as it showed itself: the fabrics it reported are pinned.
        node.fabrics_pinned = True
        node.fabrics = list(node.reported_fabrics)
        await core.writes.upsert_nodes([node_row(node)])
        await core.writes.set_setting(approval.SETTING, approval.dump(core.state.nodes))
        await self._save_pinned_fabrics()
        await core.event("node", name, f"node {name} approved (fabrics:"
                         f" {','.join(node.fabrics) or 'none'})")
        core.wake_reconciler()
        return node

    async def set_fabrics(self, name: str, fabrics: list[str] | None) -> NodeRecord:
        """Pin a node's fabrics (reports stop changing them), or None: its reports decide."""
        core = self.core
        core.require_leader()
        node = found(core.state.nodes, name, "node")
        trusted = core.trust_reported_fabrics
        if fabrics is None:
            node.fabrics_pinned = False
            node.fabrics = list(node.reported_fabrics) if trusted else []
            message = (f"node {name} takes its fabrics from its reports again"
                       if trusted else f"node {name} fabrics unset")
        else:
            node.fabrics_pinned = True
            node.fabrics = list(fabrics)
            message = f"node {name} fabrics set to {','.join(fabrics) or 'none'}"
        await core.writes.upsert_nodes([node_row(node)])
        await self._save_pinned_fabrics()
        await core.event("node", name, message)
        core.wake_reconciler()
        return node

    async def _save_pinned_fabrics(self) -> None:
        pinned = approval.dump_pinned(self.core.state.nodes)
        await self.core.writes.set_setting(approval.PINNED_SETTING, pinned)

    async def set_state(self, name: str, target: NodeState) -> NodeRecord:
        core = self.core
        core.require_leader()
        node = found(core.state.nodes, name, "node")
        if target == NodeState.UNREACHABLE:
            raise ValidationError("a node cannot be set unreachable", field="state")
        if node.pending_approval and target == NodeState.READY:
            raise ValidationError(f"node {name} waits for approval: llmgw ctl nodes approve"
                                  f" {name}", field="state")
        if node.admin_state != target:
            node.admin_state = target
            await core.writes.upsert_nodes([node_row(node)])
            verb = {"ready": "uncordoned", "cordoned": "cordoned", "draining": "draining"}
            await core.event("drain" if target == NodeState.DRAINING else "node", name,
                             f"node {name} {verb[target.value]}")
            core.wake_reconciler()
        return node

    async def free_address(self, address: str) -> str:
        """Unbind ``address`` from the node it belongs to (llmgw.control.nodecerts); that node."""
        core = self.core
        core.require_leader()
        address = normal_address(address)
        owner = await core.writes.free_address(address)
        core.node_certs.claims.pop(address, None)
        if owner is None:
            raise NotFoundError(f"address {address!r} is bound to no node")
        await core.event("node", owner, f"address {address} freed from node {owner}"
                         " by an admin: the next node to report it may be given it")
        return owner

    async def delete(self, name: str) -> None:
        core = self.core
        core.require_leader()
        found(core.state.nodes, name, "node")
        await core.writes.delete_node(name)  # its addresses with it
        core.node_certs.claims = {a: n for a, n in core.node_certs.claims.items() if n != name}
        removed = core.state.nodes.pop(name)
        if removed.pending_approval:
            await core.writes.set_setting(approval.SETTING, approval.dump(core.state.nodes))
        if removed.fabrics_pinned:
            await self._save_pinned_fabrics()
        await core.event("node", name, f"node {name} removed")
        core.wake_reconciler()
