#!/usr/bin/env bash
# The cluster suite alone: pinswap against a real kube-apiserver and
# kube-controller-manager (tests/cluster_*.rs), with real registries.
# Builds the harness first (scripts/build-cluster.sh). Extra arguments go to
# cargo test, e.g. scripts/test-cluster.sh -- --nocapture.
set -euo pipefail
cd "$(dirname "$0")/.."
for tool in docker-registry skopeo go; do
  command -v "$tool" >/dev/null || {
    echo "error: $tool is not installed (see README: On a fresh machine)" >&2
    exit 1
  }
done
log=$(mktemp)
trap 'rm -f "$log"' EXIT
bin=$(scripts/build-cluster.sh 2>"$log") || {
  cat "$log" >&2
  exit 1
}
"$bin" -version
cat "$log" >&2
tests=()
for f in tests/cluster_*.rs; do
  t=${f#tests/}
  tests+=(--test "${t%.rs}")
done
exec cargo test --locked "${tests[@]}" "$@"
