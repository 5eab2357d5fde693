#!/usr/bin/env bash
# Tests the Helm chart with Helm's own engine: lint, a matrix of values
# validated with kubernetes-validate --strict for Kubernetes 1.29-1.37, the
# values schema's refusals, and equality with `pinswap manifests`
# (tests/chart/test_chart.py). No helm binary is needed: helm-python-sdk
# embeds Helm v4's Go SDK. Takes 20-30 s once the tools are installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check \
  helm-python-sdk==0.2.2 kubernetes-validate==1.37.0 pytest==9.2.0 PyYAML==6.0.3
if [ -z "${PINSWAP_BIN:-}" ]; then
  cargo build --locked --quiet
  export PINSWAP_BIN=target/debug/pinswap
fi
rc=0
python3 -m pytest -q -p no:cacheprovider tests/chart "$@" || rc=$?
# pytest's 5 means no test ran, which must not pass.
if [ "$rc" -eq 5 ]; then
  echo "error: tests/chart ran no test" >&2
  exit 1
fi
exit "$rc"
