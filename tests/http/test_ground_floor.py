"""llmgw.http is the ground floor: it imports none of the parts built on it.

The server runs the gateway's, the control plane's and the agent's apps, and
the gateway's hot path uses the client; an import the other way (the server
reaching into the gateway for a type, say) would tie every app to the
gateway and make an import circle of the first such convenience.
"""

from __future__ import annotations

from tests.test_import_cycles import import_graph

ABOVE = ("llmgw.gateway", "llmgw.control", "llmgw.agent", "llmgw.cli", "llmgw.console")


def test_http_imports_nothing_built_on_it() -> None:
    graph = import_graph()
    found = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if module == "llmgw.http" or module.startswith("llmgw.http.")
        for target in targets
        if target.startswith(ABOVE)
    )
    assert found == []
    assert "llmgw.http.client" in graph  # the package was found at all
