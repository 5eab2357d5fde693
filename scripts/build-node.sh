#!/usr/bin/env bash
# Builds the node side of the cluster suite into target/node/: containerd 2.x
# (containerd, its runc shim and ctr) and crictl from their Go modules, and
# the pause image from the C source in the Kubernetes module tests/cluster
# pins (gcc -static), as an OCI image layout in target/node/pause/. The
# kubelet and kube-scheduler are subcommands of target/cluster/pinswap-cluster
# (scripts/build-cluster.sh). runc and the CNI plugins come from Debian
# (runc, containernetworking-plugins). Reused while this script is unchanged.
# Prints the directory.
set -euo pipefail
cd "$(dirname "$0")/.."
for tool in go gcc python3; do
  command -v "$tool" >/dev/null || {
    echo "error: $tool is needed to build the node (containerd, crictl, pause)" >&2
    exit 1
  }
done
containerd=github.com/containerd/containerd/v2
containerd_version=v2.4.2
crictl=sigs.k8s.io/cri-tools/cmd/crictl@v1.37.0
out=target/node
stamp=$out/inputs.sha256
mkdir -p "$out"
inputs=$( (cat scripts/build-node.sh scripts/oci-image.py tests/cluster/go.mod) | sha256sum | cut -d" " -f1)
if [ -x "$out/containerd" ] && [ -x "$out/crictl" ] && [ -f "$out/pause/index.json" ] &&
  [ "$(cat "$stamp" 2>/dev/null)" = "$inputs" ]; then
  echo "$out"
  exit 0
fi
start=$(date +%s)
bin=$(cd "$out" && pwd)
export GOFLAGS=-mod=mod
for cmd in containerd containerd-shim-runc-v2 ctr; do
  GOBIN="$bin" go install -buildvcs=false -ldflags "-s -w" "$containerd/cmd/$cmd@$containerd_version"
done
GOBIN="$bin" go install -buildvcs=false -ldflags "-s -w" "$crictl"

# pause: the sandbox's one process, from build/pause/linux/pause.c of the
# Kubernetes release the harness runs, in a one-layer image.
k8s_dir=$(cd tests/cluster && go list -m -f '{{.Dir}}' k8s.io/kubernetes)
k8s_version=$(cd tests/cluster && go list -m -f '{{.Version}}' k8s.io/kubernetes)
rm -rf "$out/pause.build" "$out/pause"
mkdir -p "$out/pause.build/rootfs"
gcc -Os -static -Wall -Werror -DVERSION="$k8s_version" -o "$out/pause.build/rootfs/pause" "$k8s_dir/build/pause/linux/pause.c"
strip "$out/pause.build/rootfs/pause"
python3 scripts/oci-image.py --rootfs "$out/pause.build/rootfs" --entrypoint /pause \
  --user 65535:65535 --ref "$k8s_version" --out "$out/pause" >/dev/null
rm -rf "$out/pause.build"
echo "$inputs" >"$stamp"
echo "built $out (containerd $containerd_version, crictl, pause $k8s_version) in $(($(date +%s) - start)) s" >&2
echo "$out"
