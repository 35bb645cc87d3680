#!/usr/bin/env bash
# `make images`: every image docker-compose.yml uses, with or without Docker Hub.
#
#   TOKENYARD_IMAGE_SOURCE  hub     the application on python:3.11-slim; the stack's images
#                                   (NATS, Redis, PostgreSQL) pulled as the compose file names them
#                           debian  everything from Debian's packages: a base made by mmdebstrap
#                                   (docker import), Python, NATS, Redis, PostgreSQL and
#                                   Prometheus built on it (infra/images/)
#                           auto    (default) hub when python:3.11-slim can be pulled, else debian
#   DEBIAN_MIRROR           the Debian mirror the base image is made from and its apt uses
#                           (default http://deb.debian.org/debian; -security beside it)
#   TORCH_WHEEL_DIR         a folder holding torch-2.13.0+cpu-cp311-*.whl; default: pip's
#                           find-links folders that hold one; else torch comes from TORCH_INDEX
#   TORCH_INDEX             default https://download.pytorch.org/whl/cpu
#   SITE_CA_DIR             certificate authorities (*.crt) the image's pip trusts beside
#                           Debian's (default /usr/local/share/ca-certificates)
#
# With the debian source, build/images.env names the images built; the compose file reads
# them from the environment or from .env (`cat build/images.env >> .env`).
set -euo pipefail
cd "$(dirname "$0")/.."

SOURCE="${TOKENYARD_IMAGE_SOURCE:-auto}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
TORCH_INDEX="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
APP_IMAGE="${TOKENYARD_IMAGE:-tokenyard:local}"
TORCH_WHEEL="torch-2.13.0+cpu-cp311-*.whl"
DEBIAN_BASE=tokenyard/debian:bookworm
# The images built from Debian's packages: name, build folder under infra/images.
DEBIAN_IMAGES=(
    "tokenyard/python:3.11 python"
    "tokenyard/nats:2.9 nats"
    "tokenyard/redis:7.0 redis"
    "tokenyard/postgres:15 postgres"
    "tokenyard/prometheus:2.42 prometheus"
)
# The compose variable that each stack image overrides.
declare -A COMPOSE_VARIABLE=(
    [nats]=TOKENYARD_NATS_IMAGE [redis]=TOKENYARD_REDIS_IMAGE
    [postgres]=TOKENYARD_POSTGRES_IMAGE [prometheus]=TOKENYARD_PROMETHEUS_IMAGE
)

log() { echo "[images] $*"; }

timed() {  # timed NAME COMMAND...: run it niced, then say how long it took
    local name="$1" start=$SECONDS
    shift
    nice -n 19 "$@"
    log "$name: $((SECONDS - start)) s"
}

