"""The URLs `llmgw serve` records: for standbys to send agents and gateways to, and for ctl."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from tests.servers import free_port

from llmgw.cli.combined import TlsOptions
from llmgw.cli.serve import ServeOptions, advertise_url, run_serve
from llmgw.cli.upjson import serve_admin_urls
from llmgw.errors import ConfigError


def test_advertise_url_is_how_other_machines_reach_this_one() -> None:
    # Any bind but loopback listens with TLS unless --insecure-http says otherwise.
    assert advertise_url(ServeOptions(host="10.0.0.5", port=9000)) == "https://10.0.0.5:9000"
    plain = TlsOptions(insecure_http=True)
    assert advertise_url(ServeOptions(host="10.0.0.5", port=9000, tls=plain)) == (
        "http://10.0.0.5:9000")
    assert advertise_url(ServeOptions(host="::1", port=8080)) == "http://[::1]:8080"
    # A wildcard bind is not an address anyone can dial; the host name is.
    assert advertise_url(ServeOptions(host="0.0.0.0", port=8080)) == (
        f"https://{socket.getfqdn()}:8080")
    given = ServeOptions(host="0.0.0.0", advertise="https://cp1.example:8443/")
    assert advertise_url(given) == "https://cp1.example:8443"


def test_peer_urls_join_this_instance_in_what_serve_writes_for_ctl() -> None:
    own = "http://127.0.0.1:8080"
    assert serve_admin_urls(own, []) == own  # one instance: a plain URL, as before
    assert serve_admin_urls(own, ["http://cp2:8080/, http://cp3:8080", "http://cp2:8080"]) == [
        own, "http://cp2:8080", "http://cp3:8080"]
    assert serve_admin_urls(own, [own + "/"]) == own  # itself named as a peer adds nothing


def test_a_bad_peer_url_fails_before_serve_starts(tmp_path: Path) -> None:
    options = ServeOptions(data_dir=tmp_path, host="127.0.0.1", port=free_port(),
                           peer_urls=["cp2:8080"])
    with pytest.raises(ConfigError, match=r"--peer-url: .*'cp2:8080'.*http://"):
        run_serve(options)
    assert not (tmp_path / "up.json").exists()
