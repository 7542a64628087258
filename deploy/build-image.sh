#!/usr/bin/env bash
# Builds the Sluice image (deploy/Dockerfile) with podman and the runc runtime.
#
#   deploy/build-image.sh [TAG]          default TAG: sluice:<version in pyproject.toml>
#
# No container registry needs to be reachable: when no debian:bookworm-slim image is in local
# storage, one is made with `debootstrap --variant=minbase bookworm` and imported under that
# name. pip inside the build needs the package index: the host's index settings (PIP_INDEX_URL,
# PIP_EXTRA_INDEX_URL, PIP_TRUSTED_HOST, or pip's global.index-url) are passed on as the build
# argument PIP_ARGS, and the host's CA bundle is handed to the build as a secret (never stored in a
# layer), so a TLS-intercepting proxy that the host trusts is trusted by pip too.
#
# Environment: PODMAN (default "podman --runtime runc"; crun fails on cgroup v1 kernels here),
# DEBIAN_MIRROR (default: the host's first Debian mirror, else http://deb.debian.org/debian).
# Prints the build time and the image size at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -n 1)
tag=${1:-sluice:${version}}
read -r -a podman <<<"${PODMAN:-podman --runtime runc}"
base=docker.io/library/debian:bookworm-slim
start=$(date +%s.%N)

host_mirror() {
    local m
    m=$(grep -hs -m1 -oE 'https?://[^ ]+/debian/?$' /etc/apt/sources.list.d/*.sources 2>/dev/null \
        | head -n 1 || true)
    [ -n "$m" ] || m=$(grep -hs -m1 -oE 'https?://[^ ]+/debian/? ' /etc/apt/sources.list \
        2>/dev/null | head -n 1 | tr -d ' ' || true)
    echo "${m:-http://deb.debian.org/debian}"
}

if ! "${podman[@]}" image exists "$base"; then
    command -v debootstrap >/dev/null || { echo "build-image: needs debootstrap" >&2; exit 1; }
    mirror=${DEBIAN_MIRROR:-$(host_mirror)}
    root=$(mktemp -d /var/tmp/sluice-rootfs.XXXXXX)
    trap 'rm -rf "$root"' EXIT
    echo "build-image: no $base in local storage; debootstrap from $mirror"
    debootstrap --variant=minbase bookworm "$root" "$mirror" >"$root.log" 2>&1 \
        || { tail -n 20 "$root.log" >&2; rm -f "$root.log"; exit 1; }
    rm -f "$root.log"
    # What the official slim image has: updates and security suites, no package caches.
    cat >"$root/etc/apt/sources.list" <<EOF
deb ${mirror%/} bookworm main
deb ${mirror%/} bookworm-updates main
deb ${mirror%/}-security bookworm-security main
EOF
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
        "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/locale/*
    tar -C "$root" -c . | "${podman[@]}" import --change 'CMD ["bash"]' - "$base" >/dev/null
    rm -rf "$root"
    trap - EXIT
    echo "build-image: imported $base"
fi

pip_args=()
index=${PIP_INDEX_URL:-$(pip config get global.index-url 2>/dev/null || true)}
# file:// indexes and find-links are this host's directories: the build cannot see them.
[[ "$index" =~ ^https?:// ]] && pip_args+=(--index-url "$index")
for url in ${PIP_EXTRA_INDEX_URL:-}; do
    [[ "$url" =~ ^https?:// ]] && pip_args+=(--extra-index-url "$url")
done
for host in ${PIP_TRUSTED_HOST:-}; do pip_args+=(--trusted-host "$host"); done
ca=${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
secret=()
[ -s "$ca" ] && secret=(--secret "id=hostca,src=$ca")

"${podman[@]}" build --pull=never --network host --layers \
    --ulimit nofile=4096:4096 --ulimit nproc=4096:4096 \
    "${secret[@]}" --build-arg "PIP_ARGS=${pip_args[*]}" \
    --ignorefile deploy/containerignore -f deploy/Dockerfile -t "$tag" .

end=$(date +%s.%N)
size=$("${podman[@]}" image inspect "$tag" --format '{{.Size}}')
awk -v t="$tag" -v a="$start" -v b="$end" -v s="$size" \
    'BEGIN { printf "build-image: %s built in %.1f s, %d MB\n", t, b - a, s / 1e6 }'
