#!/usr/bin/env bash
# fetch-wheels.sh DIR [LOCK]: download every wheel LOCK (default hack/image/requirements.lock) pins into DIR
# (binary wheels only, hashes checked) and copy the lock there as requirements.lock: what install.sh installs
# from. Uses the `pip` on PATH or $PIP.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dir="$1"
lock="${2:-$here/requirements.lock}"
mkdir -p "$dir"
unset PIP_FIND_LINKS  # only the index: a local wheel directory of the environment is no source here
${PIP:-pip} download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --require-hashes \
    -r "$lock" -d "$dir"
cp "$lock" "$dir/requirements.lock"
