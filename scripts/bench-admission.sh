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
# Cached pinswap uses the default caches (ttl 1h, resolutionTtl 30s).
# With BASELINE_BIN (another pinswap build, e.g. the last release), a fourth
# instance of it with the cached config joins the 'max' rounds, so that a
# change is measured against its baseline in the same run.
#
# usage: scripts/bench-admission.sh [--quick]     (--quick: 3 s per case, 1 round)
# env: PINSWAP_BIN, CEILING_BIN (skip the cargo builds), BASELINE_BIN, BENCH_DURATION,
#      BENCH_CONC, BENCH_ROUNDS; PINSWAP_LOG (pinswap's log level; default info,
#      one line per admission, to a file)
# Results: target/bench/bench-admission.md (and .json)
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${BENCH_DURATION:-10s}
CONC=${BENCH_CONC:-50}
ROUNDS=${BENCH_ROUNDS:-2}
if [ "${1:-}" = --quick ]; then DURATION=3s ROUNDS=1; fi

# shellcheck source=scripts/lib.sh
source scripts/lib.sh # (the working directory is the repo root)
ensure_tools hey:hey docker-registry:docker-registry openssl:openssl curl:curl python3:python3

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
    for log in "$WORK"/{cached,uncached,stalled,baseline,ceiling}.log; do
      [ -s "$log" ] && { echo "== $(basename "$log") (last lines)" >&2; tail -n 5 "$log" | cut -c1-300 >&2; }
    done
  fi
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do kill "${PIDS[i]}" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT


start_pinswap() { # NAME CONFIG VAR_HOOK VAR_HEALTH [BINARY]
  local hook health
  hook=127.0.0.1:$(free_port) health=127.0.0.1:$(free_port)
  ${5:-$PINSWAP} serve --config "$2" --tls-cert "$WORK/tls.crt" --tls-key "$WORK/tls.key" \
    --listen "$hook" --health-listen "$health" >"$WORK/$1.log" 2>&1 &
  PIDS+=($!)
  wait_for "http://$health/readyz" $! "pinswap ($1)"
  printf -v "$3" '%s' "$hook"
  printf -v "$4" '%s' "$health"
}

start_registry source SRC
SRC_PID=${PIDS[-1]}
start_registry target DST
echo "== registries: source $SRC, target $DST"
$PINSWAP copy oci:examples/oci/hello:v1 "docker://$SRC/library/hello:v1" >/dev/null
$PINSWAP copy oci:examples/oci/web:1.0 "docker://$SRC/acme/web:1.0" >/dev/null
$PINSWAP copy oci:examples/oci/spin:hello "docker://$SRC/spin/hello:v1" >/dev/null
printf '%s\n' "$SRC/library/hello:v1" "$SRC/acme/web:1.0" "$SRC/spin/hello:v1" >"$WORK/images.txt"
$PINSWAP copy --from-file "$WORK/images.txt" --to "docker://$DST/mirror" >/dev/null
echo "== seeded 3 images and mirrored them to $DST/mirror"

make_certs "pinswap bench"

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
start_pinswap uncached "$WORK/uncached.yaml" HOOK_U HEALTH_U
start_pinswap stalled "$WORK/stalled.yaml" HOOK_S HEALTH_S
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

mutate() { # HOOK OUT: one request; fails unless all 3 containers are rewritten
  curl -fsS --cacert "$WORK/ca.crt" -H 'Content-Type: application/json' \
    --data-binary @"$WORK/review.json" "https://$1/mutate" -o "$2"
  python3 - "$2" "$DST/mirror/" <<'PY'
import base64, json, sys
resp = json.load(open(sys.argv[1]))["response"]
patch = resp.get("patch") or []
ops = json.loads(bytes(patch) if isinstance(patch, list) else base64.b64decode(patch))
images = [o["value"] for o in ops if o["path"].endswith("/image")]
if len(images) != 3 or not all(i.startswith(sys.argv[2]) and "@sha256:" in i for i in images):
    sys.exit(f"expected 3 rewritten images, got {images} in {resp}")
PY
}
echo "== warm-up: 20 requests to each pinswap; every container must be rewritten"
for _ in $(seq 20); do
  mutate "$HOOK" "$WORK/response.json"
  mutate "$HOOK_U" "$WORK/response-u.json"
  mutate "$HOOK_S" "$WORK/response-s.json"
  if [ -n "$HOOK_B" ]; then mutate "$HOOK_B" "$WORK/response-b.json"; fi
