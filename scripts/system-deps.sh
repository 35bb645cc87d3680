#!/usr/bin/env bash
# System packages the Python packages need at run time. Idempotent, and quiet when all
# is present. Mooncake's transfer engine links against libibverbs even in TCP mode; the
# tests validate docker-compose.yml with `docker-compose config` (no container engine needed).
set -euo pipefail
# Usage: system-deps.sh [serve|test]: serving needs libibverbs alone; the test suite also
# needs docker-compose (the compose file's checks) and chromium (the console's browser test).
scope=${1:-test}
need=()
ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1' || need+=(libibverbs1)
if [ "$scope" = test ]; then
  command -v docker-compose >/dev/null || need+=(docker-compose)
  [ -x /usr/bin/chromium ] || need+=(chromium)
fi
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "  apt-get install ${need[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "note: missing system packages ${need[*]} (the RDMA transport, the compose tests and the console's browser test need them)" >&2
  fi
fi
