#!/usr/bin/env bash
# pinswap at the size of a large cluster, through a real kube-apiserver
# (tests/cluster_scale.rs): Pods created through the API in shape a
# (100,000 Pods, 50 namespaces, 2,000 images; the first run is the
# backfill's first pass) and shape b (20,000 Pods, an image each), measured
# with the default config and with retention and eviction on.
#
# usage: scripts/bench-scale.sh [a|b ...]   (default: a b)
#        BENCH_PODS=N BENCH_IMAGES=M override a shape's counts.
# Needs what the cluster suite needs (scripts/build-cluster.sh). About
# 15 minutes for shape a on 2 cores, 10 for shape b.
# Results: target/bench/bench-scale.txt
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p target/bench
scripts/build-cluster.sh >/dev/null
cargo build --release --locked --bin pinswap
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(a b)
: > target/bench/bench-scale.txt
for shape in "${shapes[@]}"; do
  BENCH_SHAPE=$shape PINSWAP_BIN=$PWD/target/release/pinswap \
    cargo test --locked --test cluster_scale -- --ignored --nocapture scale_figures 2>&1 \
    | grep '^scale' | tee -a target/bench/bench-scale.txt
done
