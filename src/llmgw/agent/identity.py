"""The node's identity: its name and the node token the join token bought.

Registration happens once; the node token is then the node's only credential
and is kept in ``<data_dir>/node.json``, readable by its owner only. A data
dir belongs to one node: starting it under another name is refused, because
the engines recorded there were started for the first one.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict
from pydantic import ValidationError as PydanticValidationError

from llmgw.agent.state import write_atomic
from llmgw.errors import ConfigError

IDENTITY_FILE = "node.json"


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
