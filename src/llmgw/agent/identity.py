"""The node's identity: its name, the node token the join token bought, the agent key.

Registration happens once; the node token is then the node's only credential
and is kept in ``<data_dir>/node.json``, readable by its owner only. A data
dir belongs to one node: starting it under another name is refused, because
the engines recorded there were started for the first one.

The agent key (``<data_dir>/agent.key``, owner only) is made before the first
registration and sent with every registration. The control plane keeps its
hash, so when a registration's answer is lost the same data dir can register
its node again; a wiped data dir has a new key and needs a person.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict
from pydantic import ValidationError as PydanticValidationError

from llmgw.agent.state import write_atomic
from llmgw.errors import ConfigError
from llmgw.secrets import AGENT_KEY_PREFIX, new_secret

IDENTITY_FILE = "node.json"
AGENT_KEY_FILE = "agent.key"
# As the wire type requires (AgentRegistration.agent_key).
_AGENT_KEY_LENGTHS = range(32, 257)


class Identity(BaseModel):
    model_config = ConfigDict(extra="ignore")

    node: str
    node_token: str
    control_plane: str = ""


def load_identity(data_dir: Path, name: str) -> Identity | None:
    path = data_dir / IDENTITY_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        identity = Identity.model_validate_json(raw)
    except PydanticValidationError:
        raise ConfigError(
            f"{path} is not a valid node identity; remove it to register again"
        ) from None
    if identity.node != name:
        raise ConfigError(
            f"data dir {data_dir} belongs to node {identity.node!r}, not {name!r}:"
            f" use --name {identity.node} or another data dir"
        )
    return identity


def save_identity(data_dir: Path, identity: Identity) -> None:
    write_atomic(data_dir / IDENTITY_FILE, identity.model_dump_json().encode(), mode=0o600)


def agent_key(data_dir: Path) -> str:
    """This data dir's agent key, made on first use and the same ever after.

    Made by linking a finished file into place, which fails if one is there:
    the key on disk is always whole, and two agents racing on one data dir
    end up with the same key rather than one overwriting the other's after
    it was sent.
    """
    path = data_dir / AGENT_KEY_FILE
    existing = _read_agent_key(path)
    if existing is not None:
        return existing
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(new_secret(AGENT_KEY_PREFIX).encode())
            handle.flush()
            os.fsync(handle.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        tmp.unlink(missing_ok=True)
    made = _read_agent_key(path)
    if made is None:
        raise ConfigError(f"{path} vanished as it was made")
    return made


def _read_agent_key(path: Path) -> str | None:
    try:
        key = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not text"
        raise ConfigError(f"cannot read {path}: {reason or exc}") from None
    if len(key) not in _AGENT_KEY_LENGTHS:
        # Never show the content: it may be most of a secret.
        raise ConfigError(
            f"{path} is not a valid agent key; remove it and the agent makes a new one"
            " (registering this node again then needs `llmgw ctl nodes delete NAME` first)"
        )
    return key
