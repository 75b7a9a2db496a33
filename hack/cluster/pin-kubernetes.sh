#!/usr/bin/env bash
# Re-pins hack/cluster/gomod/kubernetes to another Kubernetes release, e.g. `pin-kubernetes.sh v1.33.14`.
# k8s.io/kubernetes requires its staging modules (k8s.io/api, k8s.io/apiserver, ...) at v0.0.0 and
# replaces them with ./staging paths that exist only in its own repository; the wrapper module replaces
# each with the published module of the same release (v1.X.Y -> v0.X.Y). Then `make cluster-bins`.
set -euo pipefail
version="${1:?usage: pin-kubernetes.sh v1.MINOR.PATCH}"
[[ "$version" =~ ^v1\.([0-9]+)\.([0-9]+)$ ]] || { echo "pin-kubernetes: error: expected v1.X.Y, got $version" >&2; exit 2; }
staging="v0.${BASH_REMATCH[1]}.${BASH_REMATCH[2]}"
GO_BIN="${GO:-$(command -v go || echo /usr/local/go/bin/go)}"
dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/gomod/kubernetes"

upstream_mod="$(cd "$dir" && "$GO_BIN" mod download -json "k8s.io/kubernetes@$version" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')"
[[ -f "$upstream_mod" ]] || { echo "pin-kubernetes: error: cannot download k8s.io/kubernetes@$version" >&2; exit 1; }

{
    echo "// Pins the Kubernetes release whose kube-apiserver, kube-scheduler and kube-controller-manager"
    echo "// hack/cluster/build-bins.sh builds for the local dev cluster. Nothing here is compiled into gpupool."
    echo "// Regenerate for another release with: hack/cluster/pin-kubernetes.sh v1.X.Y"
    echo "module gpupool.local/hack/cluster/kubernetes"
    echo
    echo "go 1.24.0"
    echo
    echo "tool ("
    echo "	k8s.io/kubernetes/cmd/kube-apiserver"
    echo "	k8s.io/kubernetes/cmd/kube-controller-manager"
    echo "	k8s.io/kubernetes/cmd/kube-scheduler"
    echo "	k8s.io/kubernetes/cmd/kubelet"
    echo "	k8s.io/kubernetes/cmd/kube-proxy"
    echo ")"
    echo
    echo "require k8s.io/kubernetes $version"
    echo
    echo "// k8s.io/kubernetes requires its staging modules at v0.0.0 and replaces them with ./staging paths,"
    echo "// which only work inside its own repository; point each at the published module of the same release."
    echo "replace ("
    grep -E '^\s*k8s.io/\S+ => \./staging' "$upstream_mod" | awk -v v="$staging" '{print "\t" $1 " => " $1 " " v}'
    echo ")"
} > "$dir/go.mod"
rm -f "$dir/go.sum"
(cd "$dir" && "$GO_BIN" mod tidy)
bash "$(dirname "${BASH_SOURCE[0]}")/../kubelet-harness/pin.sh"  # the devicemanager harness follows the release
echo "pinned k8s.io/kubernetes $version (staging modules $staging) in $dir/go.mod; now run make cluster-bins"
