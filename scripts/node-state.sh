#!/usr/bin/env bash
# Prints what the cluster suite's node may change on this machine, so a run
# can be compared with the state before it: the sysctls the kubelet and CNI
# set, the kubelet's and containerd's fixed paths, the control plane's
# memory-backed directories, the node's bridge, its
# mounts and processes, and iptables chains. scripts/test.sh and
# scripts/test-cluster.sh fail when a run leaves anything different.
#
#   scripts/node-state.sh                  # the state now
#   scripts/node-state.sh --after BEFORE   # wait for the harnesses to end, compare
set -uo pipefail
if [ "${1:-}" = --after ]; then
  # A harness cleans up after its test process exits: wait for it and for
  # what it started (their command lines name its directory).
  for _ in $(seq 120); do
    pgrep -f 'pinswap-cluster' >/dev/null || break
    sleep 0.5
  done
  after=$("$0")
  if [ "$after" != "$2" ]; then
    echo "error: the node left this machine changed:" >&2
    diff <(echo "$2") <(echo "$after") >&2
    exit 1
  fi
  exit 0
fi
for key in kernel.panic kernel.panic_on_oops vm.overcommit_memory net.ipv4.ip_forward net.ipv4.conf.all.forwarding; do
  echo "sysctl $key=$(sysctl -n "$key" 2>/dev/null)"
done
for p in /var/lib/kubelet /var/log/containers /var/log/pods /run/containerd /var/lib/cni /etc/cni/net.d /opt/cni /run/pinswap-node.json; do
  if [ -e "$p" ]; then echo "path $p: $(ls -A "$p" 2>/dev/null | LC_ALL=C sort | tr '\n' ' ')"; else echo "path $p: absent"; fi
done
# etcd and the audit log live in memory (tests/cluster writesDir).
echo "memory dirs: $(ls -d /dev/shm/pinswap-cluster-* 2>/dev/null | wc -l)"
echo "bridge: $(ip -br link show pinswap0 2>/dev/null || echo absent)"
echo "mounts: $(grep -c -e pinswap-cluster -e /var/lib/kubelet /proc/self/mountinfo)"
echo "processes: $(pgrep -c -f 'pinswap-cluster|containerd-shim' || true)"
if command -v iptables-save >/dev/null; then
  echo "iptables chains: $(iptables-save 2>/dev/null | grep -c '^:' || true)"
fi
