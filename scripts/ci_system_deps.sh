#!/usr/bin/env bash
# System packages the test suite uses for real: PostgreSQL (catalog) and Debian Chromium (browser tests).
# Idempotent; needs root for apt (CI runs as root). Writes .ci-state/postgres.env for scripts/run_tests.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .ci-state
if [ "$(id -u)" -ne 0 ]; then
  echo "not root: skipping apt installs (PostgreSQL / browser tests will be skipped)" >&2
  exit 0
fi
need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)  # validates compose.yaml (no engine needed)
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then need+=(postgresql); fi
if [ "${#need[@]}" -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
if [ -f scripts/ci_postgres.sh ]; then
  bash scripts/ci_postgres.sh | grep -o 'RUBRICSEARCH_TEST_POSTGRES_URL=.*' > .ci-state/postgres.env || true
fi
