#!/usr/bin/env bash
# The cluster suite alone: pinswap against a real kube-apiserver and
# kube-controller-manager (tests/cluster_*.rs), with real registries, and on a
# real node (tests/cluster_node*.rs: kube-scheduler, a kubelet, containerd and
# runc, pinswap installed from its own image). Builds the harness and the
# node first (scripts/build-cluster.sh, scripts/build-node.sh) and fetches
# the image's packages (scripts/build-image.sh --fetch). Extra arguments go
# to cargo test, e.g. scripts/test-cluster.sh -- --nocapture.
set -euo pipefail
cd "$(dirname "$0")/.."
for tool in docker-registry skopeo go runc; do
  command -v "$tool" >/dev/null || {
    echo "error: $tool is not installed (see docs/contributing.md)" >&2
    exit 1
  }
done
# The node suite installs the chart with Helm's engine for Python.
python3 -c 'import helm_python' 2>/dev/null ||
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check helm-python-sdk==0.2.2 PyYAML==6.0.3
scripts/node-preflight.sh
log=$(mktemp)
trap 'rm -f "$log"' EXIT
bin=$(scripts/build-cluster.sh 2>"$log") || {
  cat "$log" >&2
  exit 1
}
"$bin" -version
cat "$log" >&2
scripts/build-node.sh >/dev/null
scripts/build-image.sh --fetch >/dev/null
tests=()
for f in tests/cluster_*.rs; do
  t=${f#tests/}
  tests+=(--test "${t%.rs}")
done
# The node must leave the machine as it found it.
before=$(scripts/node-state.sh)
cargo test --locked "${tests[@]}" "$@"
scripts/node-state.sh --after "$before"
