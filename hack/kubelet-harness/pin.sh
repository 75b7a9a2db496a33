#!/usr/bin/env bash
# Re-pins the kubelet harness to the Kubernetes release of hack/cluster/gomod/kubernetes (run it after
# hack/cluster/pin-kubernetes.sh): go.mod takes that module's require and replace blocks, go.sum its sums.
# The harness imports only packages of k8s.io/kubernetes (and the Prometheus model its metrics use), so the
# cluster's module graph is the harness's, and no network is needed. `go mod tidy` is not used: it would
# also want the test dependencies of every imported package, which the cluster build never downloads.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cluster="$here/../cluster/gomod/kubernetes"
GO_BIN="${GO:-$(command -v go || echo /usr/local/go/bin/go)}"
direct='k8s.io/kubernetes|github.com/prometheus/client_model'  # imported by main.go / linkname.go

{
    echo "// Pins the Kubernetes release whose kubelet device manager (k8s.io/kubernetes/pkg/kubelet/cm/devicemanager)"
    echo "// the harness links: the same release as hack/cluster/gomod/kubernetes (build-bins.sh refuses a mismatch)."
    echo "// Nothing here is compiled into gpupool. Regenerate with hack/kubelet-harness/pin.sh."
    echo "module gpupool.local/hack/kubelet-harness"
    echo
    grep -E '^go [0-9]' "$cluster/go.mod"
    echo
    sed -n '/^require (/,/^)/p' "$cluster/go.mod" | sed -E "s#^(\t($direct) \S+) // indirect#\1#"
    echo
    sed -n '/^\/\/ k8s.io\/kubernetes requires its staging/,$p' "$cluster/go.mod"
} > "$here/go.mod.new"
mv "$here/go.mod.new" "$here/go.mod"
cp "$cluster/go.sum" "$here/go.sum"
(cd "$here" && "$GO_BIN" list -mod=readonly -deps . >/dev/null)
echo "pinned $(cd "$here" && "$GO_BIN" list -mod=readonly -m -f '{{.Path}} {{.Version}}' k8s.io/kubernetes) in $here/go.mod"
