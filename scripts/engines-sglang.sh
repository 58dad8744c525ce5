#!/usr/bin/env bash
# SGLang's Python package in its own virtualenv, for tests/agent/test_engine_parsers.py,
# which parses every launch the SGLang adapter builds with SGLang's own code
# (sglang.srt.server_args and its config-file merger). Only what importing
# that needs is installed: the package itself with --no-deps (it pins a CUDA
# torch 2.14.1, flashinfer and sglang-kernel, none of which a parser needs),
# torch 2.13.0 (pip takes the CPU build this machine keeps on disk; never let
# pip choose a torch, which downloads a CUDA build of several GB), and the
# pure-Python modules its import chain reaches. It does not run SGLang.
#
#   $LLMGW_ENGINES_DIR/sglang/   (default ~/.cache/llmgw/engines/sglang)
#
# Safe to run again: a stamp naming what was installed skips the work.
# First run: ~2 min (torch is most of it), 2.3 GB.
set -euo pipefail

ENGINES_DIR=${LLMGW_ENGINES_DIR:-$HOME/.cache/llmgw/engines}
PYTHON=${PYTHON:-python3}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
TORCH_VERSION=${SGLANG_TORCH_VERSION:-2.13.0}
# What `import sglang.srt.server_args` and the config merger reach (found by
# importing until nothing was missing).
IMPORTS="numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec
pydantic pyzmq tqdm IPython aiohttp pyyaml"

venv=$ENGINES_DIR/sglang
stamp=$venv/.llmgw-stamp
want="sglang==$SGLANG_VERSION torch==$TORCH_VERSION $(echo $IMPORTS)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "engines: SGLang $SGLANG_VERSION (parsers only) already in $venv"
  exit 0
fi
echo "engines: SGLang $SGLANG_VERSION (parsers only) into $venv (first time: ~2 min)"
started=$SECONDS
[ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
# torch first and pinned, so that nothing after it asks pip for another.
"$venv/bin/python" -m pip install -q "torch==$TORCH_VERSION"
"$venv/bin/python" -m pip install -q --no-deps "sglang==$SGLANG_VERSION"
# shellcheck disable=SC2086
"$venv/bin/python" -m pip install -q --no-warn-conflicts $IMPORTS "torch==$TORCH_VERSION"
"$venv/bin/python" -c 'import sglang.srt.server_args, sglang.srt.utils.server_args_config_parser'
echo "$want" > "$stamp"
echo "engines: SGLang done in $((SECONDS - started)) s"
