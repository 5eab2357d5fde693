#!/usr/bin/env bash
# The test command (README): unit tests and integration tests against real
# Distribution registries and skopeo, which must be installed (see .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
for tool in docker-registry skopeo; do
  command -v "$tool" >/dev/null || {
    echo "error: $tool is not installed; run: sudo apt-get install -y docker-registry skopeo" >&2
    exit 1
  }
done
exec cargo test --locked "$@"
