#!/usr/bin/env bash
# pinswap demo on a fresh machine: two loopback registries, a source seeded
# from examples/oci/, pinswap mirroring it byte-exact into a target, then the
# webhook (`pinswap serve`) answering the AdmissionReviews in
# examples/admission/ with examples/demo.yaml as its config.
# Usage: scripts/demo.sh [--keep]   (needs root for apt-get on first run)
#   --keep  leave the registries and the webhook running afterwards, to
#           explore; Ctrl-C stops them and removes the temporary directory.
# env: PINSWAP_BIN (use this binary instead of `cargo build --release`)
# Ends with a one-line verdict. Exits non-zero when anything is off: a copy
# that fails, a container that is not rewritten as expected, a digest that
# differs between source and target.
set -euo pipefail
cd "$(dirname "$0")/.."

KEEP=
for arg in "$@"; do
  case $arg in
  --keep) KEEP=1 ;;
  -h | --help)
    sed -n '2,/^set -euo/p' "$0" | sed -e '/^set -euo/d' -e 's/^# \{0,1\}//'
    exit 0
    ;;
  *)
    echo "unknown argument: $arg (usage: scripts/demo.sh [--keep])" >&2
    exit 2
    ;;
  esac
done
# The step under way, for the verdict when one fails.
STEP="setup"
step() { STEP=$1; echo "== $1"; }

# shellcheck source=scripts/lib.sh
source scripts/lib.sh # (the working directory is the repo root)
ensure_tools docker-registry:docker-registry openssl:openssl curl:curl python3:python3

if [ -n "${PINSWAP_BIN:-}" ]; then
  PINSWAP=$PINSWAP_BIN
else
  echo "== building pinswap (the first build takes a few minutes)"
  cargo build --release --quiet
  PINSWAP=$PWD/target/release/pinswap
fi