# The torch wheel into infra/images/wheels (the Dockerfile's torch stage reads it from there).
stage_wheels() {
    rm -f infra/images/wheels/*.whl
    local dirs=("${TORCH_WHEEL_DIR:-}")
    if [ -z "${TORCH_WHEEL_DIR:-}" ]; then
        # pip's find-links, from its config files and PIP_FIND_LINKS
        mapfile -t dirs < <(python3 -m pip config list 2>/dev/null \
            | sed -n "s/^.*find-links='\(.*\)'$/\1/p" | tr ' ' '\n')
        dirs+=(${PIP_FIND_LINKS:-})
    fi
    local dir wheel
    for dir in "${dirs[@]}"; do
        for wheel in "${dir#file://}"/$TORCH_WHEEL; do
            if [ -f "$wheel" ]; then
                ln -f "$wheel" infra/images/wheels/ 2>/dev/null || cp "$wheel" infra/images/wheels/
                log "torch from $wheel"
                return
            fi
        done
    done
    [ -z "${TORCH_WHEEL_DIR:-}" ] || { log "no $TORCH_WHEEL in $TORCH_WHEEL_DIR"; exit 1; }
    log "torch from $TORCH_INDEX"
}

# The site's certificate authorities into infra/images/ca-certificates (the Dockerfile's).
stage_certificates() {
    rm -f infra/images/ca-certificates/*.crt
    local dir="${SITE_CA_DIR:-/usr/local/share/ca-certificates}" cert
    for cert in "$dir"/*.crt; do
        [ -f "$cert" ] || continue
        cp "$cert" infra/images/ca-certificates/
        log "trusting $cert"
    done
}

# A minimal Debian made by mmdebstrap from the mirror, imported as an image.
debian_base() {
    if docker image inspect "$DEBIAN_BASE" >/dev/null 2>&1; then
        log "$DEBIAN_BASE: present"
        return
    fi
    command -v mmdebstrap >/dev/null || { log "mmdebstrap is missing: apt-get install mmdebstrap"; exit 1; }
    local start=$SECONDS
    nice -n 19 mmdebstrap --variant=minbase --include=ca-certificates \
        --aptopt='APT::Install-Recommends "false"' \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
        bookworm - "deb $MIRROR bookworm main" "deb $MIRROR bookworm-updates main" \
        "deb ${MIRROR%/debian}/debian-security bookworm-security main" \
        | nice -n 19 docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["bash"]' - "$DEBIAN_BASE"
    log "$DEBIAN_BASE: $((SECONDS - start)) s"
}

debian_image() {  # debian_image NAME FOLDER: one image of infra/images on the Debian base
    timed "$1" docker build -q -t "$1" --build-arg BASE_IMAGE="$DEBIAN_BASE" "infra/images/$2"
}

build_debian() {
    debian_base
    {
        echo "TOKENYARD_BASE_IMAGE=${DEBIAN_IMAGES[0]% *}"
        # testcontainers' reaper (testcontainers/ryuk) is on Docker Hub alone; the tests
        # stop their containers themselves.
        echo "TESTCONTAINERS_RYUK_DISABLED=true"
    } > build/images.env
    local entry name folder stack_pid python_image
    read -r python_image folder <<<"${DEBIAN_IMAGES[0]}"
    debian_image "$python_image" "$folder"
    # The stack's images while the application's builds: both wait on downloads and dpkg
    # as much as on the CPU.
    (
        for entry in "${DEBIAN_IMAGES[@]:1}"; do
            read -r name folder <<<"$entry"
            debian_image "$name" "$folder"
        done
    ) &
    stack_pid=$!
    timed "$APP_IMAGE" docker build -t "$APP_IMAGE" --build-arg BASE_IMAGE="$python_image" \
        --build-arg TORCH_INDEX="$TORCH_INDEX" .
    wait "$stack_pid"
    for entry in "${DEBIAN_IMAGES[@]:1}"; do
        read -r name folder <<<"$entry"
        echo "${COMPOSE_VARIABLE[$folder]}=$name" >> build/images.env
    done
    log "the compose file's stack images: build/images.env (export it, or append it to .env)"
}

build_hub() {
    timed "$APP_IMAGE" docker build -t "$APP_IMAGE" --build-arg TORCH_INDEX="$TORCH_INDEX" .
    : > build/images.env
    local image
    for image in nats:2.10-alpine redis:7 postgres:16; do
        timed "$image" docker pull -q "$image"
    done
}

mkdir -p build
if [ "$SOURCE" = auto ]; then
    if docker image inspect python:3.11-slim >/dev/null 2>&1 || docker pull -q python:3.11-slim >/dev/null 2>&1; then
        SOURCE=hub
    else
        SOURCE=debian
    fi
    log "source: $SOURCE"
fi
stage_wheels
stage_certificates
case "$SOURCE" in
    hub) build_hub ;;
    debian) build_debian ;;
    *) log "TOKENYARD_IMAGE_SOURCE must be hub, debian or auto, not $SOURCE"; exit 2 ;;
esac
docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^tokenyard' | sed 's/^/[images] /'
