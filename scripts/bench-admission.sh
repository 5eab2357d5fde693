#!/usr/bin/env bash
# Admission benchmark: HTTPS load on `pinswap serve` /mutate with hey, against
# a ceiling (examples/ceiling.rs: rustls + axum answering a fixed
# AdmissionReview response, the same bytes pinswap answers with).
#
# Setup: two loopback Distribution registries; three images (an OCI index, a
# Docker schema2 image, a Spin artifact) seeded into the source and already
# mirrored into the target. The review is a Pod with 3 containers, one per
# image. Keep-alive stays on (the API server reuses connections); hey skips
# certificate verification, which is fine on loopback.
#
# Cases, each for $BENCH_DURATION (default 10s):
#   max        -c $BENCH_CONC (default 50), no rate limit: throughput, p50, p99.
#              The ceiling and cached pinswap alternate for $BENCH_ROUNDS
#              rounds (default 2); figures are the mean over rounds.
#   1000/s     -c 10 -q 100 (1,000 req/s in total): p99, ceiling and cached.
#   uncached   a second pinswap with cache {ttl: 0s, resolutionTtl: 0s}, so
#              every slot resolves at the source and checks the target (HEAD
#              each): at 10 req/s (-c 1 -q 10), 100 req/s (-c 10 -q 10) and
#              with no rate limit.
#   stalled    the source registry frozen (SIGSTOP: connections accepted, never
#              answered), a third pinswap with the default caches but
#              resolutionTtl 1s (expired when the load starts), at 100 req/s
#              (-c 10 -q 10): every image is one the target holds, so admissions
#              are answered from the target once the source's breaker has opened.
#   private    private images: a third loopback registry behind htpasswd basic
#              auth (it refuses anonymous requests) holds the same 3 images,
#              also mirrored into the target. A real control plane
#              (target/cluster/pinswap-cluster, built by scripts/build-cluster.sh)
#              holds namespace 'shop' and a kubernetes.io/dockerconfigjson Secret
#              'pull' for that registry, created with kubectl. A pinswap with
#              source.imagePullSecrets: true, both sources and the cached config
#              (default proofTtl 10m), reading the API with the harness's admin
#              kubeconfig (KUBECONFIG), answers the same Pod naming the Secret in
#              imagePullSecrets, once with the public images and once with the
#              private ones: the cached admission with a fresh proof. The two
#              alternate, -c $BENCH_CONC unthrottled, in the 'max' rounds.
#              Before the load, the private review without the Secret must be
#              left unchanged. Needs kubectl, and Go or a built harness;
#              BENCH_PRIVATE=0 skips it, BENCH_PRIVATE=1 fails without them
#              (default: skipped with a note).
#   swapper    k8s-image-swapper's webhook (built by scripts/build-peers.sh),
#              the peer users would run instead, on the same rig with TLS:
#              imageSwapPolicy always and imageCopyPolicy none, which rewrites
#              without any registry call (its lowest cost per review), and an
#              ECR target whose API (GetAuthorizationToken at startup) is moto
#              on loopback: its AWS SDK (aws-sdk-go v1) has no endpoint
#              setting, so it reaches moto through HTTPS_PROXY (moto_proxy,
#              its CA given by AWS_CA_BUNDLE) and nothing leaves the machine.
#              Against cached pinswap on the same Pods of 1, 5 and 20
#              containers (distinct images, all mirrored), alternating, -c
#              $BENCH_CONC unthrottled, and at 1,000 req/s with 5 containers.
#              k8s-image-swapper cannot map a source with a port (its target
#              reference "<ecr>/127.0.0.1:PORT/..." does not parse, and the
#              request panics), so its Pods name the same images under
#              registry.bench.internal, which it never contacts.
#              Needs moto_proxy (pip install 'moto[server,proxy]'); skipped with
#              the reason when the peer or moto is missing.
#   profile    not in the default set: perf record (DWARF stacks) of the cached
#              instance under the 1- and 20-container reviews (-c $BENCH_CONC),
#              its samples grouped by stage of the review and by library,
#              in µs of CPU per review, with the fixed part (what does not
#              grow with containers) apart. Needs perf (linux-perf).
# Every run also reads the server's own CPU time (user + system, from
# /proc) and reports it per answer: hey shares the machine's cores, so
# throughput here is what hey leaves over, and CPU per review is the
# server's alone, what a machine serving only admissions would spend.
# Cached pinswap uses the default caches (ttl 1h, resolutionTtl 30s).
# With BASELINE_BIN (another pinswap build, e.g. the last release), another
# instance of it with the cached config joins the 'max' rounds, so that a
# change is measured against its baseline in the same run.
#
# usage: scripts/bench-admission.sh [--quick]     (--quick: 3 s per case, 1 round)
# env: PINSWAP_BIN, CEILING_BIN (skip the cargo builds), BASELINE_BIN, BENCH_DURATION,
#      BENCH_CONC, BENCH_ROUNDS; BENCH_CASES (which cases, space- or
#      comma-separated; default "max 1000/s uncached stalled private swapper");
#      BENCH_PRIVATE (above); PINSWAP_LOG (pinswap's log level; default info,
#      one line per admission, to a file)
# Results: target/bench/bench-admission.md (and .json); with profile, its
# tables also in bench-admission-profile.md (and appended to the first),
# target/bench/perf-{1,20}.data and their stacks, profile-{1,20}.txt.gz
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${BENCH_DURATION:-10s}
CONC=${BENCH_CONC:-50}
ROUNDS=${BENCH_ROUNDS:-2}
if [ "${1:-}" = --quick ]; then DURATION=3s ROUNDS=1; fi
ALL_CASES="max 1000/s uncached stalled private swapper"
CASES=" ${BENCH_CASES:-$ALL_CASES} "
CASES=${CASES//,/ }
for c in $CASES; do
  case " $ALL_CASES profile " in *" $c "*) ;; *) echo "error: BENCH_CASES: unknown case '$c' (known: $ALL_CASES profile)" >&2; exit 2 ;; esac
done
want() { [[ $CASES == *" $1 "* ]]; } # CASE: is it selected?

# shellcheck source=scripts/lib.sh
source scripts/lib.sh # (the working directory is the repo root)
ensure_tools hey:hey docker-registry:docker-registry openssl:openssl curl:curl python3:python3
if want profile; then ensure_tools perf:linux-perf; fi

