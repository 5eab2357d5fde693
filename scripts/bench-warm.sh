#!/usr/bin/env bash
# Apply-to-Running on a new node, cold and pre-warmed by the node agent, in
# one run (tests/cluster_node_warm.rs, bench_warm_against_cold_node): each
# round replaces the node suite's node with a new, empty one twice.
# Needs what scripts/test-cluster.sh needs; builds the same parts first.
# env: PINSWAP_BENCH_ROUNDS (default 3).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/node-preflight.sh
scripts/build-cluster.sh >/dev/null
scripts/build-node.sh >/dev/null
exec cargo test --locked --release --test cluster_node_warm bench_warm_against_cold_node -- --ignored --nocapture "$@"
