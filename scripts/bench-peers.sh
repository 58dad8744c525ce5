#!/usr/bin/env bash
# The routers bench/gateway.py --peer measures beside llmgw (vLLM's and SGLang's,
# from PyPI), in a virtualenv of their own: vllm-router pins web packages of its
# own, which must not move llmgw's. Safe to run again: pip skips what is there.
set -euo pipefail
PYTHON=${PYTHON:-python3}
DIR=${LLMGW_BENCH_PEERS_DIR:-$HOME/.cache/llmgw/bench-peers}
if [ ! -x "$DIR/bin/python" ]; then
  "$PYTHON" -m venv "$DIR"
fi
"$DIR/bin/python" -m pip install -q 'vllm-router>=0.1' 'sglang-router>=0.3'
echo "bench-peers: vllm-router and sglang-router in $DIR"