done

CEIL=127.0.0.1:$(free_port)
"$CEILING" --listen "$CEIL" --cert "$WORK/tls.crt" --key "$WORK/tls.key" \
  --body "$WORK/response.json" >"$WORK/ceiling.log" 2>&1 &
PIDS+=($!)
wait_for "https://$CEIL/mutate" $! ceiling --cacert "$WORK/ca.crt" --data-binary @"$WORK/review.json"
echo "== ceiling on $CEIL answers with pinswap's response ($(wc -c <"$WORK/response.json") bytes)"

metric() { # HEALTH NAME_AND_LABELS: a counter's value
  curl -fsS "http://$1/metrics" | awk -v m="$2" '$1 == m {print $2; f=1} END {if (!f) print 0}'
}

RESULTS=$WORK/results.jsonl
run() { # CASE WHO HOOK HEY-ARGS...: one hey run, parsed into a JSON line
  local case=$1 who=$2 hook=$3
  shift 3
  printf '   %-9s %-17s hey -z %s %s ... ' "$case" "$who" "$DURATION" "$*"
  # -host: hey sends its Host value ("127.0.0.1:PORT") as the TLS SNI, which
  # rustls rejects (illegal_parameter); "localhost" is a valid SNI name.
  hey -z "$DURATION" "$@" -host localhost -m POST -T application/json -D "$WORK/review.json" \
    "https://$hook/mutate" >"$WORK/hey.txt"
  python3 - "$WORK/hey.txt" "$RESULTS" "$case" "$who" "$*" <<'PY'
import json, re, sys
text, results, case, who, args = open(sys.argv[1]).read(), *sys.argv[2:]
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
     "ok": ok, "bad": bad}
with open(results, "a") as f:
    f.write(json.dumps(r) + "\n")
print(f"{r['rps']:8.0f} req/s  p50 {r['p50']:.1f} ms  p99 {r['p99']:.1f} ms  ({ok} ok, {bad} failed)")
PY
}

echo "== load ($(nproc) CPUs; hey runs on the same machine)"
hits0=$(metric "$HEALTH" 'pinswap_cache_hits_total{cache="resolution"}')
miss0=$(metric "$HEALTH" 'pinswap_cache_misses_total{cache="resolution"}')
for _ in $(seq "$ROUNDS"); do
  run max ceiling "$CEIL" -c "$CONC"
  run max pinswap-cached "$HOOK" -c "$CONC"
  if [ -n "$HOOK_B" ]; then run max baseline-cached "$HOOK_B" -c "$CONC"; fi
done
run 1000/s ceiling "$CEIL" -c 10 -q 100
run 1000/s pinswap-cached "$HOOK" -c 10 -q 100
hits1=$(metric "$HEALTH" 'pinswap_cache_hits_total{cache="resolution"}')
miss1=$(metric "$HEALTH" 'pinswap_cache_misses_total{cache="resolution"}')
umiss0=$(metric "$HEALTH_U" 'pinswap_cache_misses_total{cache="resolution"}')
run 10/s pinswap-uncached "$HOOK_U" -c 1 -q 10
run 100/s pinswap-uncached "$HOOK_U" -c 10 -q 10
run max pinswap-uncached "$HOOK_U" -c "$CONC"
umiss1=$(metric "$HEALTH_U" 'pinswap_cache_misses_total{cache="resolution"}')
uhits=$(metric "$HEALTH_U" 'pinswap_cache_hits_total{cache="resolution"}')
echo "== the source registry stalls (SIGSTOP $SRC_PID)"
kill -STOP "$SRC_PID"
sleep 1.5 # the stalled instance's resolutionTtl (1s) expires
# Until the breaker opens, each admission waits up to source.timeout (1s).
for _ in $(seq 5); do mutate "$HOOK_S" "$WORK/response-s.json"; done
run 100/s pinswap-stalled "$HOOK_S" -c 10 -q 10
sfail=$(curl -fsS "http://$HEALTH_S/metrics" | grep -c '^pinswap_source_breaker_open.* 1$' || true)
echo "   breakers open on the stalled instance: $sfail"
kill -CONT "$SRC_PID"

