#!/usr/bin/env bash
# Runs pytest with the services that scripts/ci_system_deps.sh prepared (PostgreSQL URL, vLLM venv).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${RUBRICSEARCH_TEST_POSTGRES_URL:-}" ] && [ -f .ci-state/postgres.env ]; then
  # shellcheck disable=SC1091
  source .ci-state/postgres.env
  export RUBRICSEARCH_TEST_POSTGRES_URL
fi
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests" >&2
fi
exit "$rc"
