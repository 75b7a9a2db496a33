#!/usr/bin/env bash
# Starts the local control plane (etcd + kube-apiserver + kwok on 127.0.0.1), or reuses the running one,
# and prints the admin kubeconfig path. The logic lives in gpupool_devcluster; this only calls it.
# Extra arguments go to `gpupool dev-cluster up`, e.g. `--with kube-scheduler`, `--name demo`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
exec .venv/bin/gpupool dev-cluster up "$@"
