#!/usr/bin/env bash
# Builds the real Kubernetes parts of the dev cluster from the Go modules pinned in hack/cluster/gomod/:
#   kubernetes/ -> kube-apiserver, kube-controller-manager, kube-scheduler (one release, one `go build`)
#                  and, as component kubernetes-node, kubelet + kube-proxy (real nodes: dev-cluster up --with kubelet)
#   kwok/       -> kwok (simulates the fake GPU nodes and their pods)
#   helm/       -> helm
#   ../../kubelet-harness/ -> kubelet-harness (the kubelet's device manager of the same Kubernetes release,
#                 driven by the device plugin tests; see hack/kubelet-harness/main.go)
# into ${GPUPOOL_CACHE:-~/.cache/gpupool}/bin/<component>-<version>/, reusing a complete folder when present.
# The harness is our own code, so its folder is keyed by its source too: kubelet-harness-<version>-<hash>.
# A folder is complete when its .complete marker exists; builds go to a temp folder renamed at the end,
# so an interrupted build never looks complete.
#
# Usage: hack/cluster/build-bins.sh [kubernetes|kubernetes-node|kwok|helm|kubelet-harness ...]   (default: all five)
# Env:   GPUPOOL_CACHE (cache root), GO (go binary), GPUPOOL_BUILD_NICE (default 10)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
GOMOD_DIR="$HERE/gomod"
CACHE="${GPUPOOL_CACHE:-$HOME/.cache/gpupool}"
BIN_ROOT="$CACHE/bin"
NICE="${GPUPOOL_BUILD_NICE:-10}"
tmp=""

find_go() {
    if [[ -n "${GO:-}" ]]; then echo "$GO"; return; fi
    if command -v go >/dev/null 2>&1; then command -v go; return; fi
    if [[ -x /usr/local/go/bin/go ]]; then echo /usr/local/go/bin/go; return; fi
    echo "build-bins: error: no Go toolchain found (install Go >= 1.24 or set GO=/path/to/go)" >&2
    exit 2
}
GO_BIN="$(find_go)"

# version of MODULE as pinned by the wrapper module in DIR (read from go.mod, no network)
pinned_version() {
    local dir="$1" module="$2"
    (cd "$dir" && "$GO_BIN" list -mod=readonly -m -f '{{.Version}}' "$module")
}

# Runs `go build -v` for PKGS in DIR into OUT, showing "[n/total] package" progress.
# On a terminal the line is redrawn in place; in a log (CI) one line every 10%.
go_build() {
    local dir="$1" out="$2" ldflags="$3"; shift 3
    local pkgs=("$@") total n=0 step line
    total=$(cd "$dir" && "$GO_BIN" list -mod=readonly -deps "${pkgs[@]}" | wc -l)
    step=$(( total / 10 > 0 ? total / 10 : 1 ))
    (cd "$dir" && CGO_ENABLED=0 GOFLAGS="-trimpath -mod=readonly" \
        nice -n "$NICE" "$GO_BIN" build -v -ldflags "$ldflags" -o "$out/" "${pkgs[@]}") 2>&1 |
    while IFS= read -r line; do
        if [[ "$line" == *[\ :]* ]]; then
            # package paths have neither spaces nor colons: this is a compiler message, show it as is
            echo "$line"; continue
        fi
        n=$((n + 1))
        if [[ -t 1 ]]; then
            printf '\r\033[K  [%d/%d] %s' "$n" "$total" "${line:0:90}"
        elif (( n % step == 0 )); then
            echo "  [$n/$total] packages compiled"
        fi
    done
    local rc="${PIPESTATUS[0]}"
    [[ -t 1 ]] && printf '\r\033[K'
    return "$rc"
}

# build_component NAME MODULE LDFLAGS BINARIES PACKAGES...
# The module folder is gomod/NAME unless COMPONENT_DIR is set; COMPONENT_KEY, when set, is appended to the
# cache folder's name (e.g. COMPONENT_DIR=... COMPONENT_KEY=... build_component ...).
build_component() {
    local name="$1" module="$2" ldflags="$3" binaries="$4"; shift 4
    local dir="${COMPONENT_DIR:-$GOMOD_DIR/$name}" version dest start rc
    version="$(pinned_version "$dir" "$module")"
    dest="$BIN_ROOT/$name-$version${COMPONENT_KEY:+-$COMPONENT_KEY}"
    if [[ -f "$dest/.complete" ]]; then
        echo "build-bins: $name $version: reusing $dest"
        return 0
    fi
    ldflags="${ldflags//@VERSION@/$version}"
    echo "build-bins: $name $version: building $binaries (Go $("$GO_BIN" env GOVERSION), nice $NICE) ..."
    mkdir -p "$BIN_ROOT"
    tmp="$(mktemp -d "$BIN_ROOT/.$name-$version.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT  # $tmp is global: the trap sees it after this function returns
    start=$(date +%s)
    rc=0
    go_build "$dir" "$tmp" "$ldflags" "$@" || rc=$?
    if (( rc != 0 )); then
        echo "build-bins: error: go build of $name $version failed (exit $rc); see the messages above" >&2
        exit "$rc"
    fi
    for b in $binaries; do
        [[ -x "$tmp/$b" ]] || { echo "build-bins: error: $b missing after go build" >&2; exit 1; }
    done
    echo "$version built in $(( $(date +%s) - start ))s by $("$GO_BIN" env GOVERSION) on $(date -u +%FT%TZ)" \
        > "$tmp/.complete"
    chmod 755 "$tmp"
    rm -rf "$dest"
    mv "$tmp" "$dest"
    trap - EXIT
    echo "build-bins: $name $version: built in $(( $(date +%s) - start ))s -> $dest"
}