# The private case needs kubectl and the control-plane harness.
CLUSTER='' PRIVATE_SKIPPED=''
if want private && [ "${BENCH_PRIVATE:-}" != 0 ]; then
  if ! command -v kubectl >/dev/null; then
    PRIVATE_SKIPPED="kubectl is not installed"
  elif command -v go >/dev/null; then
    CLUSTER=$PWD/$(scripts/build-cluster.sh)
  elif [ -x target/cluster/pinswap-cluster ]; then
    echo "== Go is not installed: using the harness already built (not checked against tests/cluster/)"
    CLUSTER=$PWD/target/cluster/pinswap-cluster
  else
    PRIVATE_SKIPPED="Go is not installed and target/cluster/pinswap-cluster is not built"
  fi
  if [ -n "$PRIVATE_SKIPPED" ] && [ "${BENCH_PRIVATE:-}" = 1 ]; then
    echo "error: BENCH_PRIVATE=1, but $PRIVATE_SKIPPED (BENCH_PRIVATE=0 skips the private case)" >&2
    exit 1
  fi
  if [ -n "$CLUSTER" ]; then ensure_tools htpasswd:apache2-utils; fi
fi
if want private && [ -z "$CLUSTER" ]; then
  echo "== private case skipped: ${PRIVATE_SKIPPED:-BENCH_PRIVATE=0}"
  CASES=${CASES/ private / }
fi

SWAPPER='' SWAPPER_SKIPPED=''
if want swapper; then
  if ! command -v go >/dev/null; then
    SWAPPER_SKIPPED="Go is not installed (scripts/build-peers.sh builds the peer)"
  elif ! command -v moto_proxy >/dev/null || ! python3 -c 'import multipart' 2>/dev/null; then
    SWAPPER_SKIPPED="moto_proxy is not installed (pip install 'moto[server,proxy]==5.2.1')"
  else
    PEERS_DIR=$PWD/$(scripts/build-peers.sh)
    if [ -x "$PEERS_DIR/k8s-image-swapper" ]; then
      SWAPPER=$PEERS_DIR/k8s-image-swapper
    else
      SWAPPER_SKIPPED="k8s-image-swapper did not build: $(tail -n 1 "$PEERS_DIR/k8s-image-swapper.err")"
    fi
  fi
  if [ -z "$SWAPPER" ]; then
    echo "== swapper case skipped: $SWAPPER_SKIPPED"
    CASES=${CASES/ swapper / }
  fi
fi

if [ -z "${PINSWAP_BIN:-}" ] || [ -z "${CEILING_BIN:-}" ]; then
  echo "== building pinswap and the ceiling example (release)"
  cargo build --release --quiet --bin pinswap --example ceiling
fi
PINSWAP=${PINSWAP_BIN:-$PWD/target/release/pinswap}
CEILING=${CEILING_BIN:-$PWD/target/release/examples/ceiling}
OUT=$PWD/target/bench
mkdir -p "$OUT"

WORK=$(mktemp -d)
PIDS=()
cleanup() {
  local rc=$?
  if ((rc)); then
    for log in "$WORK"/{cached,uncached,stalled,baseline,private,ceiling,cluster,psource,swapper,moto}.log; do
      [ -s "$log" ] && { echo "== $(basename "$log") (last lines)" >&2; tail -n 5 "$log" | cut -c1-300 >&2; }
    done
  fi
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do kill "${PIDS[i]}" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT


# Each server's PID by its address: run() reads the server's CPU time.
declare -A PID_OF=()
start_pinswap() { # NAME CONFIG VAR_HOOK VAR_HEALTH [BINARY]
  local hook health
  hook=127.0.0.1:$(free_port) health=127.0.0.1:$(free_port)
  ${5:-$PINSWAP} serve --config "$2" --tls-cert "$WORK/tls.crt" --tls-key "$WORK/tls.key" \
    --listen "$hook" --health-listen "$health" >"$WORK/$1.log" 2>&1 &
  PIDS+=($!)
  PID_OF[$hook]=$!
  wait_for "http://$health/readyz" $! "pinswap ($1)"
  printf -v "$3" '%s' "$hook"
  printf -v "$4" '%s' "$health"
}

CLUSTER_PID=''
if want private; then
  # Started first: it takes about 15 s to be ready, while the rest is set up.
  # SIGTERM (cleanup) stops it and removes its directory.
  "$CLUSTER" >"$WORK/cluster.out" 2>"$WORK/cluster.log" &
  PIDS+=($!)
  CLUSTER_PID=$!
fi

SRC='' DST='' # set by start_registry
start_registry source SRC
SRC_PID=${PIDS[-1]}
start_registry target DST
echo "== registries: source $SRC, target $DST"
seed() { # REGISTRY [COPY ARGS...]: the 3 images into REGISTRY; their list into $WORK/images-REGISTRY.txt
  local reg=$1
  shift
  $PINSWAP copy "$@" oci:examples/oci/hello:v1 "docker://$reg/library/hello:v1" >/dev/null
  $PINSWAP copy "$@" oci:examples/oci/web:1.0 "docker://$reg/acme/web:1.0" >/dev/null
  $PINSWAP copy "$@" oci:examples/oci/spin:hello "docker://$reg/spin/hello:v1" >/dev/null
  printf '%s\n' "$reg/library/hello:v1" "$reg/acme/web:1.0" "$reg/spin/hello:v1" >"$WORK/images-$reg.txt"
}
seed "$SRC"
$PINSWAP copy --from-file "$WORK/images-$SRC.txt" --to "docker://$DST/mirror" >/dev/null
echo "== seeded 3 images and mirrored them to $DST/mirror"
PSRC='' PCREDS='' PSRC_PID=''
if want private; then
  PCREDS=bench:$(openssl rand -hex 12)
  start_registry psource PSRC "$PCREDS"
  PSRC_PID=${PIDS[-1]}
  seed "$PSRC" --dest-creds "$PCREDS"
  $PINSWAP copy --src-creds "$PCREDS" --from-file "$WORK/images-$PSRC.txt" --to "docker://$DST/mirror" >/dev/null
  anon=$(curl -s -o /dev/null -w '%{http_code}' "http://$PSRC/v2/library/hello/manifests/v1")
  [ "$anon" = 401 ] || { echo "error: the private source answered $anon to an anonymous request" >&2; exit 1; }
  echo "== private source $PSRC (basic auth; anonymous: $anon): the same 3 images, mirrored to $DST/mirror"
fi

make_certs "pinswap bench"

# The swapper case's Pods: 20 distinct images (one layout under 20 names),
# mirrored like the others, and reviews of 1, 5 and 20 containers.
SWAP_HOOK='' ECR=123456789012.dkr.ecr.us-east-1.amazonaws.com
if want swapper || want profile; then
  : >"$WORK/fleet.txt"
  for i in $(seq 20); do
    $PINSWAP copy oci:examples/oci/hello:v1 "docker://$SRC/fleet/app$i:v1" >/dev/null
    echo "$SRC/fleet/app$i:v1" >>"$WORK/fleet.txt"
  done
  $PINSWAP copy --from-file "$WORK/fleet.txt" --to "docker://$DST/mirror" >/dev/null
  for n in 1 5 20; do
    python3 - "$WORK/fleet.txt" "$n" >"$WORK/review-$n.json" <<'PY'
import json, sys
images = open(sys.argv[1]).read().split()[: int(sys.argv[2])]
print(json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
    "uid": "0b6e4c1a-3f2d-4e5b-8a7c-9d1e2f3a4b5c",
    "kind": {"group": "", "version": "v1", "kind": "Pod"},
    "resource": {"group": "", "version": "v1", "resource": "pods"},
    "namespace": "shop", "operation": "CREATE",
    "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
    "object": {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"generateName": "fleet-", "namespace": "shop"},
               "spec": {"containers": [{"name": f"c{i}", "image": im} for i, im in enumerate(images)]}},
    "dryRun": False}}, separators=(",", ":")))
