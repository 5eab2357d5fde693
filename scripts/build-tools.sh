#!/usr/bin/env bash
# Builds the signing and artifact clients tests/referrers.rs drives, into
# target/tools/: cosign and oras at pinned versions, and a registry that
# implements the OCI 1.1 referrers API (tests/tools/referrers-registry, on
# go-containerregistry's registry package; Distribution 2.8 answers that API
# with 404), Distribution v3 (the `registry` command, run by the registry
# matrix in tests/registries.rs next to Debian's 2.8), and registries-conf (tests/tools/registries-conf), which prints
# the [[registry]] CRI-O takes for an image from a registries.conf and its
# drop-ins, through containers/image's own sysregistriesv2 (tests/nodeconfig.rs).
# pinswap never links them. Modules come through the Go module
# proxy; the build is reused while this script and the registry's sources
# are unchanged. Prints the tools directory.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v go >/dev/null || {
  echo "error: Go (1.26 or later) is needed to build the test tools" >&2
  exit 1
}
cosign=github.com/sigstore/cosign/v3/cmd/cosign@v3.1.3
oras=oras.land/oras/cmd/oras@v1.3.6
distribution3=github.com/distribution/distribution/v3/cmd/registry@v3.1.2
out=target/tools
stamp=$out/inputs.sha256
mkdir -p "$out"
inputs=$(cat scripts/build-tools.sh tests/tools/*/go.mod tests/tools/*/go.sum tests/tools/*/*.go | sha256sum | cut -d" " -f1)
if [ -x "$out/cosign" ] && [ -x "$out/oras" ] && [ -x "$out/referrers-registry" ] &&
  [ -x "$out/registries-conf" ] && [ -x "$out/distribution3" ] &&
  [ "$(cat "$stamp" 2>/dev/null)" = "$inputs" ]; then
  echo "$out"
  exit 0
fi
start=$(date +%s)
bin=$(cd "$out" && pwd)
export GOFLAGS=-mod=mod
GOBIN="$bin" go install -buildvcs=false -ldflags "-s -w" "$cosign"
GOBIN="$bin" go install -buildvcs=false -ldflags "-s -w" "$oras"
# Installed as `registry`; renamed so that no other registry is mistaken for it.
d3=$(mktemp -d)
GOBIN="$d3" go install -buildvcs=false -ldflags "-s -w" "$distribution3"
mv "$d3/registry" "$bin/distribution3"
rmdir "$d3"
(cd tests/tools/referrers-registry && go build -buildvcs=false -ldflags "-s -w" -o "$bin/referrers-registry" .)
# Only sysregistriesv2 is linked: no cgo, no gpgme.
(cd tests/tools/registries-conf && CGO_ENABLED=0 go build -buildvcs=false -ldflags "-s -w" -o "$bin/registries-conf" .)
echo "$inputs" >"$stamp"
echo "built $out (cosign, oras, distribution3, referrers-registry, registries-conf) in $(($(date +%s) - start)) s" >&2
echo "$out"
