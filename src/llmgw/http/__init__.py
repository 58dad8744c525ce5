"""HTTP/1.1 on the ground floor: llmgw's server and the hot path's client.

The server runs every llmgw app that speaks HTTP through uvicorn (the
gateway, the control plane, ``serve``'s dispatcher in front of both):
:mod:`~llmgw.http.contract` is what it promises an app and asks of one,
:mod:`~llmgw.http.server` its settings, :mod:`~llmgw.http.connection` a
connection (with :mod:`~llmgw.http.guards`, its deadlines, and
:mod:`~llmgw.http.target`, a request's path), :mod:`~llmgw.http.cycle` one
request and its answer (with :mod:`~llmgw.http.answerhead`, an answer's
head), and :mod:`~llmgw.http.asgi` the same contract under any other ASGI
server. The client (:mod:`~llmgw.http.client`, the pool, and
:mod:`~llmgw.http.upstream`, a connection and the answer read on it) is how
the gateway talks to engines. Nothing here imports the gateway, the control
plane, the agent or the CLI: they build on it.
"""
