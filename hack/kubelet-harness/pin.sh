#!/usr/bin/env bash
# Re-pins the kubelet harness to the Kubernetes release of hack/cluster/gomod/kubernetes (run it after
# hack/cluster/pin-kubernetes.sh): go.mod takes that module's require and replace blocks, go.sum its sums.
# The harness imports only packages of k8s.io/kubernetes's own module graph, so the cluster's requirements
# and sums are the harness's, and no network is needed. `go mod tidy` is not used: it would
# also want the test dependencies of every imported package, which the cluster build never downloads.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cluster="$here/../cluster/gomod/kubernetes"
GO_BIN="${GO:-$(command -v go || echo /usr/local/go/bin/go)}"

write() {  # write DIRECT: go.mod with the modules in the regex DIRECT not marked // indirect
    local direct="$1"
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
}

cp "$cluster/go.sum" "$here/go.sum"
write 'k8s.io/kubernetes'
# the modules of the packages the harness imports are its direct requirements
direct="$(cd "$here" && "$GO_BIN" list -mod=readonly -f '{{range .Imports}}{{.}} {{end}}' . |
    xargs "$GO_BIN" list -mod=readonly -f '{{with .Module}}{{.Path}}{{end}}' | grep -v '^$' | sort -u | paste -sd'|')"
write "${direct//./\\.}"
(cd "$here" && "$GO_BIN" list -mod=readonly -deps . >/dev/null)
echo "pinned $(cd "$here" && "$GO_BIN" list -mod=readonly -m -f '{{.Path}} {{.Version}}' k8s.io/kubernetes) in $here/go.mod"
