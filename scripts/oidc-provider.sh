#!/usr/bin/env bash
# Installs the OpenID Connect provider the SSO tests run (tests/oidc/: panva's
# oidc-provider from npm, versions pinned by its package-lock.json) into
# LLMGW_OIDC_PROVIDER_DIR (default ~/.cache/llmgw/oidc-provider). Cached: a
# second run with the same lock file does nothing. Needs node >= 20.19 and npm
# (scripts/setup.sh installs Debian's). `scripts/oidc-provider.sh dir` prints
# where it is.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
dir=${LLMGW_OIDC_PROVIDER_DIR:-$HOME/.cache/llmgw/oidc-provider}
if [ "${1:-}" = dir ]; then echo "$dir"; exit 0; fi
stamp="$dir/.lock-sha256"
want=$(sha256sum "$here/tests/oidc/package-lock.json" | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -d "$dir/node_modules/oidc-provider" ]; then
  exit 0
fi
command -v npm >/dev/null 2>&1 || { echo "oidc-provider: npm not found (apt-get install npm)" >&2; exit 1; }
echo "oidc-provider: installing the SSO tests' provider into $dir"
mkdir -p "$dir"
cp "$here/tests/oidc/package.json" "$here/tests/oidc/package-lock.json" "$dir/"
(cd "$dir" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
echo "$want" > "$stamp"
