"""What a GGUF file says about itself: its architecture and its chat template.

A chat template belongs to the model (the GGUF key ``tokenizer.chat_template``,
as ``tokenizer_config.json`` carries it for a Hugging Face model): only the
model knows where its system text goes. The llama.cpp adapter reads these two
keys to decide whether a model needs a template supplied (llmgw.agent.engines.
templates) instead of naming a family and hoping the engine knows it.

Only the metadata is read, never the tensors: the header is a few MB at most
(the vocabulary is its biggest part). Walking a vocabulary of 262k strings
still takes ~25 ms of Python, and a guarded engine's launch is built twice
(agent.replicalaunch), each time on a cold start's path: what a file says is
kept while the file is unchanged (same size and modification time).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

_MAGIC = b"GGUF"
# GGUF value types (ggml/include/gguf.h).
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_WANTED = ("general.architecture", "tokenizer.chat_template")
# A metadata string longer than this is not a template or a name: a corrupt file.
_MAX_STRING = 16 * 1024 * 1024


@dataclass(frozen=True)
class GgufInfo:
    architecture: str | None
    chat_template: str | None


class GgufError(ValueError):
    """Not a GGUF file, or one whose metadata cannot be read."""


# (path, size, mtime in ns) -> what it said; bounded: a node holds a few dozen models.
_READ: dict[tuple[str, int, int], GgufInfo] = {}
_READ_MAX = 256


def read_info(path: str) -> GgufInfo:
    """The architecture and chat template a GGUF file carries (None where it has none)."""
    try:
        stat = os.stat(path)
    except OSError as exc:
        raise GgufError(f"{path}: cannot read its metadata: {exc}") from None
    key = (path, stat.st_size, stat.st_mtime_ns)
    info = _READ.get(key)
    if info is None:
        info = _read(path)
        if len(_READ) >= _READ_MAX:
            _READ.clear()
        _READ[key] = info
    return info


def _read(path: str) -> GgufInfo:
    try:
        with (
            open(path, "rb") as handle,
            mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data,
        ):
            return _Reader(data, path).info()
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
        if isinstance(exc, GgufError):
            raise
        raise GgufError(f"{path}: cannot read its metadata: {exc}") from None


class _Reader:
    """Walks the metadata in place (a mapped file: a vocabulary of 262k strings
    is skipped in a few milliseconds, none of it copied)."""

    def __init__(self, data: mmap.mmap, path: str) -> None:
        self.data = data
        self.path = path
        self.at = 0

    def info(self) -> GgufInfo:
        if self.data[:4] != _MAGIC:
            raise GgufError(f"{self.path} is not a GGUF file")
        self.at = 4
        version = self.unpack("<I")
        if version < 2:
            raise GgufError(f"{self.path}: GGUF version {version} is not supported")
        self.unpack("<Q")  # tensor count
        found: dict[str, str] = {}
        for _ in range(self.unpack("<Q")):
            key = self.string()
            kind = self.unpack("<I")
            if key in _WANTED and kind == _STRING:
                found[key] = self.string()
                if len(found) == len(_WANTED):
                    break
            else:
                self.skip(kind)
        return GgufInfo(found.get("general.architecture"), found.get("tokenizer.chat_template"))

    def unpack(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.data):
            raise GgufError(f"{self.path}: the metadata ends early")
        value: int = struct.unpack_from(fmt, self.data, self.at)[0]
        self.at += size
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        if length > _MAX_STRING or self.at + length > len(self.data):
            raise GgufError(f"{self.path}: a metadata string of {length} bytes")
        text = self.data[self.at : self.at + length].decode("utf-8")
        self.at += length
        return text

    def skip(self, kind: int) -> None:
        if kind in _FIXED:
            self.at += _FIXED[kind]
        elif kind == _STRING:
            length = self.unpack("<Q")  # advances past the length first
            self.at += length
        elif kind == _ARRAY:
            item = self.unpack("<I")
            length = self.unpack("<Q")
            if item in _FIXED:
                self.at += _FIXED[item] * length
            elif item == _STRING:
                unpack_from, data = struct.unpack_from, self.data
                at = self.at
                for _ in range(length):
                    at += 8 + unpack_from("<Q", data, at)[0]
                self.at = at
            else:
                for _ in range(length):
                    self.skip(item)
        else:
            raise GgufError(f"{self.path}: unknown metadata type {kind}")
        if self.at > len(self.data):
            raise GgufError(f"{self.path}: the metadata ends early")
