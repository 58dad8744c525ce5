"""Where a running ``serve`` or ``up`` is: ``up.json`` (for scripts, ``llmgw ctl``), the banner.

Secrets go to ``up.json`` only (owner-only); the banner, which ends up in
journals and CI logs, names where they are and never prints one.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmgw.control.plane import ControlPlane, NewCredentials
from llmgw.errors import ConfigError
from llmgw.failover import parse_control_plane_urls
from llmgw.servertls import ServerTls
from llmgw.tls import token_with_fingerprint


def write_up_json(data_dir: Path, info: dict[str, Any]) -> Path:
    """Where things are, for scripts and ``llmgw ctl``; owner-only, it holds secrets."""
    path = data_dir / "up.json"
    previous: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        previous = json.loads(path.read_text())
    merged = {**previous, **{k: v for k, v in info.items() if v is not None}}
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(merged, out, indent=2)
    os.replace(tmp, path)
    os.chmod(path, 0o600)
    return path


def serve_admin_urls(own: str, peers: Sequence[str]) -> str | list[str]:
    """up.json's ``admin_url`` for ``serve``: this instance, then its peers.

    With one URL, ``llmgw ctl`` on this machine loses the fleet whenever this
    instance is down or a standby that cannot name a leader; with the peers
    listed it reads from whichever answers and writes at the leader after a
    failover, without flags. A plain string when there are no peers, as
    before.
    """
    if not peers:
        return own
    try:
        urls = parse_control_plane_urls([own, *peers])
    except ConfigError as exc:
        raise ConfigError(f"--peer-url: {exc}") from None
    return urls if len(urls) > 1 else urls[0]


def urls(base: str) -> dict[str, str]:
    """The three addresses a process serves at ``base``."""
    return {"api_url": f"{base}/v1", "admin_url": base, "console_url": f"{base}/console"}


def join_token_fields(
    cp: ControlPlane, creds: NewCredentials, tls: ServerTls | None = None
) -> dict[str, Any]:
    """up.json's join token (new this start), with when it stops working.

    Under TLS it carries the CA's fingerprint (``<secret>.sha256:<hex>``), so
    that an agent given it trusts this control plane from its first call.
    """
    if not creds.join_token:
        return {}
    token = cp.credentials.join_tokens.find(creds.join_token)
    carried = token_with_fingerprint(creds.join_token, tls.ca_fingerprint() if tls else None)
    return {"join_token": carried,
            "join_token_expires_at": token.expires_at if token else None}


def tls_fields(tls: ServerTls | None) -> dict[str, Any]:
    """Where the CA is (for ``ctl`` on this machine) and its fingerprint (for ``--ca-hash``)."""
    if tls is None or tls.ca_file is None:
        return {}
    return {"ca_file": str(tls.ca_file.resolve()), "ca_fingerprint": tls.ca_fingerprint()}


def print_banner(info: dict[str, Any], creds: NewCredentials, *, up: bool) -> None:
    """Where everything is; never a secret (stdout ends up in journals and CI logs).

    New credentials are in ``up.json`` (owner-only), whose path is printed.
    """
    lines = [
        "",
        "llmgw is running.",
        f"  OpenAI API   {info['api_url']}",
        f"  Admin API    {info['admin_url']}/admin/v1",
        f"  Console      {info['console_url']}",
    ]
    if info.get("ca_file"):
        # Not a secret: what agents, gateways and browsers are told to trust.
        lines.append(f"  TLS CA       {info['ca_file']}   ({info['ca_fingerprint']})")
    made = [what for what, secret in (("admin token", creds.admin_token),
                                      ("API key", creds.api_key),
                                      ("join token", creds.join_token)) if secret]
    if made:
        lines.append(f"  Credentials  {info['up_json']}   (owner-only; new: {', '.join(made)})")
    elif info.get("up_json"):
        lines.append(f"  Credentials  {info['up_json']}   (owner-only)")
    if not up and not creds.join_token:
        lines.append("  Join token   stored hashed; make one: llmgw ctl join-tokens create")
    if info.get("api_key") and info.get("up_json"):
        read_key = ("import json; print(json.load(open(" + json.dumps(str(info["up_json"]))
                    + '))["api_key"])')
        lines += [
            "",
            "Try it:",
            f"  API_KEY=$(python3 -c '{read_key}')",
            f"  curl {info['api_url']}/chat/completions \\"
            + (f"\n    --cacert {info['ca_file']} \\" if info.get("ca_file") else ""),
            '    -H "Authorization: Bearer $API_KEY" \\',
            "    -H 'Content-Type: application/json' \\",
            "    -d '{\"model\": \"" + info.get("model", "default")
            + "\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}]}'",
        ]
    lines.append("Stop with Ctrl-C.\n")
    print("\n".join(lines), flush=True)
