#!/usr/bin/env bash
# The release binary's build options: each variant is built from an empty
# target directory of its own (target/binary/<variant>), timed, and measured:
#   - the executable's size, and its size stripped of symbols;
#   - the idle RSS of `pinswap copy` waiting on a registry that accepts the
#     connection and never answers, split into anonymous and file-backed
#     pages (/proc/PID/status), the median of 3 processes.
# Cached admission throughput of two variants is compared by
# scripts/bench-admission.sh, with PINSWAP_BIN and BASELINE_BIN set to them.
#
# Variants (BENCH_VARIANTS, default "release thin-abort musl"):
#   release      the release profile as Cargo.toml sets it
#   abort        + panic = "abort"
#   thin         + lto = "thin"
#   thin-abort   + lto = "thin", panic = "abort"
#   fat          + lto = "fat", codegen-units = 1
#   musl         the release profile for x86_64-unknown-linux-musl, as the
#                Dockerfile builds the container image's binary (static,
#                musl's allocator); needs the target and musl-gcc
#
# usage: scripts/bench-binary.sh
# env: BENCH_VARIANTS; BENCH_KEEP=1 reuses a variant's target directory
#      (then the build time is not a clean build's)
# Results: target/bench/bench-binary.md
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
ensure_tools python3:python3 strip:binutils

VARIANTS=${BENCH_VARIANTS:-release thin-abort musl}
OUT=$PWD/target/bench
mkdir -p "$OUT"
WORK=$(mktemp -d)
LISTENER=''
cleanup() {
  [ -n "$LISTENER" ] && kill "$LISTENER" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT

# A registry that accepts connections and never answers.
PORT=$(free_port)
python3 -c '
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(64)
held = []
while True:
    held.append(s.accept()[0])
' "$PORT" &
LISTENER=$!
sleep 0.5

build() { # VARIANT: builds it, prints "seconds path"
  local v=$1 dir=$PWD/target/binary/$1 target=''
  local -a env=()
  case $v in
    release) ;;
    abort) env=(CARGO_PROFILE_RELEASE_PANIC=abort) ;;
    thin) env=(CARGO_PROFILE_RELEASE_LTO=thin) ;;
    thin-abort) env=(CARGO_PROFILE_RELEASE_LTO=thin CARGO_PROFILE_RELEASE_PANIC=abort) ;;
    fat) env=(CARGO_PROFILE_RELEASE_LTO=fat CARGO_PROFILE_RELEASE_CODEGEN_UNITS=1) ;;
    musl) target=x86_64-unknown-linux-musl ;;
    *) echo "error: BENCH_VARIANTS: unknown variant '$v'" >&2; exit 2 ;;
  esac
  [ "${BENCH_KEEP:-}" = 1 ] || rm -rf "$dir"
  local -a args=(build --release --locked --quiet --bin pinswap)
  [ -n "$target" ] && args+=(--target "$target")
  local start end
  start=$(date +%s)
  env "${env[@]}" CARGO_TARGET_DIR="$dir" cargo "${args[@]}" >&2
  end=$(date +%s)
  echo "$((end - start)) $dir/${target:+$target/}release/pinswap"
}

idle_rss() { # BINARY: "anon file total" KiB, the median of 3 idle processes
  local bin=$1 i
  for i in 1 2 3; do
    XDG_CACHE_HOME=$WORK/cache-$i "$bin" copy "docker://127.0.0.1:$PORT/stall/app:v1" \
      "docker://127.0.0.1:$PORT/stall/copy:v1" >/dev/null 2>&1 &
    local pid=$!
    sleep 2
    awk '/^RssAnon/{a=$2} /^RssFile/{f=$2} END{print a, f, a+f}' "/proc/$pid/status"
    kill "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null || true
  done | sort -n -k3 | sed -n 2p
}

mib() { awk -v k="$1" 'BEGIN{printf "%.1f", k/1024}'; }
mb() { awk -v b="$1" 'BEGIN{printf "%.1f", b/1e6}'; }

{
  echo "# pinswap binary variants ($(date -u +%FT%TZ), $(nproc) cores, $(rustc --version))"
  echo
  echo "| variant | clean build | executable MB | stripped MB | idle RSS MiB | anonymous MiB | file-backed MiB |"
  echo "|---|---|---|---|---|---|---|"
} >"$OUT/bench-binary.md"
for v in $VARIANTS; do
  echo "== $v: building" >&2
  read -r secs bin < <(build "$v")
  cp "$bin" "$WORK/stripped"
  strip "$WORK/stripped"
  read -r anon file total < <(idle_rss "$WORK/stripped")
  printf '| %s | %dm%02ds | %s | %s | %s | %s | %s |\n' "$v" $((secs / 60)) $((secs % 60)) \
    "$(mb "$(stat -c %s "$bin")")" "$(mb "$(stat -c %s "$WORK/stripped")")" \
    "$(mib "$total")" "$(mib "$anon")" "$(mib "$file")" | tee -a "$OUT/bench-binary.md"
  echo "   $bin" >&2
done
echo "RSS: of the stripped executable, as the container image ships it." >>"$OUT/bench-binary.md"
cat "$OUT/bench-binary.md"
