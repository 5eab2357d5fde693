#!/usr/bin/env bash
# The leader's Pod index: RSS of `pinswap serve` (release build) once its
# initial list of N Pods is indexed, against the same process with none.
# The Pods come from the in-process Kubernetes API test server
# (tests/common/kube.rs), in pages of 500 as kube-apiserver sends them.
#
# usage: scripts/bench-index.sh          (BENCH_PODS=0,20000,... to choose N)
# Results: target/bench/bench-index.txt
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p target/bench
cargo test --release --locked --test recovery -- --ignored --nocapture pod_index_memory_figures 2>&1 \
  | grep '^pod index' | tee target/bench/bench-index.txt
