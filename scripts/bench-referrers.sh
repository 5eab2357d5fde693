#!/usr/bin/env bash
# What copying referrers adds, both ways in one run, between two loopback
# Distribution registries (no referrers API: cosign's tags and the fallback
# tag index):
#   copy       `pinswap copy` of a small image (examples/oci/web) signed and
#              attested with cosign's tags and signed once more as an OCI 1.1
#              referrer (3 referrers), cold into a new repository each run,
#              with and without --no-referrers, alternating.
#   admission  one uncached admission (copyPolicy: immediate, so it waits for
#              the image copy) of such an image per run, through a `pinswap
#              serve` with the default `referrers: true` and one with
#              `referrers: false`, alternating; referrers follow in the
#              background, so this is what they add to the admission itself.
# Figures are medians over $BENCH_RUNS runs (default 10) of wall time, and
# the ratio with/without. Needs cosign from scripts/build-tools.sh.
#
# usage: scripts/bench-referrers.sh
# env: PINSWAP_BIN (skip `cargo build --release`), BENCH_RUNS
# Results: target/bench/bench-referrers.md
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${BENCH_RUNS:-10}
WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
ensure_tools docker-registry:docker-registry curl:curl openssl:openssl
if [ -z "${PINSWAP_BIN:-}" ]; then
  cargo build --release --locked --quiet
  PINSWAP_BIN=target/release/pinswap
fi
TOOLS=$(scripts/build-tools.sh)
COSIGN=$PWD/$TOOLS/cosign
mkdir -p target/bench "$WORK/cosign/tuf"

start_registry src SRC
start_registry dst DST

cosign() { # offline, keyed, no tlog (as tests/common/tools.rs)
  (cd "$WORK/cosign" && env -i PATH=/usr/bin:/bin HOME="$WORK/cosign" TUF_ROOT="$WORK/cosign/tuf" \
    SIGSTORE_NO_CACHE=true COSIGN_PASSWORD= COSIGN_YES=true \
    HTTPS_PROXY=http://127.0.0.1:9 HTTP_PROXY=http://127.0.0.1:9 NO_PROXY=127.0.0.1 \
    "$COSIGN" "$@" >/dev/null 2>&1)
}
cosign generate-key-pair
echo '{"spdxVersion":"SPDX-2.3","SPDXID":"SPDXRef-DOCUMENT","name":"bench","packages":[]}' >"$WORK/cosign/sbom.json"
OFFLINE=(--tlog-upload=false --use-signing-config=false --allow-insecure-registry --allow-http-registry)

# One signed image per repository app-N (a new digest each: a label in the
# config would change it; here each repository gets the same image, which is
# what a cold copy into a new target repository sees anyway).
seed() { # N: examples/oci/web as SRC/app-N:v1, signed 3 ways
  local repo=$SRC/app-$1 digest
  XDG_CACHE_HOME=$WORK/xdg "$PINSWAP_BIN" copy oci:examples/oci/web "docker://$repo:v1" >/dev/null
  digest=$(curl -fsS -o /dev/null -D - -H 'Accept: application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json' \
    "http://$SRC/v2/app-$1/manifests/v1" | tr -d '\r' | awk 'tolower($1)=="docker-content-digest:"{print $2}')
  cosign sign --key cosign.key "${OFFLINE[@]}" --new-bundle-format=false --registry-referrers-mode=legacy "$repo@$digest"
  cosign attest --key cosign.key "${OFFLINE[@]}" --new-bundle-format=false --type spdxjson --predicate sbom.json "$repo@$digest"
  cosign sign --key cosign.key "${OFFLINE[@]}" "$repo@$digest"
}
total=$((4 * RUNS))
echo "== seeding $total signed images"
for i in $(seq "$total"); do seed "$i"; done

now() { date +%s.%N; }
median() { sort -n | awk '{a[NR]=$1} END {m=(NR%2)?a[(NR+1)/2]:(a[NR/2]+a[NR/2+1])/2; printf "%.3f", m}'; }

