#!/usr/bin/env bash
# The attacks on `pinswap serve`'s limits (tests/limits.rs), the slow ones
# included: a 3.8 MiB review of 75,000 images, alone and four at once. The
# quick ones also run in the default suite. Prints the measured bounds
# (peak RSS from /proc, times, refusals).
# Usage: scripts/attack.sh [--release]
set -euo pipefail
cd "$(dirname "$0")/.."
exec cargo test --locked "$@" --test limits -- --include-ignored --nocapture --test-threads 1
