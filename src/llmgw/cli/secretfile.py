"""Secrets given as files, so they stay off command lines.

A token on a command line is in ``ps`` for every user of the machine, in the
shell history and in the systemd unit; a file readable by its owner only (or
a systemd credential) is in none of them. Every command that takes a token
takes ``--...-file PATH`` as well as the environment variable.
"""

from __future__ import annotations

import os
from pathlib import Path

from llmgw.errors import ConfigError


def read_secret_file(path: Path, what: str) -> str:
    """The secret in ``path`` (surrounding whitespace removed); ConfigError if none."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} from {path}: {exc.strerror}") from None
    secret = text.strip()
    if not secret or "\n" in secret:
        raise ConfigError(f"{path} must hold the {what} alone, on one line")
    return secret


def pick_secret(value: str | None, path: Path | None, what: str, flag: str) -> str | None:
    """The secret given as a value or as a file (not both)."""
    if value and path:
        raise ConfigError(f"give the {what} once: {flag} or {flag}-file, not both")
    return read_secret_file(path, what) if path else value


def metrics_token_from(path: Path | None = None) -> str | None:
    """The gateway's metrics token: ``path``, LLMGW_METRICS_TOKEN_FILE or LLMGW_METRICS_TOKEN."""
    env_file = os.environ.get("LLMGW_METRICS_TOKEN_FILE")
    path = path or (Path(env_file) if env_file else None)
    return pick_secret(os.environ.get("LLMGW_METRICS_TOKEN") or None, path,
                       "metrics token", "LLMGW_METRICS_TOKEN")
