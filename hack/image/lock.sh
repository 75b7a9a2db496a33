#!/usr/bin/env bash
# Regenerate hack/image/requirements.lock: every Python distribution of the container image (gpupool's
# dependencies plus its `server` extra, not matplotlib), pinned with hashes, resolved for CPython 3.11 on
# Linux x86_64 (Debian bookworm's python3.11). Run after changing the dependencies in pyproject.toml:
#   bash hack/image/lock.sh            (needs PyPI; uses a throwaway venv with pip-tools)
# The build installs with `pip install --require-hashes --no-deps`, so an unlisted or altered file fails it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY="${PYTHON:-python3}"
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), "lock.sh needs Python 3.11 (the image runs it)"'
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$PY" -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install -q 'pip-tools==7.6.2'
cd hack/image  # pip-compile writes the paths of its inputs into the header: keep them relative
CUSTOM_COMPILE_COMMAND="bash hack/image/lock.sh" "$tmp/venv/bin/pip-compile" -q --generate-hashes \
    --allow-unsafe --strip-extras --extra server --no-emit-index-url --no-emit-find-links --output-file requirements.lock \
    ../../pyproject.toml requirements-tools.in
echo "wrote hack/image/requirements.lock"
