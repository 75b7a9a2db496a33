#!/usr/bin/env bash
# Stops the local control plane started by up.sh: every process by its pid file, then etcd's data.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
exec .venv/bin/gpupool dev-cluster down "$@"
