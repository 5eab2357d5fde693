#!/usr/bin/env bash
# Benchmark `pinswap copy` against the copy tools users would run instead:
# `skopeo copy`, regclient's `regctl image copy` and go-containerregistry's
# `crane copy` (the last two built by scripts/build-peers.sh), between two
# loopback Distribution registries (Debian `docker-registry`), on
#   (a) one 512 MiB layer, cold        (b) 10 x 20 MiB layers, cold
#   (c) (b) again, warm (destination already has it)
#   (d) 50 images sharing one 50 MiB base layer: `pinswap copy --from-file`
#       against a bash loop of each peer into the same mirror paths.
#   (e) 130 small layers into a new repository of a target that already
#       holds them in another repository, which each tool copied there
#       itself: skopeo mounts from its blob-info cache, pinswap from its
#       blob location cache; regctl and crane keep no such cache. Every run
#       copies into a repository never used.
# Wall time comes from hyperfine (every tool in one invocation per case),
# peak RSS from `/usr/bin/time -v`. Every cold run starts from an empty
# target registry and an empty skopeo blob-info cache. A peer that does not
# build is left out, with go's error.
#
# usage: scripts/bench-copy.sh [--quick] [--scale N] [--runs N]
#   --quick     sizes / 16, 2 cold runs, 8 warm runs, no 2 GiB RSS run
#   --scale N   divide every layer size by N (env BENCH_SCALE)
#   --runs N    cold runs per tool (env BENCH_RUNS, default 5; warm: 4N)
# env: PINSWAP_BIN (skip `cargo build --release`), BENCH_IMAGES (default 50),
#      BENCH_PEERS (default "regctl crane"; skopeo always runs)
# Results: target/bench/bench-copy.md and target/bench/<case>.json
#
# Command strings ($PINSWAP, $SKOPEO, $WARM_*) go to hyperfine as strings and
# are word-split on purpose elsewhere, so paths must not contain spaces.
# shellcheck disable=SC2086,SC2046,SC2091
set -euo pipefail

# ---------------------------------------------------------------- registries
# Each registry lives in $BENCH_WORK/<name>/ (config.yml, storage/, pid, log).
start_registry() { # name port
  local dir=$BENCH_WORK/$1
  mkdir -p "$dir/storage"
  cat >"$dir/config.yml" <<EOF
version: 0.1
log: { level: error, accesslog: { disabled: true } }
storage:
  filesystem: { rootdirectory: $dir/storage }
  delete: { enabled: true }
  cache: { blobdescriptor: inmemory }
  maintenance: { uploadpurging: { enabled: false } }
http: { addr: "127.0.0.1:$2", secret: pinswap-bench }
EOF
  # setsid + no inherited fds: the registry outlives a hyperfine --prepare.
  setsid docker-registry serve "$dir/config.yml" </dev/null >>"$dir/log" 2>&1 &
  echo $! >"$dir/pid"
  local i
  for i in $(seq 200); do
    curl -fsS -o /dev/null "http://127.0.0.1:$2/v2/" 2>/dev/null && return 0
    sleep 0.05
  done
  echo "registry $1 did not come up on port $2; log:" >&2
  cat "$dir/log" >&2
  return 1
}

stop_registry() { # name
  local pidfile=$BENCH_WORK/$1/pid pid i
  [[ -f $pidfile ]] || return 0
  pid=$(<"$pidfile")
  rm -f "$pidfile"
  kill "$pid" 2>/dev/null || return 0
  for i in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.05; done
  kill -9 "$pid" 2>/dev/null || true
}

# The hyperfine --prepare for cold runs: an empty target registry, and no
# skopeo blob-info cache (else skopeo mounts blobs it saw in earlier runs).
reset_target() {
  stop_registry dst
  rm -rf "$BENCH_WORK/dst/storage"
  rm -rf "$HOME/.local/share/containers/cache" /var/lib/containers/cache 2>/dev/null || true
  rm -rf "$XDG_CACHE_HOME/pinswap"
  sync
  start_registry dst "$BENCH_DST_PORT"
}

# The hyperfine --prepare for (e): a repository name no run has used.
next_repo() { echo "new-$(date +%s%N)" >"$BENCH_WORK/e-repo"; }

