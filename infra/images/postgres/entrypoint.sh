#!/bin/sh
# First start: a cluster with the image's usual variables; then the server, every interface.
set -eu
user="${POSTGRES_USER:-postgres}"
auth="${POSTGRES_HOST_AUTH_METHOD:-scram-sha-256}"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile="$(mktemp)"
    printf '%s\n' "${POSTGRES_PASSWORD:-}" > "$pwfile"
    # initdb refuses an empty password file: no password, no file.
    initdb --username="$user" ${POSTGRES_PASSWORD:+--pwfile="$pwfile"} \
        --auth-local=trust --auth-host="$auth" --encoding=UTF8 --locale=C.UTF-8
    rm -f "$pwfile"
    echo "host all all all $auth" >> "$PGDATA/pg_hba.conf"
    db="${POSTGRES_DB:-$user}"
    if [ "$db" != postgres ]; then
        echo "CREATE DATABASE \"$db\";" | postgres --single -D "$PGDATA" postgres >/dev/null
    fi
fi
exec postgres -c listen_addresses='*' "$@"
