"""The URL `llmgw serve` records for standbys to send agents and gateways to."""

from __future__ import annotations

import socket

from llmgw.cli.up import ServeOptions, advertise_url


def test_advertise_url_is_how_other_machines_reach_this_one() -> None:
    assert advertise_url(ServeOptions(host="10.0.0.5", port=9000)) == "http://10.0.0.5:9000"
    assert advertise_url(ServeOptions(host="::1", port=8080)) == "http://[::1]:8080"
    # A wildcard bind is not an address anyone can dial; the host name is.
    assert advertise_url(ServeOptions(host="0.0.0.0", port=8080)) == (
        f"http://{socket.getfqdn()}:8080")
    given = ServeOptions(host="0.0.0.0", advertise="https://cp1.example:8443/")
    assert advertise_url(given) == "https://cp1.example:8443"
