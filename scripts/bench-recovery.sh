#!/usr/bin/env bash
# Recovery latency: time from a Pod's pull-failure status (ErrImagePull on a
# pruned target image) to the target serving the image again, for 20
# distinct 10 MiB images (the manifest and the layer are deleted at the
# target, as a lifecycle rule plus GC would).
#
# Rig: two loopback Distribution registries and the in-process Kubernetes API
# test server (tests/common/kube.rs); the watcher, recovery and copy are
# pinswap's own (tests/recovery.rs, recovery_latency_figures), built in
# release mode. Compare with the kubelet's image pull back-off: 10 s, 20 s,
# 40 s, ... capped at 300 s.
#
# usage: scripts/bench-recovery.sh
# Results: target/bench/bench-recovery.txt
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
source scripts/lib.sh # (the working directory is the repo root)
ensure_tools docker-registry:docker-registry
mkdir -p target/bench
cargo test --release --locked --test recovery -- --ignored --nocapture recovery_latency_figures 2>&1 \
  | grep '^recovery of' | tee target/bench/bench-recovery.txt
