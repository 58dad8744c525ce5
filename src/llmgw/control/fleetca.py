"""One CA for every control-plane instance of a fleet, kept in the store they share.

Agents trust the CA whose fingerprint their join token carries, and follow
the leader to whichever instance leads. If each ``serve`` made a CA of its
own in its data dir, an agent would refuse a standby that took over (another
CA), and a join token printed by one instance would be good for that
instance only. The instances already share the store, so the first one to
start puts its CA there (certificate and key as one setting, so two
instances starting at once cannot end up with one's certificate and the
other's key) and every later one takes that CA into its data dir; each
still issues its own server certificate, for its own names.

The key in the store is a secret like the engine-key seed beside it: whoever
reads the store can issue certificates the fleet trusts. An operator who
gives certificates (``--tls-cert``, ``--tls-ca``) keeps them out of the
store and gives each instance its own, from one CA.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmgw.control.store.repo import Store
from llmgw.errors import ConfigError
from llmgw.servertls import CA_KEY, make_ca, write_ca
from llmgw.tls import CA_CERT, fingerprint

SETTING = "tls_ca"


async def share_ca(store: Store, directory: Path) -> None:
    """Make ``directory``'s CA the store's, putting it (or a new one) there first if none is."""
    cert_path, key_path = directory / CA_CERT, directory / CA_KEY
    local: tuple[bytes, bytes] | None = None
    if cert_path.exists() and key_path.exists():
        local = cert_path.read_bytes(), key_path.read_bytes()
    stored = await store.get_setting(SETTING)
    if stored is None:
        # An instance upgraded from before the store held the CA offers its
        # own: its agents and join tokens already trust it.
        offered = local or make_ca()
        await store.set_setting_if_absent(SETTING, json.dumps(
            {"cert": offered[0].decode("ascii"), "key": offered[1].decode("ascii")}))
        stored = await store.get_setting(SETTING)
        if stored is None:  # pragma: no cover - written just above
            raise ConfigError("the fleet CA could not be kept in the store")
    try:
        document = json.loads(stored)
        cert, key = document["cert"].encode("ascii"), document["key"].encode("ascii")
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ConfigError(f"the store's {SETTING!r} setting is not llmgw's CA") from None
    if local is not None and local[0] != cert:
        raise ConfigError(
            f"{cert_path} is another CA ({fingerprint(local[0])}) than the fleet's, kept in"
            f" the store ({fingerprint(cert)}) by the instance that started first: agents and"
            f" join tokens trust one or the other. Move {directory} aside to use the fleet's"
            " CA here (tokens this instance printed must then be made again), or give this"
            " instance certificates from the fleet's CA (--tls-cert, --tls-ca)")
    if local is None:
        write_ca(directory, cert, key)
