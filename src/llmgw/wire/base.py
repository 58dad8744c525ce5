"""The base of every message, how a reader meets a newer sender, states and names.

The states are fixed by DESIGN.md §3; the name and host checks guard what
users type before it reaches URLs, log lines and engine argv.
"""

from __future__ import annotations

import ipaddress
import re
from enum import StrEnum
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

PROTOCOL_VERSION = 1
# The largest value of the store's integer columns (PostgreSQL's INTEGER):
# a wire field stored in one is bounded by it, so a report past it is a 422,
# never a failed write.
INT32_MAX = 2**31 - 1
# An integer that JSON writers (orjson) and the store's JSON columns hold:
# pydantic reads any size, and one past 64 bits in an agent's report failed
# the store's write (a 503 for each of that node's reports; found by
# schemathesis over the agent API).
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class Wire(BaseModel):
    """Base for every message: unknown fields are refused, not ignored.

    An agent newer than its control plane (or a typo in a catalog entry)
    should fail loudly with the field's name rather than lose the setting.
    """

    model_config = ConfigDict(extra="forbid", frozen=False, populate_by_name=True)


_W = TypeVar("_W", bound=Wire)

# A key's (or its team's) place in the gateway's hold queue when a model's
# replicas are saturated (llmgw.gateway.admission): every waiting request of
# a higher class is served before any of a lower one. Three, not a number:
# operators pick among meanings, and a free-form number per key turns into an
# arms race between teams.
PriorityClass = Literal["interactive", "standard", "batch"]
PRIORITY_CLASSES: tuple[PriorityClass, ...] = ("interactive", "standard", "batch")


def read_from_newer(kind: type[_W], body: bytes | str) -> tuple[_W, list[str]]:
    """``body`` as ``kind``, tolerating fields added by a newer sender; and their names.

    The control plane is upgraded before its agents and gateways (docs/
    operations.md), so for a while it answers them with fields they do not
    know. Refusing those answers, as :class:`Wire` refuses everything else,
    would stop every node mid-upgrade; the reader ignores them instead and
    names them, so the caller can say once that it is older than its
    control plane. Any other fault still raises ``pydantic.ValidationError``.
    """
    try:
        return kind.model_validate_json(body), []
    except ValidationError as exc:
        errors = exc.errors()
        unknown = [".".join(map(str, e["loc"])) for e in errors if e["type"] == "extra_forbidden"]
        if len(unknown) != len(errors):
            raise
    return kind.model_validate_json(body, extra="ignore"), unknown


# States (fixed by DESIGN.md §3).


class NodeState(StrEnum):
    READY = "ready"
    CORDONED = "cordoned"
    DRAINING = "draining"
    UNREACHABLE = "unreachable"


class ReplicaState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


class EngineKind(StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"
    # The node's llama.cpp server: llama-server where the agent is told to
    # use it or finds it on PATH, else llama-cpp-python's (agent.engines).
    LLAMACPP = "llamacpp"
    # One of the two llama.cpp servers by name, so that one node serves
    # both; agents older than these kinds cannot read an assignment of them.
    LLAMA_SERVER = "llama-server"
    LLAMA_CPP_PYTHON = "llama-cpp-python"
    SIM = "sim"
    # Not run by llmgw: servers that already exist (ModelSpec.external).
    EXTERNAL = "external"


# The kinds that run llama.cpp on a GGUF file: one process, one node, its
# RAM need sized by the same rules (llmgw.memory).
LLAMACPP_KINDS = frozenset(
    {EngineKind.LLAMACPP, EngineKind.LLAMA_SERVER, EngineKind.LLAMA_CPP_PYTHON}
)


# Node and fabric names reach URLs (``/admin/v1/nodes/NAME``), log lines,
# tables in ``llmgw ctl`` and the console: a narrower alphabet than model
# names (no ``/``, ``:``, ``@``, no brackets), so none of them can split a URL
# path, pass for Rich markup or HTML, or be mistaken for an option.
NODE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_NODE_NAME_RE = re.compile(NODE_NAME_PATTERN)
_HOST_LABEL_RE = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")


def check_node_name(value: str, what: str = "node name") -> str:
    """``value`` if it is a valid node or fabric name; ValueError saying why not."""
    if not _NODE_NAME_RE.match(value):
        raise ValueError(
            f"{value!r} is not a valid {what}: use letters, digits and . _ -, starting"
            " with a letter or digit, at most 128 characters"
        )
    return value


def check_host(value: str) -> str:
    """``value`` if it is a bare host name or IP address; ValueError saying why not.

    A node's address is where the gateway sends prompts and peers send the
    peer token; it goes between ``http://`` and ``:port``, so a scheme, a
    port, a path or user info in it would aim those requests somewhere else.
    """
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    labels = value.split(".")
    if len(value) > 253 or not all(_HOST_LABEL_RE.match(label) for label in labels):
        raise ValueError(
            f"{value!r} is not a host name or IP address (no scheme, port, path or user"
            " info; e.g. 10.0.0.5 or gpu-01.example.com)"
        )
    return value


def host_in_url(address: str) -> str:
    """The address as it goes between ``scheme://`` and ``:port`` (IPv6 bracketed)."""
    return f"[{address}]" if ":" in address else address