PY
    sed "s|\"$SRC/|\"registry.bench.internal/|g" "$WORK/review-$n.json" >"$WORK/review-swapper-$n.json"
  done
fi
if want swapper; then
  MOTO=127.0.0.1:$(free_port)
  MOTO_CA=$(python3 -c 'import moto.moto_proxy, os; print(os.path.dirname(moto.moto_proxy.__file__))')/ca.crt
  (cd "$WORK" && AWS_EC2_METADATA_DISABLED=true exec moto_proxy -H 127.0.0.1 -p "${MOTO#*:}") >"$WORK/moto.log" 2>&1 &
  PIDS+=($!)
  # Ready when it answers the ECR call the peer makes at startup.
  wait_for https://api.ecr.us-east-1.amazonaws.com/ $! moto_proxy -x "http://$MOTO" --cacert "$MOTO_CA" \
    -X POST -H 'Content-Type: application/x-amz-json-1.1' \
    -H 'X-Amz-Target: AmazonEC2ContainerRegistry_V20150921.GetAuthorizationToken' \
    -H 'Authorization: AWS4-HMAC-SHA256 Credential=bench/20260101/us-east-1/ecr/aws4_request, SignedHeaders=host, Signature=0' \
    --data '{}'
  cat >"$WORK/swapper.yaml" <<YML
dryRun: false
logLevel: warn
logFormat: json
imageSwapPolicy: always
imageCopyPolicy: none
source:
  registries: []
target:
  type: aws
  aws:
    accountId: "123456789012"
    region: us-east-1
YML
  SWAP_HOOK=127.0.0.1:$(free_port)
  # Every request of its AWS SDK goes to moto_proxy on loopback; no metadata
  # service. Without KUBERNETES_SERVICE_HOST it reads no Secrets.
  env -u KUBERNETES_SERVICE_HOST -u NO_PROXY -u no_proxy AWS_EC2_METADATA_DISABLED=true \
    HTTPS_PROXY="http://$MOTO" HTTP_PROXY="http://$MOTO" AWS_CA_BUNDLE="$MOTO_CA" \
    AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=bench AWS_REGION=us-east-1 \
    "$SWAPPER" --config "$WORK/swapper.yaml" --listen-address "$SWAP_HOOK" \
    --tls-cert-file "$WORK/tls.crt" --tls-key-file "$WORK/tls.key" >"$WORK/swapper.log" 2>&1 &
  PIDS+=($!)
  PID_OF[$SWAP_HOOK]=$!
  wait_for "https://$SWAP_HOOK/" $! k8s-image-swapper --cacert "$WORK/ca.crt"
  echo "== k8s-image-swapper on $SWAP_HOOK (ECR API: moto_proxy on $MOTO); 20 fleet images mirrored to $DST/mirror"
fi

config() { # CACHE_LINE
  cat <<YML
target: {registry: "$DST/mirror", insecure: true}
source: {registries: [{registry: "$SRC"}]}
swapPolicy: exists
copyPolicy: immediate
$1
YML
}
config "cache: {ttl: 1h, resolutionTtl: 30s}" >"$WORK/cached.yaml"
config "cache: {ttl: 0s, resolutionTtl: 0s, reverify: 0s}" >"$WORK/uncached.yaml"
config "cache: {ttl: 1h, resolutionTtl: 1s}" >"$WORK/stalled.yaml"
HOOK='' HEALTH='' HOOK_U='' HEALTH_U='' HOOK_S='' HEALTH_S='' # set by start_pinswap
start_pinswap cached "$WORK/cached.yaml" HOOK HEALTH
CACHED_PID=${PIDS[-1]}
if want uncached; then start_pinswap uncached "$WORK/uncached.yaml" HOOK_U HEALTH_U; fi
if want stalled; then start_pinswap stalled "$WORK/stalled.yaml" HOOK_S HEALTH_S; fi
# shellcheck disable=SC2034 # HEALTH_B: start_pinswap sets it; nothing reads the baseline's metrics
HOOK_B='' HEALTH_B=''
if [ -n "${BASELINE_BIN:-}" ]; then
  start_pinswap baseline "$WORK/cached.yaml" HOOK_B HEALTH_B "$BASELINE_BIN"
fi

