#!/usr/bin/env bash
# Regenerate the image lock files: every Python distribution of a container image, pinned with hashes,
# resolved for CPython 3.11 on Linux x86_64 (Debian bookworm's python3.11). Run after changing the
# dependencies in pyproject.toml (needs PyPI; uses a throwaway venv with pip-tools):
#   bash hack/image/lock.sh        hack/image/requirements.lock: gpupool:<version>, gpupool's dependencies
#                                  plus its `server` extra (not matplotlib)
#   bash hack/image/lock.sh ray    hack/image/requirements-ray.lock: gpupool-ray:<version>, the same plus the
#                                  `ray` extra and ray[default] (hack/image/requirements-ray.in: the dashboard)
# The build installs with `pip install --require-hashes --no-deps`, so an unlisted or altered file fails it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
variant="${1:-}"
case "$variant" in
    "") out=requirements.lock; extras=(--extra server); inputs=(requirements-tools.in) ;;
    ray) out=requirements-ray.lock; extras=(--extra server --extra ray); inputs=(requirements-tools.in requirements-ray.in) ;;
    *) echo "usage: bash hack/image/lock.sh [ray]" >&2; exit 2 ;;
esac
PY="${PYTHON:-python3}"
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), "lock.sh needs Python 3.11 (the image runs it)"'
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$PY" -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install -q 'pip-tools==7.6.2'
cd hack/image  # pip-compile writes the paths of its inputs into the header: keep them relative
CUSTOM_COMPILE_COMMAND="bash hack/image/lock.sh${variant:+ $variant}" "$tmp/venv/bin/pip-compile" -q \
    --generate-hashes --allow-unsafe --strip-extras "${extras[@]}" --no-emit-index-url --no-emit-find-links \
    --output-file "$out" ../../pyproject.toml "${inputs[@]}"
echo "wrote hack/image/$out"
