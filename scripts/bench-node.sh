#!/usr/bin/env bash
# The time from `kubectl apply` to Running on the cluster suite's node, in
# four cases in one run (tests/cluster_node_bench.rs): without pinswap,
# through pinswap on a warm mirror, and on a cold mirror with copyPolicy
# immediate and delayed, with `pinswap copy` of the same size alongside.
# Needs what scripts/test-cluster.sh needs; builds the same parts first.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/node-preflight.sh
scripts/build-cluster.sh >/dev/null
scripts/build-node.sh >/dev/null
scripts/build-image.sh --fetch >/dev/null
exec cargo test --locked --release --test cluster_node_bench -- --ignored --nocapture "$@"