cat >"$WORK/review.json" <<JSON
{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{
 "uid":"2a7f0c1e-8d4b-4f3a-9e6c-5b1d0a2c3e4f",
 "kind":{"group":"","version":"v1","kind":"Pod"},
 "resource":{"group":"","version":"v1","resource":"pods"},
 "namespace":"shop","operation":"CREATE",
 "userInfo":{"username":"system:serviceaccount:kube-system:replicaset-controller"},
 "object":{"apiVersion":"v1","kind":"Pod",
  "metadata":{"generateName":"shop-web-6c9f7d8b5-","namespace":"shop","labels":{"app":"shop-web"}},
  "spec":{"containers":[
   {"name":"hello","image":"$SRC/library/hello:v1"},
   {"name":"web","image":"$SRC/acme/web:1.0","ports":[{"containerPort":8080}]},
   {"name":"spin","image":"$SRC/spin/hello:v1"}]}},
 "dryRun":false}}
JSON

mutate() { # HOOK OUT [REVIEW [N [PATH PREFIX]]]: one request; fails unless N (default 3) containers are rewritten
  curl -fsS --cacert "$WORK/ca.crt" -H 'Content-Type: application/json' \
    --data-binary @"${3:-$WORK/review.json}" "https://$1${5:-/mutate}" -o "$2"
  python3 - "$2" "${6:-$DST/mirror/}" "${4:-3}" <<'PY'
import base64, json, sys
resp = json.load(open(sys.argv[1]))["response"]
patch = resp.get("patch") or []
ops = json.loads(bytes(patch) if isinstance(patch, list) else base64.b64decode(patch))
# pinswap replaces each image; k8s-image-swapper's patch may replace the
# whole container list instead.
def images_in(v):
    if isinstance(v, dict):
        return [v["image"]] if "image" in v else [i for x in v.values() for i in images_in(x)]
    return [i for x in v for i in images_in(x)] if isinstance(v, list) else []
images = [o["value"] if o["path"].endswith("/image") else i
          for o in ops for i in ([None] if o["path"].endswith("/image") else images_in(o.get("value")))]
images = [i for i in images if i is not None]
n = int(sys.argv[3])
pinned = sys.argv[2].endswith("/mirror/")
if len(images) != n or not all(i.startswith(sys.argv[2]) and ("@sha256:" in i or not pinned) for i in images):
    sys.exit(f"expected {n} rewritten images, got {images} in {resp}")
PY
}

HOOK_P='' HEALTH_P='' APISERVER=''
if want private; then
  for _ in $(seq 600); do
    grep -q '^dir ' "$WORK/cluster.out" && break
    kill -0 "$CLUSTER_PID" 2>/dev/null || { echo "the cluster harness exited" >&2; exit 1; }
    sleep 0.1
  done
  grep -q '^dir ' "$WORK/cluster.out" || { echo "the cluster harness was not ready in 60 s" >&2; exit 1; }
  KCFG=$(awk '$1 == "kubeconfig" {print $2}' "$WORK/cluster.out")
  APISERVER=$(awk '$1 == "kube-apiserver" {print $2}' "$WORK/cluster.out")
  kc() { kubectl --kubeconfig "$KCFG" "$@"; }
  kc create namespace shop >/dev/null
  kc -n shop create secret docker-registry pull --docker-server="$PSRC" \
    --docker-username="${PCREDS%%:*}" --docker-password="${PCREDS#*:}" >/dev/null
  [ "$(kc -n shop get secret pull -o jsonpath='{.type}')" = kubernetes.io/dockerconfigjson ]
  # The ServiceAccount controller creates 'default', which pinswap reads too.
  for _ in $(seq 100); do kc -n shop get serviceaccount default >/dev/null 2>&1 && break; sleep 0.2; done
  kc -n shop get serviceaccount default >/dev/null
  echo "== kube-apiserver $APISERVER: namespace shop, Secret shop/pull (kubernetes.io/dockerconfigjson for $PSRC)"
  cat >"$WORK/private.yaml" <<YML
target: {registry: "$DST/mirror", insecure: true}
source:
  registries: [{registry: "$SRC"}, {registry: "$PSRC"}]
  imagePullSecrets: true
swapPolicy: exists
copyPolicy: immediate
cache: {ttl: 1h, resolutionTtl: 30s}
YML
  # The admin kubeconfig (system:masters): pinswap needs only get on secrets
  # and serviceaccounts in the Pods' namespaces; the benchmark does not model RBAC.
  KUBECONFIG=$KCFG start_pinswap private "$WORK/private.yaml" HOOK_P HEALTH_P
  pod_review() { # SOURCE PULL_SECRETS_JSON: the review above, its images at SOURCE
    python3 - "$WORK/review.json" "$SRC" "$1" "$2" <<'PY'
import json, sys
path, src, to, secrets = sys.argv[1:]
review = json.load(open(path))
spec = review["request"]["object"]["spec"]
for c in spec["containers"]:
    c["image"] = c["image"].replace(src + "/", to + "/", 1)
spec["imagePullSecrets"] = json.loads(secrets)
print(json.dumps(review, separators=(",", ":")))
PY
  }
  pod_review "$SRC" '[{"name":"pull"}]' >"$WORK/review-public.json"
  pod_review "$PSRC" '[{"name":"pull"}]' >"$WORK/review-private.json"
  pod_review "$PSRC" '[]' >"$WORK/review-nosecret.json"
  mutate "$HOOK_P" "$WORK/response-n.json" "$WORK/review-nosecret.json" 0
  echo "== private images, the Pod naming no Secret: left unchanged"
fi

echo "== warm-up: 20 requests to each pinswap; every container must be rewritten"
for _ in $(seq 20); do
  mutate "$HOOK" "$WORK/response.json"
  if [ -n "$HOOK_U" ]; then mutate "$HOOK_U" "$WORK/response-u.json"; fi
  if [ -n "$HOOK_S" ]; then mutate "$HOOK_S" "$WORK/response-s.json"; fi
  if [ -n "$HOOK_B" ]; then mutate "$HOOK_B" "$WORK/response-b.json"; fi
  if [ -n "$HOOK_P" ]; then
    mutate "$HOOK_P" "$WORK/response-pub.json" "$WORK/review-public.json"
    mutate "$HOOK_P" "$WORK/response-priv.json" "$WORK/review-private.json"
  fi
  if want swapper || want profile; then
    for n in 1 5 20; do mutate "$HOOK" "$WORK/response-$n.json" "$WORK/review-$n.json" "$n"; done
  fi
  if [ -n "$SWAP_HOOK" ]; then
    for n in 1 5 20; do
      mutate "$SWAP_HOOK" "$WORK/response-swapper-$n.json" "$WORK/review-swapper-$n.json" "$n" /webhook "$ECR/"
    done
  fi
