"""Every fuzz target, in the order bench/fuzz.py and the tests run them."""

from __future__ import annotations

from tests.fuzz import control, gateway, http_client, http_server, parsers
from tests.fuzz.runner import Target

ALL: list[Target] = [
    http_server.TARGET,
    http_server.MUTATED,
    http_client.TARGET,
    *parsers.ALL,
    control.ADMIN,
    control.AGENT,
    control.WIRE,
    gateway.TARGET,
    gateway.SCHEMA,
]
