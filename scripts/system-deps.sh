#!/usr/bin/env bash
# System packages the Python packages need at run time. Idempotent, and quiet when all
# is present. Mooncake's transfer engine links against libibverbs even in TCP mode; the
# tests validate docker-compose.yml with `docker-compose config` (no container engine needed).
set -euo pipefail
need=()
ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1' || need+=(libibverbs1)
command -v docker-compose >/dev/null || need+=(docker-compose)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "note: missing system packages ${need[*]} (the RDMA transport and the compose tests need them)" >&2
  fi
fi