done

CEIL=127.0.0.1:$(free_port)
"$CEILING" --listen "$CEIL" --cert "$WORK/tls.crt" --key "$WORK/tls.key" \
  --body "$WORK/response.json" >"$WORK/ceiling.log" 2>&1 &
PIDS+=($!)
PID_OF[$CEIL]=$!
wait_for "https://$CEIL/mutate" $! ceiling --cacert "$WORK/ca.crt" --data-binary @"$WORK/review.json"
echo "== ceiling on $CEIL answers with pinswap's response ($(wc -c <"$WORK/response.json") bytes)"

metric() { # HEALTH NAME_AND_LABELS: a counter's value
  curl -fsS "http://$1/metrics" | awk -v m="$2" '$1 == m {print $2; f=1} END {if (!f) print 0}'
}

RESULTS=$WORK/results.jsonl
: >"$RESULTS"
run() { # CASE WHO HOOK HEY-ARGS...: one hey run (of $REVIEW, default the review above), parsed into a JSON line
  local case=$1 who=$2 hook=$3 review=${REVIEW:-$WORK/review.json} pid ticks
  shift 3
  pid=${PID_OF[$hook]}
  ticks=$(cpu_ticks "$pid")
  printf '   %-9s %-17s hey -z %s %s ... ' "$case" "$who" "$DURATION" "$*"
  # -host: hey sends its Host value ("127.0.0.1:PORT") as the TLS SNI, which
  # rustls rejects (illegal_parameter); "localhost" is a valid SNI name.
  hey -z "$DURATION" "$@" -host localhost -m POST -T application/json -D "$review" \
    "https://$hook${URL_PATH:-/mutate}" >"$WORK/hey.txt"
  ticks=$(($(cpu_ticks "$pid") - ticks))
  python3 - "$WORK/hey.txt" "$RESULTS" "$case" "$who" "$*" "$ROUND" "$ticks" "$(getconf CLK_TCK)" <<'PY'
import json, re, sys
text, results, case, who, args, rnd, ticks, clk = open(sys.argv[1]).read(), *sys.argv[2:]
num = lambda pat: float(re.search(pat, text).group(1))
codes = {int(c): int(n) for c, n in re.findall(r"\[(\d+)\]\s+(\d+) responses", text)}
errors = re.findall(r"\[(\d+)\]\s+(.+)", text.split("Error distribution:")[1]) if "Error distribution:" in text else []
ok = codes.get(200, 0)
bad = sum(n for c, n in codes.items() if c != 200) + sum(int(n) for n, _ in errors)
if not ok:  # hey prints no latency figures without a successful response
    sys.exit(f"no successful responses:\n{text}")
r = {"case": case, "who": who, "args": args, "rps": num(r"Requests/sec:\s+([\d.]+)"),
     "p50": num(r"50% in ([\d.]+) secs") * 1000,
     # hey prints no 99% line below 100 responses; the slowest is then the bound.
     "p99": num(r"99% in ([\d.]+) secs" if "99% in" in text else r"Slowest:\s+([\d.]+)") * 1000,
     "ok": ok, "bad": bad, "round": int(rnd),
     # The server's CPU time (user + system) over the run, per answer.
     "cpu_us": int(ticks) / int(clk) * 1e6 / ok}
with open(results, "a") as f:
    f.write(json.dumps(r) + "\n")
print(f"{r['rps']:8.0f} req/s  p50 {r['p50']:.1f} ms  p99 {r['p99']:.1f} ms  "
      f"CPU {r['cpu_us']:.0f} µs/review  ({ok} ok, {bad} failed)")
PY
}

echo "== load ($(nproc) CPUs; hey runs on the same machine)"
cpu_ticks() { # PID: user + system CPU time so far, in clock ticks
  awk '{sub(/^.*\) /, ""); print $12 + $13}' "/proc/$1/stat"
}
sum_metric() { # HEALTH NAME: a counter summed over its labels
  curl -fsS "http://$1/metrics" | awk -v m="$2" 'index($1, m) == 1 {n += $2} END {print n + 0}'
}
LOAD_BEFORE=$(awk '{print $1, $2, $3}' /proc/loadavg)
hits0=$(metric "$HEALTH" 'pinswap_cache_hits_total{cache="resolution"}')
miss0=$(metric "$HEALTH" 'pinswap_cache_misses_total{cache="resolution"}')
denials=0 secreterr=0 pticks=0
if [ -n "$HOOK_P" ]; then
  pticks=$(cpu_ticks "$PSRC_PID")
  denials=$(sum_metric "$HEALTH_P" pinswap_private_image_denials_total)
  secreterr=$(sum_metric "$HEALTH_P" pinswap_pull_secret_errors_total)
fi
ROUND=0
for ROUND in $(seq "$ROUNDS"); do
  if want max; then
    run max ceiling "$CEIL" -c "$CONC"
    run max pinswap-cached "$HOOK" -c "$CONC"
    if [ -n "$HOOK_B" ]; then run max baseline-cached "$HOOK_B" -c "$CONC"; fi
  fi
  if [ -n "$HOOK_P" ]; then
    REVIEW=$WORK/review-public.json run max pullsecrets-public "$HOOK_P" -c "$CONC"
    REVIEW=$WORK/review-private.json run max pullsecrets-private "$HOOK_P" -c "$CONC"
  fi
  if [ -n "$SWAP_HOOK" ]; then
    for n in 1 5 20; do
      REVIEW=$WORK/review-$n.json run max "pinswap-cached-$n" "$HOOK" -c "$CONC"
      REVIEW=$WORK/review-swapper-$n.json URL_PATH=/webhook run max "k8s-image-swapper-$n" "$SWAP_HOOK" -c "$CONC"
    done
  fi
done
ROUND=0
if [ -n "$HOOK_P" ]; then
  denials=$(($(sum_metric "$HEALTH_P" pinswap_private_image_denials_total) - denials))
  secreterr=$(($(sum_metric "$HEALTH_P" pinswap_pull_secret_errors_total) - secreterr))
  # Cached proofs send nothing to the private source: it stays (nearly) idle.
  pticks=$(($(cpu_ticks "$PSRC_PID") - pticks))
  echo "   private instance during its load: $denials private-image denials, $secreterr pull secret errors;" \
    "private source CPU time: $((pticks * 1000 / $(getconf CLK_TCK))) ms"
