#!/usr/bin/env bash
# Runs pytest with the services that scripts/ci_system_deps.sh prepared (PostgreSQL URL, vLLM venv).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${RUBRICSEARCH_TEST_POSTGRES_URL:-}" ] && [ -f .ci-state/postgres.env ]; then
  # shellcheck disable=SC1091
  source .ci-state/postgres.env
  export RUBRICSEARCH_TEST_POSTGRES_URL
fi
if [ "${RUBRICSEARCH_REQUIRE_POSTGRES:-0}" = "1" ] && [ -z "${RUBRICSEARCH_TEST_POSTGRES_URL:-}" ]; then
  echo "RUBRICSEARCH_REQUIRE_POSTGRES=1 but no PostgreSQL was started (scripts/ci_system_deps.sh)" >&2
  exit 1
fi
# in CI the slowest tests are listed, so the suite's time can be kept within its budget
.venv/bin/python -m pytest ${CI:+--durations=40} "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests" >&2
fi
exit "$rc"
