#!/usr/bin/env bash
# Installs, as root and only when missing, the Debian packages Sluice's tests and benchmarks use,
# and links the kernel headers bcc needs (below; docs/operating/datapath.md).
# Not root: prints what is missing and exits 0 (the tests then skip, or fail under SLUICE_STRICT=1).
set -euo pipefail

need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v dnsmasq >/dev/null || need+=(dnsmasq-base)  # the DNS discovery tests' DNS server
command -v ip >/dev/null || need+=(iproute2)
command -v wrk >/dev/null || need+=(wrk)
command -v h2load >/dev/null || need+=(nghttp2-client)
command -v nginx >/dev/null || need+=(nginx-light)
command -v tc >/dev/null || need+=(iproute2)
[ -e /usr/lib/python3/dist-packages/bcc/__init__.py ] || need+=(python3-bpfcc)
ls -d /usr/src/linux-headers-*-amd64 >/dev/null 2>&1 || need+=(linux-headers-amd64)
command -v promtool >/dev/null || need+=(prometheus)  # promtool checks deploy/prometheus rules
# The status page's browser test (Playwright drives Debian's chromium) and the image build/run
# test (podman with runc; debootstrap makes the base image when no registry is reachable).
command -v chromium >/dev/null || need+=(chromium fonts-dejavu-core)
command -v podman >/dev/null || need+=(podman)
command -v runc >/dev/null || need+=(runc)
command -v debootstrap >/dev/null || need+=(debootstrap)

if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "host-setup: not root; missing Debian packages: ${need[*]}" >&2
        exit 0
    fi
    echo "host-setup: installing ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# bcc compiles against /lib/modules/$(uname -r)/build. When the running kernel has no headers
# package of its own (a VM kernel), point build at Debian's -amd64 headers and source at the
# matching -common tree.
if [ "$(id -u)" = 0 ]; then
    mod=/lib/modules/$(uname -r)
    if [ ! -e "$mod/build/Makefile" ]; then
        hdr=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n 1 || true)
        if [ -n "$hdr" ]; then
            common=${hdr%-amd64}-common
            mkdir -p "$mod"
            ln -sfn "$hdr" "$mod/build"
            [ -d "$common" ] && ln -sfn "$common" "$mod/source"
            echo "host-setup: linked $mod/build -> $hdr"
        fi
    fi
fi

# bpffs: the eBPF datapath pins its maps under /sys/fs/bpf/sluice, so a restarted gateway (or
# `sluice ebpf status`) reopens the same counters, budgets and deny entries. Without it the
# classifier still works; its maps then live only as long as the attached program.
if [ "$(id -u)" = 0 ] && ! grep -q " /sys/fs/bpf bpf " /proc/mounts; then
    mkdir -p /sys/fs/bpf
    if mount -t bpf bpf /sys/fs/bpf; then
        echo "host-setup: mounted bpffs on /sys/fs/bpf"
    else
        echo "host-setup: could not mount bpffs; pinned eBPF maps are unavailable" >&2
    fi
fi
