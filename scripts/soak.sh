#!/usr/bin/env bash
# Soak `pinswap serve`: admissions at a fixed rate with image churn, a
# source restart and a target restart, recovery and re-verification
# running (tests/soak.rs, test `soak`). Not part of scripts/test.sh, which
# runs the same rig for 12 s at 40 req/s (`soak_smoke`).
#
# usage: scripts/soak.sh [--dev] [SECONDS [RATE]]
#   SECONDS  length of the run (default 1800)
#   RATE     admissions per second (default 200)
#   --dev    soak the test profile's build (quicker to build; slower
#            answers) instead of the release build
# Report: target/soak/soak.md (a row per tenth of the run: admissions,
# p50/p99/max latency, RSS, peak RSS, open descriptors, errors).
# Exits non-zero when an admission failed beyond the injected faults, a
# pruned image was not mirrored again, descriptors grew, or serve died.
set -euo pipefail
cd "$(dirname "$0")/.."

profile=release
if [ "${1:-}" = --dev ]; then profile=dev; shift; fi
seconds=${1:-1800} rate=${2:-200}
mkdir -p target/soak
report=$PWD/target/soak/soak.md
echo "== soak: ${seconds}s at ${rate} req/s ($profile build); report: $report"
SOAK_SECONDS=$seconds SOAK_RATE=$rate SOAK_REPORT=$report \
  cargo test --locked --profile "$profile" --test soak -- --ignored --exact soak --nocapture
