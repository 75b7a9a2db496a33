#!/usr/bin/env bash
# fetch-wheels.sh DIR: download every wheel hack/image/requirements.lock pins into DIR (binary wheels only,
# hashes checked) and copy the lock there: what install.sh installs from. Uses the `pip` on PATH or $PIP.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dir="$1"
mkdir -p "$dir"
unset PIP_FIND_LINKS  # only the index: a local wheel directory of the environment is no source here
${PIP:-pip} download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --require-hashes \
    -r "$here/requirements.lock" -d "$dir"
cp "$here/requirements.lock" "$dir/requirements.lock"