if [[ ${1:-} == __reset-target ]]; then reset_target; exit 0; fi
if [[ ${1:-} == __next-repo ]]; then next_repo; exit 0; fi

# ---------------------------------------------------------------- options
SCALE=${BENCH_SCALE:-1} RUNS=${BENCH_RUNS:-5} IMAGES=${BENCH_IMAGES:-50} QUICK=0
while (($#)); do
  case $1 in
    --quick) QUICK=1; SCALE=${BENCH_SCALE:-16}; RUNS=${BENCH_RUNS:-2} ;;
    --scale) SCALE=$2; shift ;;
    --runs) RUNS=$2; shift ;;
    -h|--help) sed -n '2,26s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
WARM_RUNS=$((RUNS * 4 > 5 ? RUNS * 4 : 5))
MIB=$((1024 * 1024))
A_SIZE=$((512 * MIB / SCALE)) B_SIZE=$((20 * MIB / SCALE))
D_BASE=$((50 * MIB / SCALE)) D_UNIQUE=$((256 * 1024 / SCALE)) BIG_SIZE=$((2048 * MIB))
E_LAYERS=130 E_SIZE=$((256 * 1024 / SCALE))
mib() { awk -v b="$1" 'BEGIN { printf "%g MiB", b / 1048576 }'; }

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SELF=$HERE/$(basename "${BASH_SOURCE[0]}")
ROOT=$(dirname "$HERE")
OUT=$ROOT/target/bench
START=$SECONDS
LOAD_START=$(cut -d" " -f1-3 /proc/loadavg)

# ---------------------------------------------------------------- tools
declare -A PKG=([docker-registry]=docker-registry [skopeo]=skopeo [hyperfine]=hyperfine
  [/usr/bin/time]=time [curl]=curl [python3]=python3)
missing=()
for cmd in "${!PKG[@]}"; do command -v "$cmd" >/dev/null || missing+=("${PKG[$cmd]}"); done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}" >&2
  sudo=(); ((EUID == 0)) || sudo=(sudo)
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
fi
if [[ -z ${PINSWAP_BIN:-} ]]; then
  (cd "$ROOT" && cargo build --release --quiet)
  PINSWAP_BIN=$ROOT/target/release/pinswap
fi
PINSWAP_BIN=$(realpath "$PINSWAP_BIN")
PEERS_DIR=''
case " ${BENCH_PEERS-regctl crane} " in
  *" regctl "* | *" crane "*) PEERS_DIR=$ROOT/$("$HERE/build-peers.sh") ;;
esac

# ---------------------------------------------------------------- work dir
BENCH_WORK=$(mktemp -d "${TMPDIR:-/tmp}/pinswap-bench.XXXXXX")
cleanup() { stop_registry dst; stop_registry src; rm -rf "$BENCH_WORK"; }
trap cleanup EXIT
trap 'exit 130' INT TERM
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
BENCH_SRC_PORT=$(free_port) BENCH_DST_PORT=$(free_port)
# pinswap's blob location cache lives here, so that runs start from none.
XDG_CACHE_HOME=$BENCH_WORK/cache
export BENCH_WORK BENCH_DST_PORT XDG_CACHE_HOME
SRC=127.0.0.1:$BENCH_SRC_PORT DST=127.0.0.1:$BENCH_DST_PORT
mkdir -p "$OUT"
: >"$BENCH_WORK/rss.tsv"
log() { printf '\n== %s (%ss)\n' "$*" $((SECONDS - START)) >&2; }

# Both tools at their defaults: pinswap --jobs 4; skopeo 1.9 copies up to 6
# blobs at once (containers/image maxParallelDownloads) and has no flag for
# it. --preserve-digests: without it skopeo gzips our uncompressed layers,
# which rewrites the manifest (other digests) and costs CPU.
PINSWAP="$PINSWAP_BIN copy"
SKOPEO="skopeo copy --src-tls-verify=false --dest-tls-verify=false -q --preserve-digests"
# regctl and crane at their defaults too, over plain HTTP on loopback.
declare -A COPY=([pinswap]=$PINSWAP [skopeo]=$SKOPEO
  [regctl]="$PEERS_DIR/regctl --host reg=$SRC,tls=disabled --host reg=$DST,tls=disabled image copy"
  [crane]="$PEERS_DIR/crane copy --insecure")