fi
if want 1000/s; then
  run 1000/s ceiling "$CEIL" -c 10 -q 100
  run 1000/s pinswap-cached "$HOOK" -c 10 -q 100
fi
if [ -n "$SWAP_HOOK" ]; then
  REVIEW=$WORK/review-5.json run 1000/s pinswap-cached-5 "$HOOK" -c 10 -q 100
  REVIEW=$WORK/review-swapper-5.json URL_PATH=/webhook run 1000/s k8s-image-swapper-5 "$SWAP_HOOK" -c 10 -q 100
fi
hits1=$(metric "$HEALTH" 'pinswap_cache_hits_total{cache="resolution"}')
miss1=$(metric "$HEALTH" 'pinswap_cache_misses_total{cache="resolution"}')
umiss0=0 umiss1=0 uhits=0
if [ -n "$HOOK_U" ]; then
  umiss0=$(metric "$HEALTH_U" 'pinswap_cache_misses_total{cache="resolution"}')
  run 10/s pinswap-uncached "$HOOK_U" -c 1 -q 10
  run 100/s pinswap-uncached "$HOOK_U" -c 10 -q 10
  run max pinswap-uncached "$HOOK_U" -c "$CONC"
  umiss1=$(metric "$HEALTH_U" 'pinswap_cache_misses_total{cache="resolution"}')
  uhits=$(metric "$HEALTH_U" 'pinswap_cache_hits_total{cache="resolution"}')
fi
if [ -n "$HOOK_S" ]; then
  echo "== the source registry stalls (SIGSTOP $SRC_PID)"
  kill -STOP "$SRC_PID"
  sleep 1.5 # the stalled instance's resolutionTtl (1s) expires
  # Until the breaker opens, each admission waits up to source.timeout (1s).
  for _ in $(seq 5); do mutate "$HOOK_S" "$WORK/response-s.json"; done
  run 100/s pinswap-stalled "$HOOK_S" -c 10 -q 10
  sfail=$(curl -fsS "http://$HEALTH_S/metrics" | grep -c '^pinswap_source_breaker_open.* 1$' || true)
  echo "   breakers open on the stalled instance: $sfail"
  kill -CONT "$SRC_PID"
fi

python3 - "$RESULTS" "$OUT/bench-admission.md" "$OUT/bench-admission.json" \
  "$DURATION" "$CONC" "$ROUNDS" "$((hits1 - hits0))" "$((miss1 - miss0))" "$((umiss1 - umiss0))" "$uhits" \
  "$(nproc)" "$LOAD_BEFORE" "$(date -u +%F)" "$(awk '{print $1, $2, $3}' /proc/loadavg)" \
  "$APISERVER" "$denials" "$secreterr" "$((pticks * 1000 / $(getconf CLK_TCK)))" <<'PY'
import json, statistics as st, sys
(src, md, js, duration, conc, rounds, hits, misses, umisses, uhits, cpus, load, day, load_after,
 apiserver, denials, secreterr, psrc_ms) = sys.argv[1:]
rows = [json.loads(l) for l in open(src)]
def agg(case, who):
    rs = [r for r in rows if r["case"] == case and r["who"] == who]
    return {k: st.mean(r[k] for r in rs) for k in ("rps", "p50", "p99", "cpu_us")} | {
        "ok": sum(r["ok"] for r in rs), "bad": sum(r["bad"] for r in rs), "args": rs[0]["args"], "runs": len(rs)}
cases = [("max", "ceiling"), ("max", "pinswap-cached"), ("max", "baseline-cached"),
         ("max", "pullsecrets-public"), ("max", "pullsecrets-private"), ("1000/s", "ceiling"),
         ("1000/s", "pinswap-cached"), ("10/s", "pinswap-uncached"), ("100/s", "pinswap-uncached"),
         ("max", "pinswap-uncached"), ("100/s", "pinswap-stalled")]
cases += [("max", f"{w}-{n}") for n in (1, 5, 20) for w in ("pinswap-cached", "k8s-image-swapper")]
cases += [("1000/s", "pinswap-cached-5"), ("1000/s", "k8s-image-swapper-5")]
cases = [(c, w) for c, w in cases if any(r["case"] == c and r["who"] == w for r in rows)]
res = {f"{w} {c}": agg(c, w) for c, w in cases}
have = lambda key: key in res
ratio = res["pinswap-cached max"]["rps"] / res["ceiling max"]["rps"] if have("ceiling max") else None
lines = [
    f"Admission benchmark ({day}; {cpus} CPUs, load average before: {load}, after: {load_after}; "
    f"hey {duration} per run, keep-alive, HTTP/1.1; 'max' = -c {conc} unthrottled, "
    f"mean of {rounds} alternating round(s)"
    + (f"; kube-apiserver {apiserver}" if apiserver else "") + ").",
    "",
    "| server | load (hey) | req/s | p50 ms | p99 ms | server CPU µs/review | failed |",
    "|---|---|---|---|---|---|---|",
]
for c, w in cases:
    r = res[f"{w} {c}"]
    label = {"max": f"max, `-c {conc}`", "1000/s": "1,000 req/s, `-c 10 -q 100`",
             "10/s": "10 req/s, `-c 1 -q 10`", "100/s": "100 req/s, `-c 10 -q 10`"}[c]
    lines.append(f"| {w} | {label} | {r['rps']:,.0f} | {r['p50']:.1f} | {r['p99']:.1f} | {r['cpu_us']:.0f} | {r['bad']} |")
fail = sum(r["bad"] for r in res.values())
verdict = lambda ok: "met" if ok else "missed"
summary = []
if ratio is not None:
    summary.append(f"pinswap/ceiling throughput: {ratio:.2f}×"
        + (f"; pinswap/baseline: {res['pinswap-cached max']['rps'] / res['baseline-cached max']['rps']:.2f}×"
           if have("baseline-cached max") else ""))
if have("pinswap-cached max") or have("pinswap-cached 1000/s"):
    summary.append(f"Resolution cache during the cached runs: {hits} hits, {misses} misses"
        + (f"; uncached instance: {umisses} misses, {uhits} hits" if have("pinswap-uncached max") else ""))
