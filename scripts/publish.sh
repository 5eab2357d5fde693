#!/usr/bin/env bash
# Publishes pinswap to a registry you own, in one command: its image, built
# without a container engine (scripts/build-image.sh) and pushed with
# `pinswap copy`, and its Helm chart, packaged and pushed as an OCI artifact
# with `helm`. The release workflow publishes the same two artifacts under
# the same names to GitHub's container registry.
#
#   scripts/publish.sh REGISTRY[/PREFIX]
#
# gives REGISTRY/pinswap:VERSION and oci://REGISTRY/charts/pinswap (chart
# version VERSION), VERSION being Cargo.toml's, which the chart's version
# and appVersion must equal. Install with
#   helm install pinswap oci://REGISTRY/charts/pinswap --version VERSION \
#     --set image.repository=REGISTRY/pinswap ...
#
# The binary is target/release/pinswap, built when missing (PINSWAP_BIN
# names another). Credentials: `pinswap copy` reads PINSWAP_DEST_CREDS
# (USER:PASSWORD) or the Docker config file, and `helm` its own login
# (`helm registry login HOST`). A private CA: SSL_CERT_FILE, which both
# read. Prints the image's reference with its digest and the chart's.
set -euo pipefail
root=$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)
usage="usage: $0 REGISTRY[/PREFIX]   (for example registry.example.com/platform)"
[ $# -eq 1 ] || { echo "$usage" >&2; exit 2; }
registry=${1%/}
case $registry in
"" | -* | *://* | */*:* | *@*) echo "error: REGISTRY is HOST[:PORT][/PREFIX], without a scheme, tag or digest: '$1'" >&2; exit 2 ;;
esac
die() { echo "error: $*" >&2; exit 1; }
command -v helm >/dev/null || die "helm (3.8 or later) is needed to push the chart: https://helm.sh/docs/intro/install/"

version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$root/Cargo.toml" | head -n1)
chart_version=$(sed -n 's/^version: *//p' "$root/charts/pinswap/Chart.yaml")
app_version=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$root/charts/pinswap/Chart.yaml")
[ "$chart_version" = "$version" ] && [ "$app_version" = "$version" ] ||
  die "Cargo.toml's version ($version) and the chart's version ($chart_version) and appVersion ($app_version) differ"

bin=${PINSWAP_BIN:-$root/target/release/pinswap}
if [ -z "${PINSWAP_BIN:-}" ] && [ ! -x "$bin" ]; then
  echo "building the release binary (5 to 15 minutes the first time)" >&2
  (cd "$root" && cargo build --release --locked --quiet)
fi
[ -x "$bin" ] || die "no pinswap binary at $bin"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# build-image.sh names the layout's one image after the crate's version
# and prints its manifest digest, which the copy keeps.
digest=$("$root/scripts/build-image.sh" --binary "$bin" --out "$work/layout" | tail -n1)
"$bin" copy "oci:$work/layout:$version" "docker://$registry/pinswap:$version"

helm package "$root/charts/pinswap" --destination "$work" >/dev/null
helm push "$work/pinswap-$version.tgz" "oci://$registry/charts" >/dev/null

echo "image: $registry/pinswap:$version@$digest"
echo "chart: oci://$registry/charts/pinswap --version $version"
