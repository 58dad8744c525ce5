"""Engines under a user of their own (``llmgw agent --engine-user NAME``).

An engine runs code the agent does not control: a model's own Python under
``--trust-remote-code``, an engine build from anywhere, a tokenizer with a
bug. Run as the agent's user, it could read the agent's secrets in its data
dir: ``agent.key`` (re-registration), ``identity.json`` (the node token),
``tls/node.key`` (the node's certificate) and ``engines.json`` (every
engine key of the node), and hold the node's place in the fleet with them.

Under another user it reaches only what it needs: the data dir is 0710 and
its group is the engine user's (the engine may pass through it, list
nothing); ``weights/`` is readable by that group, the model it serves made
so at each launch (copies are staged owner-only); ``logs/`` lets it reach a
secret file the agent gives it (SGLang's key), owned by the engine user;
every other file of the agent is owner-only, ``tls/`` too. The engine's
log is opened by the agent and handed over as its stdout, so the engine
needs no access to ``logs/`` for it. Switching users needs the agent to run
as root; the engine guard (agent.engineguard) stays root and drops to the
engine user only for the engine, so the node's TLS key stays the agent's.
All engines of a node share the one engine user, and so can reach each
other: run one agent per trust level where models of different trust share
a node (docs/security.md).
"""

from __future__ import annotations

import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmgw.errors import ConfigError

# What the engine user may do in the agent's directories.
DATA_DIR_MODE = 0o710  # pass through, list nothing
WEIGHTS_MODE = 0o750  # read the weights
LOGS_MODE = 0o710  # reach its own secret file by name
SECRET_MODE = 0o400


@dataclass(frozen=True)
class EngineUser:
    name: str
    uid: int
    gid: int
    home: str

    @classmethod
    def resolve(cls, name: str) -> EngineUser:
        """The user ``name``, if the agent can start engines under it; ConfigError otherwise."""
        if os.geteuid() != 0:
            raise ConfigError(f"--engine-user {name}: starting engines under another user needs"
                              " the agent to run as root (docs/security.md)")
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            raise ConfigError(f"--engine-user {name}: no such user (create it: useradd --system"
                              f" --no-create-home {name})") from None
        if entry.pw_uid == 0 or entry.pw_gid == 0:
            raise ConfigError(f"--engine-user {name}: user or group id 0 would give engines"
                              " root's access; name an unprivileged user")
        return cls(name, entry.pw_uid, entry.pw_gid, entry.pw_dir)

    def popen(self) -> dict[str, Any]:
        """``subprocess.Popen``'s arguments that start a process as this user, in its own
        group alone (none of the agent's groups)."""
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def env(self) -> dict[str, str]:
        """Where the engine writes its caches (vLLM, torch, Hugging Face): its own home."""
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name}

    def prepare(self, data_dir: Path) -> None:
        """Let the engine user through the data dir to the weights and logs, and no further."""
        self._share(data_dir, DATA_DIR_MODE)
        self._share(data_dir / "weights", WEIGHTS_MODE)
        self._share(data_dir / "logs", LOGS_MODE)

    def _share(self, path: Path, mode: int) -> None:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chown(path, -1, self.gid)
        os.chmod(path, mode)

    def grant_weights(self, weights_root: Path, path: str | None) -> None:
        """Make the weights at ``path`` (under ``weights_root``) readable by the engine user.

        Copies are staged owner-only and renamed into place, so each launch
        opens the one it loads (its directories up from the root, its files).
        Nothing is made writable, and nothing outside ``weights_root`` changes.
        """
        if path is None:
            return
        target, root = Path(path), weights_root.resolve()
        resolved = target.resolve()
        if resolved != root and root not in resolved.parents:
            return  # weights the agent does not keep (a local path): the operator's
        for parent in resolved.parents:
            if parent == root:
                break
            self._grant(parent, 0o050)
        for base, _dirs, files in os.walk(resolved):
            self._grant(Path(base), 0o050)
            for name in files:
                self._grant(Path(base) / name, 0o040)
        if resolved.is_file():
            self._grant(resolved, 0o040)

    def _grant(self, path: Path, bits: int) -> None:
        info = path.lstat()
        if stat.S_ISLNK(info.st_mode):
            return
        if info.st_gid != self.gid:
            os.chown(path, -1, self.gid)
        if stat.S_IMODE(info.st_mode) & bits != bits:
            os.chmod(path, stat.S_IMODE(info.st_mode) | bits)

    def give(self, path: Path) -> None:
        """A file for the engine alone (its secret): owned by the engine user, read-only."""
        os.chown(path, self.uid, self.gid)
        os.chmod(path, SECRET_MODE)
