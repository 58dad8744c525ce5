"""HTTP/1.1 on the ground floor: llmgw's server and the hot path's client.

The server (:mod:`llmgw.http.server` for its settings,
:mod:`llmgw.http.connection` for a connection, :mod:`llmgw.http.cycle` for
one request and its answer) runs every llmgw app: the gateway, the control
plane, the agent. The client (:mod:`llmgw.http.client`, with the connection
and answer in :mod:`llmgw.http.upstream`) is how the gateway talks to
engines. Nothing here imports the gateway, the control plane, the agent or
the CLI: they build on it.
"""
