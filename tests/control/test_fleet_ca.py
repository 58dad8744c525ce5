"""Control-plane instances on one store share one CA (control.fleetca; issue 13).

Without it each ``serve`` made a CA of its own: an agent whose join token
carried the leader's fingerprint refused the standby that took over.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from llmgw.control.fleetca import share_ca
from llmgw.control.store.repo import Store
from llmgw.errors import ConfigError
from llmgw.servertls import ensure_server_tls
from llmgw.tls import fingerprint


async def test_the_first_instance_keeps_its_ca_in_the_store_and_the_others_take_it(
    tmp_path: Path,
) -> None:
    store = await Store.open(f"sqlite:///{tmp_path / 'cp.db'}")
    try:
        # One instance upgraded from before: its CA (agents trust it) becomes the fleet's.
        old = ensure_server_tls(tmp_path / "a", ["127.0.0.1"])
        assert old.ca_file is not None
        before = old.ca_file.read_bytes()
        await share_ca(store, tmp_path / "a")
        assert old.ca_file.read_bytes() == before
        # Two more instances start at once on fresh data dirs: both take it.
        await asyncio.gather(share_ca(store, tmp_path / "b"), share_ca(store, tmp_path / "c"))
        for name in ("b", "c"):
            tls = ensure_server_tls(tmp_path / name, ["127.0.0.1", f"cp-{name}"])
            assert tls.ca_file is not None and tls.ca_file.read_bytes() == before
            assert tls.ca_key_file is not None
            assert tls.ca_key_file.stat().st_mode & 0o777 == 0o600
            assert tls.cert_file.read_bytes() != old.cert_file.read_bytes()  # its own names

        # A data dir that made a CA of its own is refused, naming both fingerprints.
        stray = ensure_server_tls(tmp_path / "d", ["127.0.0.1"])
        assert stray.ca_file is not None
        with pytest.raises(ConfigError, match="another CA") as refused:
            await share_ca(store, tmp_path / "d")
        assert fingerprint(before) in str(refused.value)
        assert fingerprint(stray.ca_file.read_bytes()) in str(refused.value)
    finally:
        await store.close()


async def test_a_fresh_fleet_makes_one_ca(tmp_path: Path) -> None:
    store = await Store.open(f"sqlite:///{tmp_path / 'cp.db'}")
    try:
        await asyncio.gather(*(share_ca(store, tmp_path / n) for n in ("a", "b")))
        assert (tmp_path / "a" / "ca.pem").read_bytes() == (tmp_path / "b" / "ca.pem").read_bytes()
        assert (tmp_path / "a" / "ca.key").read_bytes() == (tmp_path / "b" / "ca.key").read_bytes()
    finally:
        await store.close()
