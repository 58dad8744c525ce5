"""Where a SQLite store lives, and who may read it: checked before the driver opens it.

A missing or read-only folder is refused with a line a person can act on
(the driver's failed connect says less and leaves a worker thread behind),
and the files are kept owner-only, since they hold the fleet's secrets.
"""

from __future__ import annotations

import os

from llmgw.errors import ConfigError


def check_sqlite_place(database: str) -> None:
    """Refuse a SQLite file whose directory is missing or read-only, before
    the driver tries: its failed connect leaves a worker thread behind."""
    if database in ("", ":memory:") or database.startswith("file:"):
        return
    folder = os.path.dirname(os.path.abspath(database)) or "."
    if not os.path.isdir(folder):
        raise ConfigError(f"cannot open the store at {database}: {folder} is not a directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot open the store at {database}: {folder} is not writable")
    _check_sqlite_private(database)


# The SQLite files hold the fleet's secrets (the CA's private key, the
# engine-key seed, catalog secrets): owner-only, as ssh keeps its keys.
SQLITE_FILE_MODE = 0o600
_SQLITE_SIDE_FILES = ("", "-wal", "-shm", "-journal")


def _check_sqlite_private(database: str) -> None:
    """Make a new SQLite store owner-only; refuse one that others may read.

    SQLite creates its -wal and -shm files with the database file's mode, so
    creating the file 0600 before the driver opens it keeps all three
    private. A file that exists readable by group or others is refused rather
    than quietly tightened: whoever could read it may hold the secrets, which
    the operator should know (docs/security.md says what to rotate).
    """
    if not os.path.exists(database):
        os.close(os.open(database, os.O_WRONLY | os.O_CREAT | os.O_EXCL, SQLITE_FILE_MODE))
        return
    shared = [path for path in (database + side for side in _SQLITE_SIDE_FILES)
              if os.path.exists(path) and os.stat(path).st_mode & 0o077]
    if shared:
        modes = ", ".join(f"{path} {os.stat(path).st_mode & 0o777:o}" for path in shared)
        raise ConfigError(
            f"the store's files can be read by other users ({modes}): they hold the fleet's "
            f"secrets (CA key, engine-key seed). Run: chmod 600 {' '.join(shared)}"
            " (and see docs/security.md on what to rotate if others had access)")
