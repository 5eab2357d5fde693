#!/usr/bin/env bash
# pinswap demo on a fresh machine: two loopback registries, a source seeded
# from examples/oci/, and pinswap mirroring it byte-exact into a target.
# Usage: scripts/demo.sh            (needs root for apt-get on first run)
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v docker-registry >/dev/null; then
  echo "== installing docker-registry (Debian's Distribution 2.8)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq docker-registry >/dev/null
fi

echo "== building pinswap (the first build takes a few minutes)"
cargo build --release --quiet
PINSWAP=$PWD/target/release/pinswap

WORK=$(mktemp -d)
PIDS=()
cleanup() { kill "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

start_registry() { # NAME VAR: start a registry, store host:port in VAR
  local name=$1 port; port=$(free_port)
  mkdir -p "$WORK/$name"
  cat >"$WORK/$name.yml" <<YML
version: 0.1
log: {level: error}
storage: {filesystem: {rootdirectory: $WORK/$name}, delete: {enabled: true}}
http: {addr: 127.0.0.1:$port}
YML
  docker-registry serve "$WORK/$name.yml" >"$WORK/$name.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 50); do curl -fs "http://127.0.0.1:$port/v2/" >/dev/null && break; sleep 0.1; done
  printf -v "$2" '127.0.0.1:%s' "$port"
}

digest() { # host repo ref -> Docker-Content-Digest
  curl -fsI -H 'Accept: application/vnd.oci.image.index.v1+json, application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json, application/vnd.docker.distribution.manifest.list.v2+json' \
    "http://$1/v2/$2/manifests/$3" | tr -d '\r' | awk -F': ' 'tolower($1)=="docker-content-digest"{print $2}'
}

start_registry source SRC
start_registry target DST
echo "== source registry $SRC, target registry $DST"

echo "== seeding the source from examples/oci with pinswap copy"
$PINSWAP copy oci:examples/oci/hello:v1 "docker://$SRC/library/hello:v1"
$PINSWAP copy oci:examples/oci/web:1.0 "docker://$SRC/acme/web:1.0"
$PINSWAP copy oci:examples/oci/spin:hello "docker://$SRC/spin/hello:v1"
$PINSWAP copy oci:examples/oci/spin:goodbye "docker://$SRC/spin/goodbye:v1"

echo "== one image: $SRC/library/hello:v1 -> $DST/mirror/library/hello:v1"
$PINSWAP copy "docker://$SRC/library/hello:v1" "docker://$DST/mirror/library/hello:v1"
echo "== again: the target is up to date, so this only checks (HEAD requests)"
$PINSWAP copy "docker://$SRC/library/hello:v1" "docker://$DST/mirror/library/hello:v1"

echo "== batch: every image in a list, by the mirror-path rule, with a JSON summary"
printf '%s\n' "$SRC/library/hello:v1" "$SRC/acme/web:1.0" "$SRC/spin/hello:v1" "$SRC/spin/goodbye:v1" >"$WORK/images.txt"
$PINSWAP copy --json --from-file "$WORK/images.txt" --to "docker://$DST/mirror" >"$WORK/summary.json"
python3 - "$WORK/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"{s['succeeded']} succeeded, {s['failed']} failed")
for i in s["images"]:
    print(f"  {i['destination']}  copied={i['blobsCopied']} mounted={i['blobsMounted']} "
          f"skipped={i['blobsSkipped']} upToDate={str(i['upToDate']).lower()}")
PY

echo "== one platform of the index (a filtered index: new digest, same child)"
$PINSWAP copy --platform linux/arm64 "docker://$SRC/library/hello:v1" "docker://$DST/arm64-only/hello:v1"

echo "== digests at the source and at the target (byte-exact copies match)"
SRCCOMP=${SRC/:/_}
printf '%-22s %-73s %s\n' image source target
for pair in library/hello:v1 acme/web:1.0 spin/hello:v1 spin/goodbye:v1; do
  repo=${pair%%:*} tag=${pair##*:}
  s=$(digest "$SRC" "$repo" "$tag"); t=$(digest "$DST" "mirror/$SRCCOMP/$repo" "$tag")
  printf '%-22s %s %s %s\n' "$pair" "$s" "$t" "$([ "$s" = "$t" ] && echo same || echo DIFFERENT)"
  [ "$s" = "$t" ]
done
echo "arm64-only/hello:v1    $(digest "$DST" arm64-only/hello v1) (filtered)"
echo "== done"
