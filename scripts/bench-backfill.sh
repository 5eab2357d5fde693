#!/usr/bin/env bash
# The backfill's first pass: `pinswap serve` (test profile) against the
# in-process Kubernetes API test server (tests/common/kube.rs) holding N
# Pods that share M images of a real source registry, none at the target;
# the time until every image is copied, and the process's peak RSS.
#
# usage: scripts/bench-backfill.sh      (BENCH_PODS=10000 BENCH_IMAGES=500)
# Results: target/bench/bench-backfill.txt
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p target/bench
cargo test --locked --test backfill -- --ignored --nocapture backfill_pass_figures 2>&1 \
  | grep '^backfill:' | tee target/bench/bench-backfill.txt
