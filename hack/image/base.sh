#!/usr/bin/env bash
# base.sh ROOTFS_DIR: the Debian bookworm root file system of the gpupool image, built from Debian packages
# alone (no registry): mmdebstrap's `essential` variant (Essential: yes packages: libc, coreutils, dash,
# dpkg, ...; no apt) plus hack/image/packages.txt, merged /usr, without docs (copyright files kept), man
# pages, info, locales or glibc's iconv modules (gconv, 8 MiB: Python has its own codecs), and a `nonroot`
# user (uid/gid 65532) the image runs as.
# hack/image/build.py caches the result by the hash of this script and packages.txt.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
target="$1"
packages="$(sed 's/#.*//' "$here/packages.txt" | xargs | tr ' ' ,)"
mmdebstrap --quiet --variant=essential --include="$packages" \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/lintian/*' \
    --dpkgopt='path-exclude=/usr/lib/x86_64-linux-gnu/gconv/*' \
    --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/var/cache/debconf/*-old "$1"/var/lib/dpkg/*-old "$1"/var/log/* "$1"/tmp/*' \
    --customize-hook='echo "nonroot:x:65532:65532:nonroot:/home/nonroot:/usr/sbin/nologin" >> "$1/etc/passwd"' \
    --customize-hook='echo "nonroot:x:65532:" >> "$1/etc/group"' \
    --customize-hook='install -d -o 65532 -g 65532 -m 0755 "$1/home/nonroot"' \
    bookworm "$target" \
    "deb http://deb.debian.org/debian bookworm main" \
    "deb http://deb.debian.org/debian bookworm-updates main" \
    "deb http://deb.debian.org/debian-security bookworm-security main"