build_kubernetes() {
    # minor from the pinned tag vX.Y.Z; the version package otherwise reports v0.0.0-master
    local version major minor base="k8s.io/component-base/version"
    version="$(pinned_version "$GOMOD_DIR/kubernetes" k8s.io/kubernetes)"
    major="${version#v}"; major="${major%%.*}"
    minor="${version#v*.}"; minor="${minor%%.*}"
    build_component kubernetes k8s.io/kubernetes \
        "-s -w -X $base.gitVersion=@VERSION@ -X $base.gitMajor=$major -X $base.gitMinor=$minor \
-X $base.gitTreeState=clean -X $base.buildDate=1970-01-01T00:00:00Z" \
        "kube-apiserver kube-controller-manager kube-scheduler" \
        k8s.io/kubernetes/cmd/kube-apiserver \
        k8s.io/kubernetes/cmd/kube-controller-manager \
        k8s.io/kubernetes/cmd/kube-scheduler
}

build_kubernetes_node() {
    # the node side of the same release, for real nodes (dev-cluster up --with kubelet); CGO off as upstream
    local version major minor base="k8s.io/component-base/version"
    version="$(pinned_version "$GOMOD_DIR/kubernetes" k8s.io/kubernetes)"
    major="${version#v}"; major="${major%%.*}"
    minor="${version#v*.}"; minor="${minor%%.*}"
    build_component kubernetes-node k8s.io/kubernetes \
        "-s -w -X $base.gitVersion=@VERSION@ -X $base.gitMajor=$major -X $base.gitMinor=$minor \
-X $base.gitTreeState=clean -X $base.buildDate=1970-01-01T00:00:00Z" \
        "kubelet kube-proxy" \
        k8s.io/kubernetes/cmd/kubelet \
        k8s.io/kubernetes/cmd/kube-proxy
}

build_kwok() {
    build_component kwok sigs.k8s.io/kwok "-s -w" kwok sigs.k8s.io/kwok/cmd/kwok
}

build_helm() {
    local v="helm.sh/helm/v3/internal/version"
    build_component helm helm.sh/helm/v3 \
        "-s -w -X $v.version=@VERSION@ -X $v.gitTreeState=clean \
-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=33 \
-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=33" \
        helm helm.sh/helm/v3/cmd/helm
}

build_kubelet_harness() {
    local dir="$HERE/../kubelet-harness" harness cluster key
    dir="$(cd "$dir" && pwd)"
    harness="$(pinned_version "$dir" k8s.io/kubernetes)"
    cluster="$(pinned_version "$GOMOD_DIR/kubernetes" k8s.io/kubernetes)"
    if [[ "$harness" != "$cluster" ]]; then
        echo "build-bins: error: hack/kubelet-harness pins k8s.io/kubernetes $harness but the cluster pins $cluster;" \
             "re-pin it with hack/kubelet-harness/pin.sh" >&2
        exit 2
    fi
    # same key as gpupool_devcluster.binaries.kubelet_harness_key(): the sources, in name order
    key="$(cd "$dir" && LC_ALL=C ls go.mod go.sum *.go | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-12)"
    COMPONENT_DIR="$dir" COMPONENT_KEY="$key" build_component kubelet-harness k8s.io/kubernetes "-s -w" \
        kubelet-harness gpupool.local/hack/kubelet-harness
    # builds of older harness sources (50 MiB each) are not needed again: rebuilding one takes seconds
    local old
    for old in "$BIN_ROOT"/kubelet-harness-*; do
        [[ -d "$old" && "$old" != "$BIN_ROOT/kubelet-harness-$cluster-$key" ]] || continue
        echo "build-bins: kubelet-harness: removing $(basename "$old") (older sources)"
        rm -rf "$old"
    done
}

components=("$@")
(( ${#components[@]} )) || components=(kubernetes kubernetes-node kwok helm kubelet-harness)
for c in "${components[@]}"; do
    case "$c" in
        kubernetes) build_kubernetes ;;
        kubernetes-node) COMPONENT_DIR="$GOMOD_DIR/kubernetes" build_kubernetes_node ;;
        kwok) build_kwok ;;
        helm) build_helm ;;
        kubelet-harness) build_kubelet_harness ;;
        *) echo "build-bins: error: unknown component '$c' (kubernetes, kubernetes-node, kwok, helm, kubelet-harness)" >&2; exit 2 ;;
    esac
done
