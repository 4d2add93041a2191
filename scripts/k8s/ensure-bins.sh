#!/usr/bin/env bash
# Build the real-cluster binaries (etcd, etcdctl, kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl, then kubelet, kube-proxy and kube-router) from the pinned Go
# modules in tools/etcd, tools/k8s and tools/kube-router into a cache outside the checkout,
# skipping what is cached.
#
#   scripts/k8s/ensure-bins.sh [control-plane|all|check]     (default: all)
#
# Prints the bin directory on its last line. `check` builds nothing: it prints the directory
# if all the binaries are cached there and exits 3 if not. The cache key is the Kubernetes version,
# `go version`, and the sha256 of tools/*/go.mod and go.sum, so a changed pin or Go
# rebuilds; Go's own GOMODCACHE/GOCACHE make a rebuild after a small change quick.
# ORCHARD_K8S_CACHE overrides the cache root (default /var/cache/orchard/k8s).
set -euo pipefail

here=$(cd "$(dirname "$0")/../.." && pwd)
tier=${1:-all}
case "$tier" in
  control-plane | all | check) ;;
  *)
    echo "ensure-bins.sh: unknown tier '$tier' (use control-plane, all or check)" >&2
    exit 2
    ;;
esac

# A login shell has Go's own install on PATH; make and CI shells may not.
[[ -x /usr/local/go/bin/go ]] && PATH=$PATH:/usr/local/go/bin
command -v go >/dev/null || {
  echo "ensure-bins.sh: 'go' is not on PATH (Go 1.26 is needed to build the cluster binaries)" >&2
  exit 1
}

k8s_version=$(awk '$1 == "k8s.io/kubernetes" {print $2}' "$here/tools/k8s/go.mod")
[[ $k8s_version =~ ^v([0-9]+)\.([0-9]+)\.[0-9]+$ ]] || {
  echo "ensure-bins.sh: no k8s.io/kubernetes vX.Y.Z require line in tools/k8s/go.mod" >&2
  exit 1
}
major=${BASH_REMATCH[1]} minor=${BASH_REMATCH[2]}

key=$( (
  echo "$k8s_version"
  go version
  cd "$here" && sha256sum tools/*/go.mod tools/*/go.sum
) | sha256sum | cut -c1-16)
root=${ORCHARD_K8S_CACHE:-/var/cache/orchard/k8s}
bin="$root/$k8s_version-$key/bin"
wanted=(etcd etcdctl kube-apiserver kube-controller-manager kube-scheduler kubectl)
[[ $tier == control-plane ]] || wanted+=(kubelet kube-proxy kube-router)
cached() {
  local name
  for name in "${wanted[@]}"; do [[ -x $bin/$name ]] || return 1; done
}
if cached; then # a hit needs no lock (a build of the other binaries may hold it)
  echo "$bin"
  exit 0
fi
[[ $tier == check ]] && exit 3
mkdir -p "$bin"

# One builder at a time per cache entry; a second caller waits and then finds the binaries.
exec 9>"$bin/.lock"
flock 9

ld="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ld+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
  ld+=" -X $pkg.gitTreeState=clean -X $pkg.gitCommit= -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

# build MODULE_DIR LDFLAGS NAME=PACKAGE...: builds the missing ones in one go invocation.
build() {
  local dir=$1 flags=$2 missing=() names=() spec
  shift 2
  for spec in "$@"; do
    [[ -x "$bin/${spec%%=*}" ]] && continue
    names+=("${spec%%=*}")
    missing+=("${spec#*=}")
  done
  ((${#missing[@]})) || return 0
  tmp=$(mktemp -d "$bin/.build.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  echo "ensure-bins.sh: building ${names[*]} ($k8s_version, $(go env GOVERSION))" >&2
  local start=$SECONDS i
  for i in "${!missing[@]}"; do
    (cd "$here/$dir" && CGO_ENABLED=0 nice -n 10 go build -trimpath -ldflags "$flags" \
      -o "$tmp/${names[$i]}" "${missing[$i]}")
  done
  for i in "${!names[@]}"; do mv "$tmp/${names[$i]}" "$bin/${names[$i]}"; done
  rmdir "$tmp"
  echo "ensure-bins.sh: built ${names[*]} in $((SECONDS - start)) s" >&2
}

build tools/etcd "-s -w" etcd=go.etcd.io/etcd/server/v3 etcdctl=go.etcd.io/etcd/etcdctl/v3
build tools/k8s "$ld" kube-apiserver=k8s.io/kubernetes/cmd/kube-apiserver \
  kube-controller-manager=k8s.io/kubernetes/cmd/kube-controller-manager \
  kube-scheduler=k8s.io/kubernetes/cmd/kube-scheduler kubectl=k8s.io/kubernetes/cmd/kubectl
if [[ $tier == all ]]; then
  build tools/k8s "$ld" kubelet=k8s.io/kubernetes/cmd/kubelet kube-proxy=k8s.io/kubernetes/cmd/kube-proxy
  kr=github.com/cloudnativelabs/kube-router/v2
  kr_version=$(awk -v m=$kr '$1 == m {print $2}' "$here/tools/kube-router/go.mod")
  build tools/kube-router "-s -w -X $kr/pkg/version.Version=$kr_version" \
    kube-router=$kr/cmd/kube-router
fi
echo "$bin"