private = None
if have("pullsecrets-private max"):
    pub, priv = res["pullsecrets-public max"], res["pullsecrets-private max"]
    private = {k: priv[k] / pub[k] for k in ("rps", "p50", "p99")}
    rps = lambda who, n: next(r["rps"] for r in rows if r["who"] == who and r["round"] == n)
    per_round = [rps("pullsecrets-private", n) / rps("pullsecrets-public", n)
                 for n in sorted({r["round"] for r in rows if r["who"] == "pullsecrets-private"})]
    summary.append(
        "Private/public images (imagePullSecrets on, one instance, the same Pod and Secret): "
        f"throughput {private['rps']:.2f}×, p50 {private['p50']:.2f}×, p99 {private['p99']:.2f}× "
        f"(throughput per round: {', '.join(f'{x:.2f}×' for x in per_round)}); "
        f"{denials} private-image denials and {secreterr} pull secret errors during that load, "
        f"and the private source used {psrc_ms} ms of CPU"
        + (f"; public images, imagePullSecrets on / off (pinswap-cached): "
           f"{pub['rps'] / res['pinswap-cached max']['rps']:.2f}×" if have("pinswap-cached max") else ""))
targets = []
if ratio is not None:
    targets.append(f"| cached throughput ≥ 0.5× ceiling | {verdict(ratio >= 0.5)}, {ratio:.2f}× |")
for key, bound, name in [
        ("pinswap-cached 1000/s", 5, "cached p99 ≤ 5 ms at 1,000 req/s"),
        ("pinswap-uncached 10/s", 15, "uncached p99 ≤ 15 ms, 10 req/s"),
        ("pinswap-uncached 100/s", 25, "uncached p99 ≤ 25 ms, 100 req/s"),
        ("pinswap-stalled 100/s", 5, "source stalled, images at the target: p99 ≤ 5 ms, 100 req/s")]:
    if have(key):
        targets.append(f"| {name} | {verdict(res[key]['p99'] <= bound)}, {res[key]['p99']:.1f} ms |")
peers = [n for n in (1, 5, 20) if have(f"k8s-image-swapper-{n} max")]
if peers:
    lines += ["", "Against k8s-image-swapper (imageSwapPolicy always, imageCopyPolicy none: no registry call), "
              "the same Pods, alternating rounds:", "",
              "| containers | pinswap req/s | k8s-image-swapper req/s | throughput ratio | pinswap p99 ms | k8s-image-swapper p99 ms "
              "| pinswap CPU µs/review | k8s-image-swapper CPU µs/review | CPU ratio |",
              "|---|---|---|---|---|---|---|---|---|"]
    for n in peers:
        p, k = res[f"pinswap-cached-{n} max"], res[f"k8s-image-swapper-{n} max"]
        lines.append(f"| {n} | {p['rps']:,.0f} | {k['rps']:,.0f} | {p['rps'] / k['rps']:.2f}× | {p['p99']:.1f} | {k['p99']:.1f} "
                     f"| {p['cpu_us']:.0f} | {k['cpu_us']:.0f} | {k['cpu_us'] / p['cpu_us']:.2f}× |")
        targets.append(f"| cached throughput ≥ 3× k8s-image-swapper's, {n} container(s) | "
                       f"{verdict(p['rps'] >= 3 * k['rps'])}, {p['rps'] / k['rps']:.2f}× |")
    if have("k8s-image-swapper-5 1000/s"):
        p, k = res["pinswap-cached-5 1000/s"], res["k8s-image-swapper-5 1000/s"]
        lines.append("")
        lines.append(f"At 1,000 req/s (`-c 10 -q 100`), 5 containers: pinswap p99 {p['p99']:.1f} ms, "
                     f"k8s-image-swapper p99 {k['p99']:.1f} ms.")
        targets.append(f"| p99 at 1,000 req/s ≤ k8s-image-swapper's (5 containers) | "
                       f"{verdict(p['p99'] <= k['p99'])}, {p['p99']:.1f} vs {k['p99']:.1f} ms |")
if summary:
    lines += ["", ". ".join(summary) + "."]
if targets:
    lines += ["", "| target | result |", "|---|---|", *targets]
text = "\n".join(lines) + "\n"
open(md, "w").write(text)
json.dump({"results": res, "ratio": ratio, "private_over_public": private}, open(js, "w"), indent=2)
print(text)
if fail:
    sys.exit(f"{fail} requests failed")
PY
echo "== written to target/bench/bench-admission.md"

# Where a review's CPU goes: perf samples (with DWARF call stacks) of the
# cached instance under the 1- and 20-container reviews, in µs of CPU per
# review, two ways: by the stage of the review a sample's stack is in (the
# innermost stage named on it), and by the library of the sampled function.
# What does not grow with containers is the fixed cost: the 1-container
# figure less the per-container slope.
if want profile; then
  echo "== profile: perf record -F 499 --call-graph dwarf of the cached instance, 1 and 20 containers"
  for n in 1 20; do
    perf record -q -F 499 --call-graph dwarf,16384 -p "$CACHED_PID" -o "$OUT/perf-$n.data" \
      -- sleep "$DURATION" 2>"$WORK/perf.log" &
    perf_pid=$!
    PIDS+=("$perf_pid")
    REVIEW=$WORK/review-$n.json run profile "pinswap-cached-$n" "$HOOK" -c "$CONC"
    wait "$perf_pid" || { cat "$WORK/perf.log" >&2; exit 1; }
    unset 'PIDS[${#PIDS[@]}-1]' # ended: its PID may be reused
    perf script -i "$OUT/perf-$n.data" 2>"$WORK/perf-script.log" | gzip >"$OUT/profile-$n.txt.gz" ||
      { cat "$WORK/perf-script.log" >&2; exit 1; }
  done
  python3 - "$RESULTS" "$OUT" "$CONC" >"$OUT/bench-admission-profile.md" <<'PY'
