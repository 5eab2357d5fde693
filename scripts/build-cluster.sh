#!/usr/bin/env bash
# Builds the cluster suite's control plane (tests/cluster/: embedded etcd,
# kube-apiserver and kube-controller-manager from the Kubernetes Go modules)
# into target/cluster/pinswap-cluster. Modules come through the Go module
# proxy; the build is reused while the harness's go.mod, go.sum and sources
# are unchanged. Prints the binary's path.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v go >/dev/null || {
  echo "error: Go (1.26 or later) is needed to build the cluster harness" >&2
  exit 1
}
out=target/cluster/pinswap-cluster
stamp=target/cluster/inputs.sha256
mkdir -p target/cluster
inputs=$(cat scripts/build-cluster.sh tests/cluster/go.mod tests/cluster/go.sum tests/cluster/*.go | sha256sum | cut -d" " -f1)
if [ -x "$out" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$inputs" ]; then
  echo "$out"
  exit 0
fi
cd tests/cluster
# kube-apiserver reports the version stamped here (/version, and the
# harness's "kube-apiserver vX.Y.Z" line); a module build has none of its own.
k8s=$(go list -m -f '{{.Version}}' k8s.io/kubernetes)
IFS=. read -r major minor _ <<<"${k8s#v}"
pkg=k8s.io/component-base/version
ldflags="-s -w -X $pkg.gitVersion=$k8s -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
start=$(date +%s)
# No -trimpath: the build then shares its cache with .ci/run's go vet.
go build -buildvcs=false -ldflags "$ldflags" -o "../../$out.new" .
mv "../../$out.new" "../../$out"
cd ../..
echo "$inputs" >"$stamp"
echo "built $out ($k8s) in $(($(date +%s) - start)) s" >&2
echo "$out"
