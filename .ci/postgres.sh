#!/usr/bin/env bash
# A throwaway PostgreSQL server for the store tests (tests/test_store.py, marker `postgres`).
#
#   source .ci/postgres.sh     # exports FEDASYNC_TEST_POSTGRES_URL (what .ci/run does)
#   bash .ci/postgres.sh       # prints the export line
#
# Installs Debian's `postgresql` with apt-get if no initdb is found, creates a cluster in
# $FEDASYNC_PG_DIR (default /tmp/fedasync-pg) listening on 127.0.0.1:$FEDASYNC_PG_PORT (default
# 54329) with trust authentication (a test server: local connections only), starts it and
# creates the database $FEDASYNC_PG_DB (default fedasync_test). Idempotent: a second call
# reuses the running server. When this call started the server it exports FEDASYNC_PG_STOP, the
# command that stops it (.ci/run runs it on exit). By hand:
#   runuser -u postgres -- /usr/lib/postgresql/*/bin/pg_ctl -D /tmp/fedasync-pg stop
# Safe to source from a shell with `set -e`: failures return 1 with a message, never exit.

_fedasync_pg() {
  local port="${FEDASYNC_PG_PORT:-54329}" dir="${FEDASYNC_PG_DIR:-/tmp/fedasync-pg}" db="${FEDASYNC_PG_DB:-fedasync_test}"
  local bin as=()
  case ":$PATH:" in *:/usr/sbin:*) ;; *) PATH="$PATH:/usr/sbin:/sbin" ;; esac  # runuser lives there
  if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    echo "postgres.sh: installing postgresql (apt-get)" >&2
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql; } >&2; then
      echo "postgres.sh: apt-get install postgresql failed" >&2
      return 1
    fi
  fi
  bin="$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)"
  if [ "$(id -u)" = 0 ]; then
    # the server refuses to run as root: run it as the package's postgres user
    as=(runuser -u postgres --)
    mkdir -p "$dir" && chown postgres: "$dir" && chmod 700 "$dir" || return 1
  else
    mkdir -p "$dir" && chmod 700 "$dir" || return 1
  fi
  if [ ! -f "$dir/PG_VERSION" ]; then
    "${as[@]}" "$bin/initdb" -D "$dir" -A trust -U postgres -E UTF8 >"$dir.initdb.log" 2>&1 || {
      echo "postgres.sh: initdb failed:" >&2; cat "$dir.initdb.log" >&2; return 1; }
  fi
  unset FEDASYNC_PG_STOP
  if ! "${as[@]}" "$bin/pg_ctl" -D "$dir" status >/dev/null 2>&1; then
    "${as[@]}" "$bin/pg_ctl" -D "$dir" -l "$dir/server.log" -w -t 60 \
      -o "-c listen_addresses=127.0.0.1 -p $port -k $dir -c fsync=off" start >/dev/null || {
      echo "postgres.sh: the server did not start:" >&2; tail -n 20 "$dir/server.log" >&2; return 1; }
    # this call started it: how to stop it (only then; a server found running is left alone)
    export FEDASYNC_PG_STOP="${as[*]} $bin/pg_ctl -D $dir stop -m fast"
  fi
  if ! "${as[@]}" "$bin/psql" -h 127.0.0.1 -p "$port" -U postgres -d postgres -tAc \
        "SELECT 1 FROM pg_database WHERE datname = '$db'" | grep -q 1; then
    "${as[@]}" "$bin/createdb" -h 127.0.0.1 -p "$port" -U postgres "$db" || return 1
  fi
  export FEDASYNC_TEST_POSTGRES_URL="postgresql+psycopg://postgres@127.0.0.1:$port/$db"
  echo "export FEDASYNC_TEST_POSTGRES_URL=$FEDASYNC_TEST_POSTGRES_URL"
}

_fedasync_pg
_fedasync_pg_rc=$?
unset -f _fedasync_pg
if [ "${BASH_SOURCE[0]}" != "$0" ]; then
  return $_fedasync_pg_rc
else
  exit $_fedasync_pg_rc
fi
