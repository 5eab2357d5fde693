#!/usr/bin/env bash
# The test command (README): unit tests and integration tests against real
# Distribution registries and skopeo, which must be installed (see .ci/run),
# the cluster suite against a real kube-apiserver, and the referrers tests
# with cosign and oras (both built with Go).
set -euo pipefail
cd "$(dirname "$0")/.."
for tool in docker-registry skopeo; do
  command -v "$tool" >/dev/null || {
    echo "error: $tool is not installed; run: sudo apt-get install -y docker-registry skopeo" >&2
    exit 1
  }
done
command -v go >/dev/null || {
  echo "error: Go 1.26 or later is needed for the cluster suite (tests/cluster)" >&2
  exit 1
}
# tests/cluster_*.rs run against kube-apiserver built by this script, and
# tests/cluster_node*.rs on a node: containerd, crictl and pause from
# build-node.sh, pinswap's image from build-image.sh (its packages fetched
# here, so the tests need no network).
# The node suite installs the chart with Helm's engine for Python.
python3 -c 'import helm_python' 2>/dev/null ||
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check helm-python-sdk==0.2.2 PyYAML==6.0.3
scripts/node-preflight.sh
scripts/build-cluster.sh >/dev/null
scripts/build-node.sh >/dev/null
scripts/build-image.sh --fetch >/dev/null
# tests/referrers.rs drives cosign and oras, and a referrers-API registry.
scripts/build-tools.sh >/dev/null
# The node must leave the machine as it found it.
before=$(scripts/node-state.sh)
# Build first and flush the build's writes, so their writeback does not
# stall the first tests' registries and control plane.
cargo test --locked --no-run "$@"
sync
cargo test --locked "$@"
scripts/node-state.sh --after "$before"