TOOLS=(pinswap skopeo)
for peer in ${BENCH_PEERS-regctl crane}; do
  case $peer in
    regctl | crane)
      if [[ -x $PEERS_DIR/$peer ]]; then
        TOOLS+=("$peer")
      else
        echo "peer $peer left out: scripts/build-peers.sh did not build it (see $PEERS_DIR/$peer.err)" >&2
      fi
      ;;
    *) echo "BENCH_PEERS: unknown peer $peer (known: regctl crane)" >&2; exit 2 ;;
  esac
done
# Each tool's reference form: pinswap and skopeo name the transport.
ref() { # tool reference
  case $1 in pinswap | skopeo) echo "docker://$2" ;; *) echo "$2" ;; esac
}
copy_cmd() { # tool source target: one copy's command line
  echo "${COPY[$1]} $(ref "$1" "$2") $(ref "$1" "$3")"
}
PREPARE="$SELF __reset-target"

# ---------------------------------------------------------------- fixtures
log "fixtures: layouts, then seeding $SRC"
start_registry src "$BENCH_SRC_PORT"
start_registry dst "$BENCH_DST_PORT"
LAYOUT=$BENCH_WORK/layout
specs=("a=$A_SIZE" "b=$(printf "$B_SIZE,%.0s" $(seq 10) | sed 's/,$//')"
  "e=$(printf "$E_SIZE,%.0s" $(seq "$E_LAYERS") | sed 's/,$//')")
for i in $(seq "$IMAGES"); do specs+=("d$i=$D_BASE@base,$D_UNIQUE"); done
((QUICK)) || specs+=("big=$BIG_SIZE")
python3 "$HERE/make-layout.py" "$LAYOUT" "${specs[@]}" 2>/dev/null
$PINSWAP "oci:$LAYOUT:a" "docker://$SRC/bench/a:v1" >/dev/null
$PINSWAP "oci:$LAYOUT:b" "docker://$SRC/bench/b:v1" >/dev/null
$PINSWAP "oci:$LAYOUT:e" "docker://$SRC/bench/e:v1" >/dev/null
((QUICK)) || $PINSWAP "oci:$LAYOUT:big" "docker://$SRC/bench/big:v1" >/dev/null
LIST=$BENCH_WORK/list.txt
: >"$LIST"
for i in $(seq "$IMAGES"); do
  $PINSWAP "oci:$LAYOUT:d$i" "docker://$SRC/base/app$i:v1" >/dev/null
  echo "$SRC/base/app$i:v1" >>"$LIST"
done
rm -rf "$LAYOUT" # the source registry has it all now
MIRROR=$DST/mirror/127.0.0.1_$BENCH_SRC_PORT # mirror path of $SRC under $DST/mirror
for tool in "${TOOLS[@]:1}"; do
  t=''
  [[ $tool == skopeo ]] && t=docker://
  cat >"$BENCH_WORK/$tool-loop.sh" <<EOF
while read -r ref; do
  ${COPY[$tool]} "$t\$ref" "$t$MIRROR/\${ref#*/}"
done <"$LIST"
EOF
done

# ---------------------------------------------------------------- helpers
digest() { skopeo inspect --raw --tls-verify=false "docker://$1" | sha256sum | cut -d' ' -f1; }
verify() { # source-ref target-ref
  local want got
  want=$(digest "$1")
  got=$(digest "$2")
  if [[ $want != "$got" ]]; then
    echo "FAIL: $2 has manifest sha256:$got, source $1 has sha256:$want" >&2
    exit 1
  fi
}
verify_list() { while read -r ref; do verify "$ref" "$MIRROR/${ref#*/}"; done <"$LIST"; }
rss() { # case tool command...: one run under /usr/bin/time -v, records peak RSS in KiB
  local case=$1 tool=$2
  shift 2
  /usr/bin/time -v -o "$BENCH_WORK/time.txt" "$@" >"$BENCH_WORK/out-$case-$tool.txt"
  echo "$case $tool $(awk -F': ' '/Maximum resident set size/ { print $2 }' "$BENCH_WORK/time.txt")" \
    >>"$BENCH_WORK/rss.tsv"
}
bench() { # case hyperfine-options... -- one command per tool, in TOOLS order
  local case=$1 opts=() names=() tool
  shift
  while [[ $1 != -- ]]; do opts+=("$1"); shift; done
  shift
  for tool in "${TOOLS[@]}"; do names+=(-n "$tool" "$1"); shift; done
  hyperfine --style basic "${opts[@]}" --export-json "$OUT/$case.json" "${names[@]}"
}
cold_image() { # case source-repo
  local case=$1 src=$SRC/bench/$2:v1 cmds=() tool
  log "($case) cold: $src"
  for tool in "${TOOLS[@]}"; do cmds+=("$(copy_cmd "$tool" "$src" "$DST/$tool/$2:v1")"); done
  bench "$case" --warmup 0 --runs "$RUNS" --prepare "$PREPARE" -- "${cmds[@]}"
  for tool in "${TOOLS[@]}"; do
    reset_target
    rss "$case" "$tool" $(copy_cmd "$tool" "$src" "$DST/$tool/$2:v1")
    verify "$src" "$DST/$tool/$2:v1"
  done
}