import gzip, json, re, sys
results, out, conc = sys.argv[1:]
runs = {int(r["who"].rsplit("-", 1)[1]): r for r in map(json.loads, open(results)) if r["case"] == "profile"}
# The innermost frame naming one of these decides a sample's stage; the
# last two (the frameworks every stage runs in) only when no other is named.
STAGES = [
    ("the log line (tracing's fmt layer, the write to stderr)", r"tracing_core::event::Event::dispatch"),
    ("decode the AdmissionReview (serde_json)", r"pinswap::admission::review::decode"),
    ("policy: parse each reference, check its source", r"pinswap::admission::policy::Policy::check"),
    ("identity notes", r"identity_note"),
    ("decide: cache lookups, the target's name", r"Mirror>::plan_with_any|Mirror>::plan_held|Mirror>::held"),
    ("slots: find the Pod's images", r"pinswap::admission::pod::slots_for"),
    ("the patch and annotations", r"pinswap::admission::pod::patch|AdmissionResponse::with_patch"),
    ("encode the response (JSON, base64)", r"pinswap::admission::review::encode"),
    ("metrics", r"prometheus_client"),
    ("the rest of the admission", r"pinswap::admission::Admission::answer|pinswap::admission::Admission::review"),
    ("read the body (budget)", r"pinswap::server::budget"),
    ("send: TLS encrypt, writev, loopback TCP", r"poll_write_vectored|poll_flush|ChunkVecBuffer"),
    ("receive: read, TLS decrypt", r"AsyncRead>::poll_read|poll_fill_buf|read_io|process_new_packets"),
    ("HTTP: hyper, axum, tower", r"hyper::|axum::|tower::|hyper_util::"),
    ("tokio's scheduler: polling, parking, waking", r"tokio::runtime"),
]
TIERS = [STAGES[:-2], STAGES[-2:-1], STAGES[-1:]]
LIBS = [
    ("TLS: ring", r"^ring|ring_core|aes_|gcm_|sha\d|chacha"),
    ("TLS: rustls", r"rustls"),
    ("HTTP: hyper, axum, tower, http", r"hyper|axum|tower|httparse|\bhttp::|h2::|bytes::"),
    ("JSON: serde_json", r"serde_json|serde::|serde_core"),
    ("caches: moka", r"moka|crossbeam|quanta|tagptr|triomphe"),
    ("logging: tracing", r"tracing"),
    ("metrics: prometheus-client", r"prometheus"),
    ("runtime: tokio", r"tokio|mio::"),
    ("hashing and maps", r"hashbrown|sip::|core::hash|indexmap|btree"),
    ("formatting: core::fmt", r"core::fmt|alloc::fmt"),
    ("pinswap", r"pinswap"),
]
def lib(sym, dso):
    if dso.startswith("[kernel"):
        return "kernel"
    # glibc's own frames may come as inlined ones in the caller's file.
    if re.search(r"^(__GI___libc_)?(malloc|free|realloc|calloc|cfree)|^_int_|tcache|consolidate|"
                 r"unlink_chunk|__rdl_|__rust_(alloc|dealloc|realloc|no_alloc)|finish_grow|reserve", sym):
        return "allocation: glibc malloc, free, Vec growth"
    if re.search(r"^__mem(cpy|move|set|cmp)", sym):
        return "glibc memcpy, memmove"
    if "libc" in dso or "vdso" in dso or sym.startswith("__GI_"):
        return "glibc, other (clock_gettime, ...)"
    return next((name for name, pat in LIBS if re.search(pat, sym)), "other")
def samples(path):
    frames = None
    for line in gzip.open(path, "rt", errors="replace"):
        if not line.strip():
            if frames:
                yield frames
            frames = None
        elif not line[0].isspace():
            frames = []
        elif frames is not None:
            m = re.match(r"\s*[0-9a-f]+\s+(.*?)(?:\+0x[0-9a-f]+)?\s+\((.*)\)\s*$", line)
            if m:
                frames.append((m.group(1), m.group(2)))
    if frames:
        yield frames
cost, seen = {}, {}
for n, run in sorted(runs.items()):
    stage, libs, total = {}, {}, 0
    for frames in samples(f"{out}/profile-{n}.txt.gz"):
        total += 1
        s = next((name for tier in TIERS for sym, _ in frames for name, pat in tier
                  if re.search(pat, sym)), None)
        if s is None:
            s = "kernel, no user frame (interrupts, scheduling)" if frames[0][1].startswith("[kernel") else "other"
        stage[s] = stage.get(s, 0) + 1
        # An inlined function's frame names no file: the file is the next one's.
        l = lib(frames[0][0], next((d for _, d in frames if d != "inlined"), ""))
        libs[l] = libs.get(l, 0) + 1
    if not total:
        sys.exit(f"perf recorded no samples of the {n}-container run")
    if not any(k.startswith("kernel") for k in libs):
        print(f"Note: no kernel samples at {n} container(s); perf could not see the kernel "
              "(kernel.perf_event_paranoid), so its time is missing below.\n")
    seen[n] = total
    per = run["cpu_us"] / total
    cost[n] = ({k: v * per for k, v in stage.items()}, {k: v * per for k, v in libs.items()}, run["cpu_us"])
lo, hi = min(cost), max(cost)
print(f"CPU per review of the cached instance under `-c {conc}` (perf -F 499 with DWARF stacks: "
      f"{seen[lo]:,} and {seen[hi]:,} samples over {runs[lo]['ok']:,} and {runs[hi]['ok']:,} reviews). "
      f"The CPU is what the process used while perf recorded. "
      f"Fixed: the {lo}-container figure less the per-container slope.")
for title, i in (("stage of the review (the innermost named on the stack)", 0), ("library of the sampled function", 1)):
    print(f"\nBy {title}:\n\n| part | {lo} container µs | {hi} containers µs | per container µs | fixed µs |\n|---|---|---|---|---|")
    a, b = cost[lo][i], cost[hi][i]
    slope = {k: (b.get(k, 0) - a.get(k, 0)) / (hi - lo) for k in set(a) | set(b)}
    for k in sorted(slope, key=lambda k: -(a.get(k, 0) - slope[k] * lo)):
        print(f"| {k} | {a.get(k, 0):.1f} | {b.get(k, 0):.1f} | {slope[k]:.2f} | {a.get(k, 0) - slope[k] * lo:.1f} |")
    t = (cost[hi][2] - cost[lo][2]) / (hi - lo)
    print(f"| **total** | {cost[lo][2]:.1f} | {cost[hi][2]:.1f} | {t:.2f} | {cost[lo][2] - t * lo:.1f} |")
PY
  cat "$OUT/bench-admission-profile.md"
  printf '\n%s\n' "$(cat "$OUT/bench-admission-profile.md")" >>"$OUT/bench-admission.md"
  echo "== profiles: $OUT/perf-{1,20}.data, their stacks in $OUT/profile-{1,20}.txt.gz"
fi
