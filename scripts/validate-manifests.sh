#!/usr/bin/env bash
# Validates what `pinswap manifests` prints (and what deploy/ renders) against
# the Kubernetes OpenAPI schemas of every minor version we support, with
# kubernetes-validate (PyPI) in strict mode: unknown fields are errors.
# cert-manager's Issuer and Certificate have no schema there (a warning);
# tests/install.rs checks them against cert-manager's v1 fields.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSIONS=(1.29 1.30 1.31 1.32 1.33 1.34 1.35 1.36 1.37)
command -v kubernetes-validate >/dev/null || {
  echo "error: kubernetes-validate is not installed; run: pip install kubernetes-validate==1.37.0" >&2
  exit 1
}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cargo build --locked --quiet
bin=target/debug/pinswap
cat >"$out/config.yaml" <<'YAML'
target: {registry: mirror.example.com/cache}
source: {imagePullSecrets: true}
recovery: {namespaces: [apps, web]}
YAML
$bin manifests --tls cert-manager >"$out/cert-manager.yaml" 2>/dev/null
$bin manifests --tls self-signed >"$out/self-signed.yaml" 2>/dev/null
$bin manifests --tls self-signed --config "$out/config.yaml" --namespace mirror >"$out/pull-secrets.yaml"
if command -v kubectl >/dev/null; then
  for overlay in cert-manager self-signed; do
    kubectl kustomize "deploy/overlays/$overlay" >"$out/deploy-$overlay.yaml"
  done
fi
for v in "${VERSIONS[@]}"; do
  n=0
  for f in "$out"/*.yaml; do
    [ "$(basename "$f")" = config.yaml ] && continue
    kubernetes-validate --strict --quiet --no-warn -k "$v" "$f"
    n=$((n + 1))
  done
  echo "kubernetes $v: $n renderings valid"
done