# ---------------------------------------------------------------- cases
cold_image a a
cold_image b b

log "(c) warm: destination already has bench/b"
reset_target
cmds=()
for tool in "${TOOLS[@]}"; do
  cmds+=("$(copy_cmd "$tool" "$SRC/bench/b:v1" "$DST/warm-$tool/b:v1")")
  ${cmds[-1]} >/dev/null
done
bench c --warmup 1 --runs "$WARM_RUNS" -- "${cmds[@]}"
for i in "${!TOOLS[@]}"; do rss c "${TOOLS[i]}" ${cmds[i]}; done

log "(d) batch: $IMAGES images sharing one base layer"
cmds=("$PINSWAP --from-file $LIST --to docker://$DST/mirror")
for tool in "${TOOLS[@]:1}"; do cmds+=("bash $BENCH_WORK/$tool-loop.sh"); done
bench d --warmup 0 --runs "$RUNS" --prepare "$PREPARE" -- "${cmds[@]}"
for i in "${!TOOLS[@]}"; do reset_target; rss d "${TOOLS[i]}" ${cmds[i]}; verify_list; done

log "(e) $E_LAYERS layers the target holds in another repository"
reset_target
cmds=()
for tool in "${TOOLS[@]}"; do
  $(copy_cmd "$tool" "$SRC/bench/e:v1" "$DST/held-$tool/e:v1") >/dev/null
  cmds+=("$(copy_cmd "$tool" "$SRC/bench/e:v1" "$DST/e-$tool/\$(cat $BENCH_WORK/e-repo):v1")")
done
bench e --warmup 1 --runs "$WARM_RUNS" --prepare "$SELF __next-repo" -- "${cmds[@]}"
for tool in "${TOOLS[@]}"; do
  next_repo
  new=$DST/e-$tool/$(<"$BENCH_WORK/e-repo"):v1
  rss e "$tool" $(copy_cmd "$tool" "$SRC/bench/e:v1" "$new")
  verify "$SRC/bench/e:v1" "$new"
done
E_MOUNTED=$(sed -n 's/.* \([0-9]*\) mounted.*/\1/p' "$BENCH_WORK/out-e-pinswap.txt")

if ((!QUICK)); then
  log "pinswap peak RSS on one 2 GiB layer"
  reset_target
  rss big pinswap $PINSWAP "docker://$SRC/bench/big:v1" "docker://$DST/pinswap/big:v1"
  verify "$SRC/bench/big:v1" "$DST/pinswap/big:v1"
fi
stop_registry dst
stop_registry src

# ---------------------------------------------------------------- report
log "report"
machine="$(nproc) CPUs, $(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1)"
reg_version=$(docker-registry --version | awk '{ print $NF }')
pinswap_version="$("$PINSWAP_BIN" --version) ($(git -C "$ROOT" describe --always --dirty 2>/dev/null || echo unknown))"
peer_versions=""
for tool in "${TOOLS[@]:2}"; do
  case $tool in
    regctl) peer_versions+="; regctl $("$PEERS_DIR/regctl" version --format '{{.VCSTag}}' 2>/dev/null || echo '?')" ;;
    crane) peer_versions+="; crane $("$PEERS_DIR/crane" version 2>/dev/null || echo '?')" ;;
  esac