WORK=$(mktemp -d)
PIDS=()
cleanup() {
  local rc=$?
  if ((rc)) && [ -s "$WORK/pinswap.log" ]; then
    echo "== FAILED (exit $rc); the last lines of the pinswap serve log:" >&2
    tail -n 20 "$WORK/pinswap.log" >&2
  fi
  if ((rc)) && [ "$STEP" != done ]; then
    echo "verdict: FAIL at \"$STEP\" (exit $rc)" >&2
  fi
  # Reverse order: pinswap (SIGTERM, graceful) before the registries it uses.
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do kill "${PIDS[i]}" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT


digest() { # host repo ref -> Docker-Content-Digest
  curl -fsI -H 'Accept: application/vnd.oci.image.index.v1+json, application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json, application/vnd.docker.distribution.manifest.list.v2+json' \
    "http://$1/v2/$2/manifests/$3" | tr -d '\r' | awk -F': ' 'tolower($1)=="docker-content-digest"{print $2}'
}

start_registry source SRC
SRC_PID=${PIDS[-1]}
start_registry target DST
step "source registry $SRC, target registry $DST"

step "seeding the source from examples/oci with pinswap copy"
$PINSWAP copy oci:examples/oci/hello:v1 "docker://$SRC/library/hello:v1"
$PINSWAP copy oci:examples/oci/web:1.0 "docker://$SRC/acme/web:1.0"
$PINSWAP copy oci:examples/oci/spin:hello "docker://$SRC/spin/hello:v1"
$PINSWAP copy oci:examples/oci/spin:goodbye "docker://$SRC/spin/goodbye:v1"

step "one image: $SRC/library/hello:v1 -> $DST/mirror/library/hello:v1"
$PINSWAP copy "docker://$SRC/library/hello:v1" "docker://$DST/mirror/library/hello:v1"
step "again: the target is up to date, so this only checks (HEAD requests)"
$PINSWAP copy "docker://$SRC/library/hello:v1" "docker://$DST/mirror/library/hello:v1"

step "batch: every image in a list, by the mirror-path rule, with a JSON summary"
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

step "one platform of the index (a filtered index: new digest, same child)"
$PINSWAP copy --platform linux/arm64 "docker://$SRC/library/hello:v1" "docker://$DST/arm64-only/hello:v1"

step "digests at the source and at the target (byte-exact copies match)"
SRCCOMP=${SRC/:/_}
printf '%-22s %-73s %s\n' image source target
for pair in library/hello:v1 acme/web:1.0 spin/hello:v1 spin/goodbye:v1; do
  repo=${pair%%:*} tag=${pair##*:}
  s=$(digest "$SRC" "$repo" "$tag"); t=$(digest "$DST" "mirror/$SRCCOMP/$repo" "$tag")
  printf '%-22s %s %s %s\n' "$pair" "$s" "$t" "$([ "$s" = "$t" ] && echo same || echo DIFFERENT)"
  [ "$s" = "$t" ]
done
echo "arm64-only/hello:v1    $(digest "$DST" arm64-only/hello v1) (filtered)"

step "pinswap check: the two Spin apps share one config, so containerd gives them one image ID"
set +e
$PINSWAP check "$SRC/spin/hello:v1" "$SRC/spin/goodbye:v1"
rc=$?
set -e
[ "$rc" = 3 ] || { echo "pinswap check exited $rc, expected 3 (flagged)" >&2; exit 1; }
echo "(exit code 3: flagged)"

# ------------------------------------------------------------------ webhook
echo
step "webhook: pinswap serve with examples/demo.yaml (target $DST/webhook, allowlist $SRC)"
sed -e "s|{{SRC}}|$SRC|g" -e "s|{{DST}}|$DST|g" examples/demo.yaml >"$WORK/demo.yaml"
$PINSWAP config validate "$WORK/demo.yaml"

step "a self-signed CA, and a serving certificate for 127.0.0.1 signed by it"
make_certs "pinswap demo"

HOOK=127.0.0.1:$(free_port) HEALTH=127.0.0.1:$(free_port)
$PINSWAP serve --config "$WORK/demo.yaml" --tls-cert "$WORK/tls.crt" --tls-key "$WORK/tls.key" \
  --listen "$HOOK" --health-listen "$HEALTH" >"$WORK/pinswap.log" 2>&1 &
SERVE_PID=$!
PIDS+=("$SERVE_PID")
ready=
for _ in $(seq 100); do
  kill -0 "$SERVE_PID" 2>/dev/null || { echo "pinswap serve exited" >&2; exit 1; }
  curl -fs "http://$HEALTH/readyz" >/dev/null && { ready=1; break; }
  sleep 0.1
done
[ -n "$ready" ] || { echo "pinswap serve not ready after 10 s" >&2; exit 1; }
step "serving https://$HOOK/mutate; health and metrics on http://$HEALTH (ready)"

HELLO_DIGEST=$(digest "$SRC" library/hello v1)
mkdir -p "$WORK/reviews"
for f in examples/admission/*.json; do
  name=$(basename "$f" .json)
  sed -e "s|{{SRC}}|$SRC|g" -e "s|{{HELLO_DIGEST}}|$HELLO_DIGEST|g" "$f" >"$WORK/reviews/$name.request.json"
  curl -fsS --cacert "$WORK/ca.crt" -H 'Content-Type: application/json' \
    --data-binary @"$WORK/reviews/$name.request.json" "https://$HOOK/mutate" \
    -o "$WORK/reviews/$name.response.json"
done

# Apply each response's JSONPatch to its Pod, print what changed and why,
# check every expectation, then compare digests at the source and the target.
python3 - "$WORK/reviews" "$SRC" "$DST/webhook" <<'PY'
import base64, glob, json, os, sys, urllib.request

reviews, src, target = sys.argv[1:4]
ACCEPT = ", ".join([
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.docker.distribution.manifest.v2+json",
])
problems = []

def check(ok, what):
    if not ok:
        problems.append(what)
    return ok

def decode_patch(patch):
    # kube-core serialises the patch as an array of byte values; the
    # AdmissionReview spec says base64. Accept both.
    raw = bytes(patch) if isinstance(patch, list) else base64.b64decode(patch)
    return json.loads(raw)

def pointer(doc, path):
    parts = [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]
    for p in parts[:-1]:
        doc = doc[int(p)] if isinstance(doc, list) else doc[p]
    return doc, parts[-1]

def apply(doc, ops):
    for op in ops:
        parent, key = pointer(doc, op["path"])
        if isinstance(parent, list):
            key = len(parent) if key == "-" else int(key)
        if op["op"] == "add" and isinstance(parent, list):
            parent.insert(key, op["value"])
        elif op["op"] in ("add", "replace"):
            if op["op"] == "replace":
                parent[key]  # must exist
            parent[key] = op["value"]
        elif op["op"] == "remove":
            del parent[key]
        elif op["op"] == "test":
            if parent[key] != op["value"]:
                raise ValueError(f"test failed at {op['path']}")
        else:
            raise ValueError(f"unexpected op {op['op']}")
    return doc

def head(url):
    req = urllib.request.Request(url, method="HEAD", headers={"Accept": ACCEPT})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.headers.get("Docker-Content-Digest")
    except OSError as e:
        return f"missing ({e})"

def split(image):
    """HOST/REPO[:TAG][@DIGEST] -> (host, repo, tag, digest)."""
    host, _, rest = image.partition("/")
    rest, _, digest = rest.partition("@")
    repo, tag = rest, None
    if ":" in rest.rsplit("/", 1)[-1]:
        repo, _, tag = rest.rpartition(":")
    return host, repo, tag, digest or None

mirrored = {}  # rewritten image -> original image
for req_path in sorted(glob.glob(os.path.join(reviews, "*.request.json"))):
    name = os.path.basename(req_path)[: -len(".request.json")]
    request = json.load(open(req_path))["request"]
    review = json.load(open(os.path.join(reviews, name + ".response.json")))
    resp = review["response"]
    pod = request["object"]
    meta = pod["metadata"]
    print(f"\n-- {name}: Pod {meta.get('namespace')}/{meta.get('name') or meta.get('generateName', '') + '*'}")
    check(resp.get("uid") == request["uid"], f"{name}: response uid differs")
    check(resp.get("allowed") is True, f"{name}: not allowed: {resp.get('status')}")
    ops = decode_patch(resp["patch"]) if resp.get("patch") else []
    if resp.get("patch"):
        check(resp.get("patchType") == "JSONPatch", f"{name}: patchType {resp.get('patchType')}")
    original = json.loads(json.dumps(pod))
    pod = apply(pod, ops)
    notes = pod["metadata"].get("annotations", {})
    decisions = json.loads(notes.get("pinswap.dev/decisions", "{}"))
    originals = json.loads(notes.get("pinswap.dev/original-images", "{}"))
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for before, after in zip(original["spec"].get(kind, []), pod["spec"].get(kind, [])):
            slot = f"{kind}/{before['name']}"
            old, new = before["image"], after["image"]
            skip = any(e.get("name") == "PINSWAP_SKIP" and e.get("value") == "true"
                       for e in before.get("env", []))
            expect = old.startswith(src + "/") and not skip
            print(f"  {slot}\n    was {old}\n    now {new if new != old else '(unchanged)'}")
            if expect:
                if check(new.startswith(target + "/") and "@sha256:" in new,
                         f"{name} {slot}: not rewritten to a pinned target image"):
                    mirrored[new] = old
                check(originals.get(slot) == old,
                      f"{name} {slot}: original-images has {originals.get(slot)!r}")
            else:
                check(new == old, f"{name} {slot}: rewritten, but it should be left alone")
            check(slot in decisions, f"{name} {slot}: no decision recorded")
    print("  pinswap.dev/decisions:")
    for slot, why in sorted(decisions.items()):
        print(f"    {slot}: {why}")
    identity = json.loads(notes.get("pinswap.dev/identity", "{}"))
    if identity:
        print("  pinswap.dev/identity (identity.collisions: warn):")
        for slot, finding in sorted(identity.items()):
            print(f"    {slot}: {finding}")

print("\n== mirrored digests: the source's and the target's (HEAD, full Accept list)")
print(f"{'image at the target':<58} {'source digest':<73} target digest")
for new, old in sorted(mirrored.items()):
    shost, srepo, stag, sdigest = split(old)
    thost, trepo, ttag, tdigest = split(new)
    s = head(f"http://{shost}/v2/{srepo}/manifests/{sdigest or stag}")
    by_digest = head(f"http://{thost}/v2/{trepo}/manifests/{tdigest}")
    by_tag = head(f"http://{thost}/v2/{trepo}/manifests/{ttag}") if ttag else by_digest
    same = s == tdigest == by_digest == by_tag
    shown = f"{trepo}{':' + ttag if ttag else '@' + tdigest[:19] + '…'}"
    print(f"{shown:<58} {s:<73} {by_digest} {'same' if same else 'DIFFERENT'}")
    check(same, f"{new}: source {s}, pinned {tdigest}, target by digest {by_digest}, by tag {by_tag}")
    if not ttag:
        with urllib.request.urlopen(f"http://{thost}/v2/{trepo}/tags/list", timeout=10) as r:
            tags = json.load(r).get("tags") or []
        print(f"{'':<58} tags at the target: {', '.join(sorted(tags))} (a digest-only image gets an anchor tag)")

if problems:
    print("\n== PROBLEMS", *problems, sep="\n  ", file=sys.stderr)
    sys.exit(1)
PY

echo
step "/metrics (admissions, rewrites, copies)"
curl -fsS "http://$HEALTH/metrics" >"$WORK/metrics.txt"
grep -E '^pinswap_(admissions_total|rewrites_total|copies_(started|succeeded|failed)_total|cache_(hits|misses)_total)' "$WORK/metrics.txt"
grep -q '^pinswap_copies_failed_total 0$' "$WORK/metrics.txt" || { echo "a copy failed" >&2; exit 1; }

# ------------------------------------------------------- the mirror loses one
echo
WEB=webhook/$SRCCOMP/acme/web
WEB_DIGEST=$(digest "$DST" "$WEB" 1.0)
step "the target loses $WEB:1.0 (DELETE of its manifest, as a lifecycle rule would)"
curl -fsS -X DELETE "http://$DST/v2/$WEB/manifests/$WEB_DIGEST" -o /dev/null
evicted=
for _ in $(seq 100); do
  curl -fsS "http://$HEALTH/metrics" >"$WORK/metrics.txt"
  grep -q '^pinswap_cache_invalidations_total{cache="existence",cause="reverification"} 1$' "$WORK/metrics.txt" && { evicted=1; break; }
  sleep 0.1
done
[ -n "$evicted" ] || { echo "re-verification did not evict the pruned image" >&2; exit 1; }
grep -E '^pinswap_(reverifications_total|cache_invalidations_total|cache_entries)' "$WORK/metrics.txt"
step "re-verification evicted it; the next admission copies it again before rewriting"
curl -fsS --cacert "$WORK/ca.crt" -H 'Content-Type: application/json' \
  --data-binary @"$WORK/reviews/01-pod-shop.request.json" "https://$HOOK/mutate" -o "$WORK/again.json"
[ "$(digest "$DST" "$WEB" 1.0)" = "$WEB_DIGEST" ] || { echo "$WEB:1.0 was not mirrored again" >&2; exit 1; }
echo "$WEB:1.0 is back: $WEB_DIGEST"
grep -E '^pinswap_copies_(started|succeeded)_total' <(curl -fsS "http://$HEALTH/metrics")
step "pinswap cache purge --all (the health port's POST /cache/purge)"
$PINSWAP cache purge --all --server "http://$HEALTH"

# ------------------------------------------------------- the source goes down
echo
step "the source registry stops (kill $SRC_PID); the caches are empty after the purge"
kill "$SRC_PID"
wait "$SRC_PID" 2>/dev/null || true
curl -fsS --cacert "$WORK/ca.crt" -H 'Content-Type: application/json' \
  --data-binary @"$WORK/reviews/01-pod-shop.request.json" "https://$HOOK/mutate" -o "$WORK/down.json"
python3 - "$WORK/down.json" "$DST" <<'PY'
import base64, json, sys
resp = json.load(open(sys.argv[1]))["response"]
target = sys.argv[2]
patch = resp.get("patch")
raw = bytes(patch) if isinstance(patch, list) else base64.b64decode(patch or "W10=")
ops = json.loads(raw)
images = [op["value"] for op in ops if op["path"].endswith("/image")]
notes = {}
for op in ops:
    if op["path"].startswith("/metadata/annotations"):
        value = op["value"]
        if isinstance(value, dict):
            notes.update(value)
        else:
            notes[op["path"].rsplit("/", 1)[-1].replace("~1", "/")] = value
decisions = json.loads(notes.get("pinswap.dev/decisions", "{}"))
print("the next Pod still goes to the mirror:")
for image in images:
    print(f"  {image}")
for slot, why in sorted(decisions.items()):
    print(f"  {slot}: {why}")
ok = len(images) == 3 and all(i.startswith(target + "/") and "@sha256:" in i for i in images)
if not ok:
    sys.exit("the Pod was not rewritten to the mirror while the source is down")
PY
grep -E '^pinswap_(source_failures_total|source_breaker_open|rewrites_total)' <(curl -fsS "http://$HEALTH/metrics")
REVIEWS=$(find "$WORK/reviews" -name '*.response.json' | wc -l)
if [ -n "$KEEP" ]; then
  step "--keep: the source registry starts again on $SRC; everything stays up until Ctrl-C"
  docker-registry serve "$WORK/source.yml" >>"$WORK/source.log" 2>&1 &
  PIDS=("$!" "${PIDS[@]}")
  wait_for "http://$SRC/v2/" "${PIDS[0]}" "registry source"
  cat <<EOT
  source registry   http://$SRC   (catalog: curl http://$SRC/v2/_catalog)
  target registry   http://$DST   (catalog: curl http://$DST/v2/_catalog)
  webhook           https://$HOOK/mutate   (CA: $WORK/ca.crt)
  health, metrics   http://$HEALTH/readyz   http://$HEALTH/metrics
  config, reviews   $WORK/demo.yaml   $WORK/reviews/
  log               $WORK/pinswap.log
  try               curl -sS --cacert $WORK/ca.crt -H 'Content-Type: application/json' --data-binary @$WORK/reviews/01-pod-shop.request.json https://$HOOK/mutate
                    $PINSWAP copy docker://$SRC/library/hello:v1 docker://$DST/explore/hello:v1
EOT
fi
STEP=done
echo "verdict: PASS: 4 images copied byte-exact, $REVIEWS admission reviews answered as expected, a pruned image mirrored again, Pods kept on the mirror while the source was down"
if [ -n "$KEEP" ]; then
  trap 'exit 0' INT TERM
  # wait, not a foreground sleep, so a signal ends the wait at once.
  while :; do
    sleep 3600 &
    PIDS+=($!) # cleanup kills it too
    wait $! || true
  done
fi