echo "== copy: $RUNS runs each way"
: >"$WORK/copy-on" && : >"$WORK/copy-off"
for r in $(seq "$RUNS"); do
  for way in on off; do
    [ "$way" = on ] && n=$((2 * r - 1)) || n=$((2 * r))
    flag=()
    [ "$way" = off ] && flag=(--no-referrers)
    xdg=$(mktemp -d -p "$WORK")
    t0=$(now)
    XDG_CACHE_HOME=$xdg "$PINSWAP_BIN" copy "${flag[@]}" "docker://$SRC/app-$n:v1" "docker://$DST/copy/app-$n:v1" >/dev/null
    t1=$(now)
    echo "$t1 - $t0" | bc >>"$WORK/copy-$way"
  done
done

echo "== admission: $RUNS runs each way"
make_certs bench
serve() { # NAME REFERRERS: a serve with that referrers value; its webhook port into NAME_PORT
  local port health
  port=$(free_port)
  health=$(free_port)
  cat >"$WORK/$1.yaml" <<YML
target: {registry: "$DST/$1", insecure: true}
source: {registries: [{registry: "$SRC", insecure: true}]}
recovery: {enabled: false}
identity: {scanRate: 0}
copyPolicy: immediate
referrers: $2
server: {listen: "127.0.0.1:$port", healthListen: "127.0.0.1:$health", tlsCert: $WORK/tls.crt, tlsKey: $WORK/tls.key}
YML
  "$PINSWAP_BIN" serve --config "$WORK/$1.yaml" >"$WORK/$1.log" 2>&1 &
  PIDS+=($!)
  wait_for "http://127.0.0.1:$health/readyz" $! "serve $1"
  printf -v "${1}_PORT" '%s' "$port"
}
serve on true
serve off false
review() { # N: a review of a Pod running SRC/app-N:v1
  printf '{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"u-%s","kind":{"group":"","version":"v1","kind":"Pod"},"resource":{"group":"","version":"v1","resource":"pods"},"namespace":"bench","operation":"CREATE","userInfo":{"username":"bench"},"object":{"apiVersion":"v1","kind":"Pod","metadata":{"name":"p%s","namespace":"bench"},"spec":{"containers":[{"name":"c","image":"%s/app-%s:v1"}]}},"dryRun":false}}' "$1" "$1" "$SRC" "$1"
}
: >"$WORK/adm-on" && : >"$WORK/adm-off"
for r in $(seq "$RUNS"); do
  for way in on off; do
    [ "$way" = on ] && n=$((2 * RUNS + 2 * r - 1)) || n=$((2 * RUNS + 2 * r))
    port_var=${way}_PORT
    review "$n" >"$WORK/review.json"
    out=$(curl -fsS --cacert "$WORK/ca.crt" -o "$WORK/resp.json" -w '%{time_total}' \
      -H 'content-type: application/json' --data-binary @"$WORK/review.json" "https://127.0.0.1:${!port_var}/mutate")
    grep -q '"patch"' "$WORK/resp.json" || { echo "admission $n ($way) not rewritten: $(cat "$WORK/resp.json")" >&2; exit 1; }
    echo "$out" >>"$WORK/adm-$way"
  done
done
# The referrers of the last admissions reach the target in the background.
sleep 3
sigs=$(curl -fsS "http://$DST/v2/on/$(echo "$SRC" | tr : _)/app-$((4 * RUNS - 1))/tags/list" | grep -o '\.sig' | wc -l)

copy_on=$(median <"$WORK/copy-on")
copy_off=$(median <"$WORK/copy-off")
adm_on=$(median <"$WORK/adm-on")
adm_off=$(median <"$WORK/adm-off")
ratio() { echo "scale=2; $1 / $2" | bc; }
{
  echo "| case | referrers on (s) | off (s) | on / off |"
  echo "|---|---|---|---|"
  echo "| cold copy, 3 referrers | $copy_on | $copy_off | $(ratio "$copy_on" "$copy_off") |"
  echo "| uncached admission (copyPolicy: immediate) | $adm_on | $adm_off | $(ratio "$adm_on" "$adm_off") |"
  echo
  echo "medians of $RUNS runs each; cosign tags at the target after the last admission with referrers: $sigs"
} | tee target/bench/bench-referrers.md