done
python3 - "$OUT" "$BENCH_WORK/rss.tsv" "${TOOLS[*]}" >"$OUT/bench-copy.md" <<EOF
import json, sys
out, rss_file, tools = sys.argv[1], sys.argv[2], sys.argv[3].split()
peers = tools[1:]
rss = {}
for line in open(rss_file):
    case, tool, kib = line.split()
    rss[case, tool] = int(kib) / 1024
cases = [("a", "(a) 1 × $(mib $A_SIZE) layer, cold"),
         ("b", "(b) 10 × $(mib $B_SIZE) layers, cold"),
         ("c", "(c) warm copy of (b)"),
         ("d", "(d) $IMAGES images sharing a $(mib $D_BASE) base, --from-file vs a loop of each peer"),
         ("e", "(e) $E_LAYERS × $(mib $E_SIZE) layers the target holds elsewhere, into a new repository")]
fmt = lambda r: f"{r['mean']:.3f} ± {r['stddev'] or 0:.3f}"
print("Wall time (s, mean ± stddev) and pinswap's ratio to the fastest peer and to skopeo:")
print()
print("| case | " + " | ".join(tools) + " | ÷ fastest peer | ÷ skopeo |")
print("|---|" + "---|" * (len(tools) + 2))
verdicts = []
for key, label in cases:
    res = {r["command"]: r for r in json.load(open(f"{out}/{key}.json"))["results"]}
    p = res["pinswap"]["mean"]
    fastest = min(peers, key=lambda t: res[t]["mean"])
    rf, rs = p / res[fastest]["mean"], p / res["skopeo"]["mean"]
    print(f"| {label} | " + " | ".join(fmt(res[t]) for t in tools)
          + f" | {rf:.2f}× ({fastest}) | {rs:.2f}× |")
    if key == "c":
        verdicts.append(f"(c) ≤ 0.25× skopeo and ≤ 1× the fastest peer: "
                        f"{'met' if rs <= 0.25 and rf <= 1 else 'missed'} ({rs:.2f}×, {rf:.2f}×)")
    else:
        verdicts.append(f"({key}) ≤ 0.8× the fastest peer: {'met' if rf <= 0.8 else 'missed'} ({rf:.2f}×)")
print()
print("Peak RSS (MiB) and pinswap's ratio to the smallest peer:")
print()
print("| case | " + " | ".join(tools) + " | ÷ smallest peer |")
print("|---|" + "---|" * (len(tools) + 1))
for key, label in cases:
    small = min(peers, key=lambda t: rss[key, t])
    r = rss[key, "pinswap"] / rss[key, small]
    print(f"| {key} | " + " | ".join(f"{rss[key, t]:.1f}" for t in tools) + f" | {r:.2f}× ({small}) |")
    verdicts.append(f"({key}) RSS ≤ 0.5× the smallest peer: {'met' if r <= 0.5 else 'missed'} ({r:.2f}×)")
print()
print("Targets: " + "; ".join(verdicts) + ".")
print()
if ("big", "pinswap") in rss:
    print(f"pinswap peak RSS, one 2048 MiB layer: {rss['big', 'pinswap']:.1f} MiB "
          f"(vs {rss['a', 'pinswap']:.1f} MiB on (a))")
else:
    print("pinswap peak RSS on a 2 GiB layer: skipped (--quick)")
print()
print("(e): pinswap mounted ${E_MOUNTED:-?} of the image's $((E_LAYERS + 1)) blobs.")
print()
print("Runs: $RUNS cold (empty target registry and skopeo blob-info cache before each), "
      "$WARM_RUNS warm. Every tool at its defaults (pinswap --jobs 4, skopeo 6 parallel blobs); "
      "skopeo --preserve-digests. A peer's RSS in (d) is its largest single process of the loop.$(
      ((SCALE == 1)) || echo " Layer sizes divided by $SCALE.")")
print()
print("Machine: $machine; skopeo $(skopeo --version | awk '{ print $3 }')$peer_versions; "
      "docker-registry $reg_version; $pinswap_version; $(hyperfine --version)")
print()
print("Total benchmark time: $((SECONDS - START)) s; load average at start $LOAD_START, "
      "at end $(cut -d" " -f1-3 /proc/loadavg)")
EOF
echo
cat "$OUT/bench-copy.md"
