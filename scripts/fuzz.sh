#!/usr/bin/env bash
# Run one cargo-fuzz target of fuzz/ for a fixed time.
#
# usage: scripts/fuzz.sh TARGET SECONDS [LIBFUZZER ARGS...]
#   TARGET   reference | admission | manifest | config | convert | identity | yaml
#   SECONDS  wall time of the run (libFuzzer -max_total_time)
# The corpus is fuzz/corpus/TARGET (the seed-* files are in git; what
# libFuzzer adds is ignored). Crashes land in fuzz/artifacts/TARGET/.
# Installs cargo-fuzz if missing. The stable toolchain gets RUSTC_BOOTSTRAP=1
# for the sanitizer flags. Not part of .ci/run: the sanitizer build of the
# whole crate costs too much there (see docs/benchmarks.md, Fuzzing).
set -euo pipefail

if (($# < 2)); then
  sed -n '4,8p' "$0" >&2
  exit 2
fi
target=$1 seconds=$2
shift 2
cd "$(dirname "$0")/../fuzz"

command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
export RUSTC_BOOTSTRAP=1 CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-1}"
mkdir -p "corpus/$target" "artifacts/$target"
# -timeout: an input that runs 10 s is reported as a hang; -rss_limit_mb:
# more than 2 GiB is an unbounded allocation.
exec cargo fuzz run "$target" "corpus/$target" -- \
  -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
  -print_final_stats=1 -artifact_prefix="artifacts/$target/" "$@"
