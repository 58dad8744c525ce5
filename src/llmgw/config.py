"""Settings shared by the commands: where data lives and how to reach the store.

Every setting can come from a flag or from an ``LLMGW_*`` environment variable;
flags win. Checks that can fail (a directory that cannot be written, a URL
with an unknown scheme) raise ConfigError with one line a person can act on.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

from llmgw.errors import ConfigError

APP_NAME = "llmgw"


def default_data_dir() -> Path:
    env = os.environ.get("LLMGW_DATA_DIR")
    if env:
        return Path(env)
    return Path(platformdirs.user_data_dir(APP_NAME))


def ensure_data_dir(path: Path) -> Path:
    """Create the data dir, make it owner-only, and prove it is writable.

    An existing dir is tightened too (``mkdir``'s mode applies only to a new
    one): it holds the store, keys and tokens, and a dir made by hand or by
    an older llmgw under a umask of 022 lets every local user read them.
    """
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        if path.stat().st_mode & 0o077:
            os.chmod(path, 0o700)
        probe = path / ".write-probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"data dir {path} is not writable: {exc.strerror or exc}") from None
    return path


def sqlite_url(data_dir: Path) -> str:
    return f"sqlite+aiosqlite:///{data_dir / 'llmgw.db'}"

