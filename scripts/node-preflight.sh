#!/usr/bin/env bash
# Checks that this machine can run the cluster suite's node
# (tests/cluster_node*.rs), and says exactly what is missing when it cannot:
# the node never skips silently. Needs root (mounts, a bridge, sysctls),
# runc, the CNI plugins, iproute2, Helm's engine for Python, and cgroups.
set -euo pipefail
fail() {
  echo "error: the node cannot start here: $*" >&2
  exit 1
}
[ "$(id -u)" = 0 ] || fail "it needs root (mounts, a bridge interface, sysctls)"
command -v runc >/dev/null || fail "runc is not installed (apt-get install runc)"
[ -x /usr/lib/cni/bridge ] && [ -x /usr/lib/cni/host-local ] ||
  fail "the CNI plugins are not installed (apt-get install containernetworking-plugins)"
command -v ip >/dev/null || fail "ip is not installed (apt-get install iproute2)"
[ -d /sys/fs/cgroup/memory ] || [ -f /sys/fs/cgroup/cgroup.controllers ] ||
  fail "no cgroup hierarchy at /sys/fs/cgroup"
python3 -c 'import helm_python' 2>/dev/null ||
  fail "helm-python-sdk is not installed (pip install helm-python-sdk==0.2.2), tests/chart/install.py needs it"
grep -q overlay /proc/filesystems || modprobe overlay 2>/dev/null ||
  fail "the kernel has no overlay filesystem (containerd's snapshotter)"
