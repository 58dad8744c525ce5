"""Who may register a node name that is already registered.

An agent registers once and keeps the node token it is answered with. When
that answer is lost (a timeout, a reset, a control plane that restarted
after committing), the agent holds no token while its name is taken. Refusing
it leaves the node stuck until a person deletes it; accepting anyone with the
join token would let any holder of it take over a running node's identity
(its replicas, its place in routing).

The agent key settles it: the agent makes a secret for its data dir before
it first registers and sends it every time; the node keeps its hash. The
same data dir may register again; another (a wiped disk, a second machine
under the same name) may not. Nodes registered before agent keys have no
hash until their agent's next report brings one (llmgw.control.reports);
until then a registration under their name is refused.
"""

from __future__ import annotations

from llmgw import secrets
from llmgw.control.state import NodeRecord
from llmgw.errors import ValidationError


def agent_key_hash(agent_key: str | None) -> str | None:
    return secrets.hash_secret(agent_key) if agent_key else None


def check_registering_again(node: NodeRecord, agent_key: str | None) -> None:
    """Allow a registration for ``node`` (already registered) only from its own agent.

    Raises ValidationError saying what a person can do otherwise. The key is
    never part of the message.
    """
    if node.agent_key_hash is None:
        raise _refusal(
            node.name,
            "it was registered before agents sent an agent key, so this cannot be"
            " told apart from another agent using its name",
        )
    if agent_key is None:
        raise _refusal(node.name, "this registration carries no agent key")
    if not secrets.matches(agent_key, node.agent_key_hash):
        raise _refusal(
            node.name,
            "this agent's key is not the one it registered with (another data dir,"
            " or the data dir was wiped)",
        )


def _refusal(name: str, why: str) -> ValidationError:
    return ValidationError(
        f"node {name!r} is already registered and {why}; if the node was rebuilt or"
        f" its agent lost its data dir, remove the old registration first"
        f" (llmgw ctl nodes delete {name}) and the agent registers again",
        field="node",
    )
