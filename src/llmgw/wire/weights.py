"""Where a model's weights come from, what a node holds, and what they must be."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from llmgw.wire.base import Int64, Wire


class WeightsSource(Wire):
    """Where a model's weights come from.

    ``local``: a path already on every node (a shared filer, or a file);
    ``hf``: the Hugging Face Hub at a pinned revision; ``package``: a Python
    package that ships the weights (the starter model); ``none``: engines that
    need no weights (the simulated engine).
    """

    kind: Literal["local", "hf", "package", "none"] = "none"
    path: str | None = None
    repo: str | None = None
    revision: str | None = None
    file: str | None = None  # one file inside the repo or package (a .gguf)
    package: str | None = None

    @model_validator(mode="after")
    def _fields_for_kind(self) -> WeightsSource:
        needed = {"local": "path", "hf": "repo", "package": "package"}.get(self.kind)
        if needed and not getattr(self, needed):
            raise ValueError(f"weights of kind {self.kind!r} need {needed!r}")
        return self



class WeightsEntry(Wire):
    """A model whose weights a node holds in its local cache."""

    model: str
    revision: str | None = None
    size_bytes: Int64 = 0
    sha256: str | None = None
    path: str | None = None
    # The source the entry was fetched from: the control plane counts a
    # holding as a copy of a model only when it is of the catalog's source.
    source: WeightsSource | None = None


class WeightsFile(Wire):
    """One file of a model's weights as its origin vouches for it.

    ``sha256`` from the Hub (LFS files) or the package; files the Hub keeps
    in git (config.json, the tokenizer) have only their git blob id there,
    so ``git_sha1`` stands in for it. ``size`` None: not known at the origin.
    """

    path: str
    size: Int64 | None = Field(None, ge=0)
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    git_sha1: str | None = Field(None, pattern=r"^[0-9a-f]{40}$")


class WeightsDigests(Wire):
    """What a model's weights must be, recorded once by the control plane.

    A copy from a peer was checked only against the peer's own manifest, so
    one rogue node (anyone with a join token) could serve its fabric any
    weights it liked. Agents verify every copy, from a peer or the origin,
    against this record before an engine loads it (llmgw.agent.trust).
    ``origin``: ``hub`` (the Hub's file list at the pinned revision),
    ``package`` (the digest the package ships), ``first-fetch`` (neither
    could be read: the first copy an assigned node reported, trusted on
    first use). ``files`` None: only ``sha256``, the digest of the whole
    entry, is known (first fetch).
    """

    source: WeightsSource
    origin: Literal["hub", "package", "first-fetch"]
    files: list[WeightsFile] | None = None
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    # The node whose copy was trusted (first-fetch only).
    node: str | None = None