python3 - "$RESULTS" "$OUT/bench-admission.md" "$OUT/bench-admission.json" \
  "$DURATION" "$CONC" "$ROUNDS" "$((hits1 - hits0))" "$((miss1 - miss0))" "$((umiss1 - umiss0))" "$uhits" \
  "$(nproc)" "$(awk '{print $1, $2, $3}' /proc/loadavg)" "$(date -u +%F)" <<'PY'
import json, statistics as st, sys
src, md, js, duration, conc, rounds, hits, misses, umisses, uhits, cpus, load, day = sys.argv[1:]
rows = [json.loads(l) for l in open(src)]
def agg(case, who):
    rs = [r for r in rows if r["case"] == case and r["who"] == who]
    return {k: st.mean(r[k] for r in rs) for k in ("rps", "p50", "p99")} | {
        "ok": sum(r["ok"] for r in rs), "bad": sum(r["bad"] for r in rs), "args": rs[0]["args"], "runs": len(rs)}
cases = [("max", "ceiling"), ("max", "pinswap-cached"), ("1000/s", "ceiling"),
         ("1000/s", "pinswap-cached"), ("10/s", "pinswap-uncached"), ("100/s", "pinswap-uncached"),
         ("max", "pinswap-uncached"), ("100/s", "pinswap-stalled")]
if any(r["who"] == "baseline-cached" for r in rows):
    cases.insert(2, ("max", "baseline-cached"))
res = {f"{w} {c}": agg(c, w) for c, w in cases}
ratio = res["pinswap-cached max"]["rps"] / res["ceiling max"]["rps"]
lines = [
    f"Admission benchmark ({day}; {cpus} CPUs, load average before: {load}; hey {duration} per run, "
    f"keep-alive, HTTP/1.1; 'max' = -c {conc} unthrottled, mean of {rounds} alternating round(s)).",
    "",
    "| server | load (hey) | req/s | p50 ms | p99 ms | failed |",
    "|---|---|---|---|---|---|",
]
for c, w in cases:
    r = res[f"{w} {c}"]
    label = {"max": f"max, `-c {conc}`", "1000/s": "1,000 req/s, `-c 10 -q 100`",
             "10/s": "10 req/s, `-c 1 -q 10`", "100/s": "100 req/s, `-c 10 -q 10`"}[c]
    lines.append(f"| {w} | {label} | {r['rps']:,.0f} | {r['p50']:.1f} | {r['p99']:.1f} | {r['bad']} |")
fail = sum(r["bad"] for r in res.values())
p99_1000 = res["pinswap-cached 1000/s"]["p99"]
p99_u10 = res["pinswap-uncached 10/s"]["p99"]
p99_u100 = res["pinswap-uncached 100/s"]["p99"]
p99_s100 = res["pinswap-stalled 100/s"]["p99"]
verdict = lambda ok: "met" if ok else "missed"
lines += [
    "",
    f"pinswap/ceiling throughput: {ratio:.2f}×"
    + (f"; pinswap/baseline: {res['pinswap-cached max']['rps'] / res['baseline-cached max']['rps']:.2f}×"
       if "baseline-cached max" in res else "")
    + ". Resolution cache during the cached runs: "
    f"{hits} hits, {misses} misses; uncached instance: {umisses} misses, {uhits} hits.",
    "",
    "| target | result |",
    "|---|---|",
    f"| cached throughput ≥ 0.7× ceiling | {verdict(ratio >= 0.7)}, {ratio:.2f}× |",
    f"| cached p99 ≤ 5 ms at 1,000 req/s | {verdict(p99_1000 <= 5)}, {p99_1000:.1f} ms |",
    f"| uncached p99 ≤ 15 ms, 10 req/s | {verdict(p99_u10 <= 15)}, {p99_u10:.1f} ms |",
    f"| uncached p99 ≤ 25 ms, 100 req/s | {verdict(p99_u100 <= 25)}, {p99_u100:.1f} ms |",
    f"| source stalled, images at the target: p99 ≤ 5 ms, 100 req/s | {verdict(p99_s100 <= 5)}, {p99_s100:.1f} ms |",
]
text = "\n".join(lines) + "\n"
open(md, "w").write(text)
json.dump({"results": res, "ratio": ratio}, open(js, "w"), indent=2)
print(text)
if fail:
    sys.exit(f"{fail} requests failed")
PY
echo "== written to target/bench/bench-admission.md"
