#!/usr/bin/env bash
# Start a throw-away PostgreSQL for the test suite on 127.0.0.1:54329 (idempotent: safe to run again).
#
#   eval "$(scripts/ci_postgres.sh)"      # installs if needed, starts, creates the db, exports the URL
#   scripts/ci_postgres.sh stop           # stops the cluster (data dir is kept)
#   scripts/ci_postgres.sh destroy        # stops it and removes the data dir
#
# Only the export line goes to stdout; progress goes to stderr. The cluster listens on 127.0.0.1 only,
# runs without fsync (test data is disposable) and lives under $RUBRICSEARCH_PG_HOME.
set -euo pipefail

PORT="${RUBRICSEARCH_PG_PORT:-54329}"
HOME_DIR="${RUBRICSEARCH_PG_HOME:-/tmp/rubricsearch-pg}"
DATA="$HOME_DIR/data"
LOG="$HOME_DIR/postgres.log"
DB="rubricsearch_test"
ROLE="rubricsearch"
PASSWORD="rubricsearch"

log() { echo "ci_postgres: $*" >&2; }

find_bin() {
    local d
    d="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)"
    if [[ -n "$d" && -x "$d/initdb" ]]; then echo "$d"; return 0; fi
    if command -v initdb >/dev/null 2>&1; then dirname "$(command -v initdb)"; return 0; fi
    return 1
}

if ! BIN="$(find_bin)"; then
    log "PostgreSQL not found; installing from apt"
    if [[ "$(id -u)" != 0 ]]; then log "need root to install postgresql"; exit 1; fi
    apt-get update >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y postgresql >&2
    BIN="$(find_bin)"
fi

# initdb and postgres refuse to run as root: use the postgres account when we are root.
if [[ "$(id -u)" == 0 ]]; then
    id postgres >/dev/null 2>&1 || useradd --system --home-dir "$HOME_DIR" --shell /bin/sh postgres
    as_pg() { runuser -u postgres -- "$@"; }
else
    as_pg() { "$@"; }
fi

is_up() { "$BIN/pg_isready" -q -h 127.0.0.1 -p "$PORT"; }

case "${1:-start}" in
    stop|destroy)
        if [[ -s "$DATA/PG_VERSION" ]] && as_pg "$BIN/pg_ctl" -D "$DATA" status >/dev/null 2>&1; then
            as_pg "$BIN/pg_ctl" -D "$DATA" -m fast -w stop >&2
        fi
        if [[ "$1" == destroy ]]; then rm -rf "$HOME_DIR"; log "removed $HOME_DIR"; fi
        exit 0
        ;;
    start) ;;
    *) log "usage: $0 [start|stop|destroy]"; exit 2 ;;
esac

mkdir -p "$HOME_DIR"
[[ "$(id -u)" == 0 ]] && chown postgres: "$HOME_DIR"

if [[ ! -s "$DATA/PG_VERSION" ]]; then
    log "initdb $DATA"
    pwfile="$(mktemp)"
    echo "$PASSWORD" >"$pwfile"
    chmod 644 "$pwfile"
    as_pg "$BIN/initdb" -D "$DATA" -U postgres -E UTF8 --no-locale \
        --auth-local=trust --auth-host=scram-sha-256 --pwfile="$pwfile" >&2
    rm -f "$pwfile"
fi

if ! is_up; then
    log "starting on 127.0.0.1:$PORT"
    as_pg "$BIN/pg_ctl" -D "$DATA" -l "$LOG" -w -t 60 start -o \
        "-c listen_addresses=127.0.0.1 -p $PORT -c unix_socket_directories=$HOME_DIR \
         -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200" >&2
fi

psql_pg() { as_pg "$BIN/psql" -h "$HOME_DIR" -p "$PORT" -U postgres -d postgres -v ON_ERROR_STOP=1 -qtAX "$@"; }

if [[ "$(psql_pg -c "SELECT 1 FROM pg_roles WHERE rolname = '$ROLE'")" != 1 ]]; then
    psql_pg -c "CREATE ROLE $ROLE LOGIN PASSWORD '$PASSWORD' CREATEDB" >&2
fi
if [[ "$(psql_pg -c "SELECT 1 FROM pg_database WHERE datname = '$DB'")" != 1 ]]; then
    psql_pg -c "CREATE DATABASE $DB OWNER $ROLE" >&2
fi
log "ready"
echo "export RUBRICSEARCH_TEST_POSTGRES_URL=postgresql+psycopg://$ROLE:$PASSWORD@127.0.0.1:$PORT/$DB"
