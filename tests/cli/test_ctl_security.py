"""``llmgw ctl`` and what the fleet sends it: markup stays text; join tokens (issue 13)."""

from __future__ import annotations

import pytest
from tests.cli.test_ctl import ok, run, served  # noqa: F401 (fixture)
from tests.control.adminapi.fleetkit import Served

from llmgw.cli.ctl.render import make_console, print_listing
from llmgw.wire import NodeState, ReplicaState, ReplicaStatus


def test_markup_from_the_fleet_is_printed_as_text(capsys: pytest.CaptureFixture[str]) -> None:
    hostile = "[link=http://evil.example]click[/link] [/] [bold red]x"
    print_listing([{"v": hostile}], False, ("V",), lambda item: (item["v"],), "none")
    make_console().print(hostile)
    out = capsys.readouterr().out
    assert out.count(hostile) == 2


def test_ctl_replicas_shows_an_engine_line_with_brackets_verbatim(served: Served) -> None:  # noqa: F811
    replica = next(iter(served.cp.state.replicas.values()))
    node = served.cp.state.nodes[replica.leader_node]
    node.statuses[replica.id] = ReplicaStatus(replica_id=replica.id, state=ReplicaState.READY,
                                              reason="[/] [red]boom")
    replica.reason = "[/] [red]boom"
    out = ok(run(served, "replicas"))
    assert "[/] [red]boom" in out


def test_join_tokens_create_list_revoke(served: Served) -> None:  # noqa: F811
    secret = ok(run(served, "join-tokens", "create", "--uses", "1", "--ttl", "2",
                    "--description", "rack-7")).strip()
    assert secret.startswith("llmgw-join-") and "\n" not in secret
    listing = ok(run(served, "join-tokens"))
    line = next(x for x in listing.splitlines() if "rack-7" in x)
    assert "0/1" in line and "usable" in line and secret not in listing
    token_id = line.split()[0]
    assert f"join token {token_id} revoked" in ok(run(served, "join-tokens", "revoke", token_id))
    line = next(x for x in ok(run(served, "join-tokens")).splitlines() if "rack-7" in x)
    assert "revoked" in line


def test_ctl_nodes_approve(served: Served) -> None:  # noqa: F811
    node = served.cp.state.nodes["gpu-2"]
    node.pending_approval = True
    node.admin_state = NodeState.CORDONED
    assert "warning: waiting for approval: llmgw ctl nodes approve gpu-2" in ok(
        run(served, "nodes", "show", "gpu-2"))
    assert "node gpu-2 approved; it is ready" in ok(run(served, "nodes", "approve", "gpu-2"))
    assert not node.pending_approval


def test_ctl_nodes_fabrics(served: Served) -> None:  # noqa: F811
    out = ok(run(served, "nodes", "fabrics", "gpu-2", "ib-z", "ib-y"))
    assert "node gpu-2 fabrics: ib-z,ib-y (set)" in out
    assert served.cp.state.nodes["gpu-2"].fabrics_pinned
    out = ok(run(served, "nodes", "fabrics", "gpu-2", "--reported"))
    assert "(unset)" in out and not served.cp.state.nodes["gpu-2"].fabrics_pinned


def test_control_codes_from_the_fleet_never_reach_the_terminal(served: Served) -> None:  # noqa: F811
    # An engine's last line and a node's warning, as a rogue node writes
    # them: clear the screen, retitle the window, rewrite the line.
    hostile = "\x1b[2J\x1b]0;owned\x07\rok\u202e"
    replica = next(iter(served.cp.state.replicas.values()))
    node = served.cp.state.nodes[replica.leader_node]
    node.statuses[replica.id] = ReplicaStatus(replica_id=replica.id, state=ReplicaState.READY,
                                              reason=hostile)
    replica.reason = hostile
    assert node.inventory is not None
    node.inventory.warnings.append(f"gpu 0 {hostile}")
    for args in (("replicas",), ("replicas", "--json"), ("nodes", "show", node.name),
                 ("nodes", "show", node.name, "--json"), ("events",)):
        out = ok(run(served, *args))
        assert not any(c in out for c in "\x1b\x07\r\u202e"), (args, out)
    shown = ok(run(served, "nodes", "show", node.name))
    assert "\ufffd[2J\ufffd]0;owned\ufffd\ufffdok\ufffd" in shown
