#!/usr/bin/env bash
# Builds the tools users would run instead of pinswap, for the benchmarks
# only, into target/peers/: regclient's regctl, go-containerregistry's crane
# and k8s-image-swapper's webhook, at pinned versions (the newest the Go
# module proxy serves here). pinswap never links them. The build is reused
# while this script is unchanged. Prints the peers directory; a peer that
# does not build is named on stderr with go's own error, and the others are
# still built (the benchmarks then leave it out).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v go >/dev/null || {
  echo "error: Go (1.26 or later) is needed to build the benchmark peers" >&2
  exit 1
}
declare -A PEERS=(
  [regctl]=github.com/regclient/regclient/cmd/regctl@v0.11.7
  [crane]=github.com/google/go-containerregistry/cmd/crane@v0.22.1
  [k8s-image-swapper]=github.com/estahn/k8s-image-swapper@v1.6.3
)
out=target/peers
stamp=$out/inputs.sha256
mkdir -p "$out"
inputs=$(sha256sum <scripts/build-peers.sh | cut -d" " -f1)
all=1
for p in "${!PEERS[@]}"; do [ -x "$out/$p" ] || all=0; done
if ((all)) && [ "$(cat "$stamp" 2>/dev/null)" = "$inputs" ]; then
  echo "$out"
  exit 0
fi
start=$(date +%s)
bin=$(cd "$out" && pwd)
export GOFLAGS=-mod=mod
failed=0
# `go install pkg@version` also asks the proxy for the module's version list
# (to report deprecation), which this proxy refuses for k8s-image-swapper;
# building in the downloaded module's own directory needs only that version.
peer_build() { # name module@version
  local mod=${2%@*} ver=${2#*@} dir
  case $1 in
    k8s-image-swapper)
      dir=$(go mod download -json "$mod@$ver" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
      [ -n "$dir" ] || return 1
      # CGO_ENABLED=0, as its own release build (.goreleaser.yml): with cgo,
      # containers/storage needs the btrfs headers.
      (cd "$dir" && CGO_ENABLED=0 go build -buildvcs=false -trimpath -ldflags "-s -w" -o "$bin/$1" .)
      ;;
    *) GOBIN="$bin" go install -buildvcs=false -ldflags "-s -w" "$2" ;;
  esac
}
for p in regctl crane k8s-image-swapper; do
  if ! peer_build "$p" "${PEERS[$p]}" 2>"$out/$p.err"; then
    echo "peer $p (${PEERS[$p]}) did not build:" >&2
    cat "$out/$p.err" >&2
    failed=1
  fi
done
((failed)) || echo "$inputs" >"$stamp"
echo "built $out in $(($(date +%s) - start)) s" >&2
echo "$out"
