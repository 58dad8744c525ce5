#!/usr/bin/env bash
# Starts the machine's PostgreSQL when it is not answering (the store tests
# run against it). Does nothing when it already runs.
set -uo pipefail
if pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then exit 0; fi
if command -v pg_ctlcluster >/dev/null 2>&1; then
  echo "postgres: starting"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
  for _ in $(seq 1 30); do
    pg_isready -q -h 127.0.0.1 -p 5432 && exit 0
    sleep 1
  done
fi
echo "postgres: not available at 127.0.0.1:5432; PostgreSQL tests will fail" >&2
exit 0
