#!/usr/bin/env bash
# pinswap at the size of a large cluster, through a real kube-apiserver
# (tests/cluster_scale.rs): Pods created through the API in shape a
# (100,000 Pods, 50 namespaces, 2,000 images; the first run is the
# backfill's first pass) and shape b (20,000 Pods, an image each), measured
# with the default config and with retention and eviction on; and a fleet
# (tests/cluster_fleet.rs): 100,000 images at the target, 49 other
# clusters' usage records and 200,000 Pods of this cluster, with sharing
# and retention on.
#
# usage: scripts/bench-scale.sh [a|b|fleet ...]   (default: a b fleet)
#        BENCH_PODS=N BENCH_IMAGES=M override a shape's counts;
#        BENCH_REPOS, BENCH_TAGS and BENCH_FLEET_PODS the fleet's.
# Needs what the cluster suite needs (scripts/build-cluster.sh). About
# 15 minutes for shape a on 2 cores, 10 for shape b, 25 for the fleet.
# Results: target/bench/bench-scale.txt
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p target/bench
scripts/build-cluster.sh >/dev/null
cargo build --release --locked --bin pinswap
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(a b fleet)
: > target/bench/bench-scale.txt
for shape in "${shapes[@]}"; do
  if [ "$shape" = fleet ]; then
    PINSWAP_BIN=$PWD/target/release/pinswap \
      cargo test --locked --test cluster_fleet -- --ignored --nocapture fleet_figures 2>&1 \
      | grep '^fleet' | tee -a target/bench/bench-scale.txt
    continue
  fi
  BENCH_SHAPE=$shape PINSWAP_BIN=$PWD/target/release/pinswap \
    cargo test --locked --test cluster_scale -- --ignored --nocapture scale_figures 2>&1 \
    | grep '^scale' | tee -a target/bench/bench-scale.txt
done
