#!/usr/bin/env bash
# Stop the local cluster scripts/k8s/up.sh started and remove what it made: its processes
# (by their pid files; a node's pods first, then its mounts, cgroups and sysctls), the
# network namespaces and their veth pairs, and its state directory (PKI, kubeconfigs, etcd
# data, logs). Safe to run when nothing is up. `make cluster-down`.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
source "$here/common.sh"

if [[ -d $state/node ]]; then
  source "$here/node.sh"
  stop_node
fi
for ((i = ${#components[@]} - 1; i >= 0; i--)); do
  stop_process "${components[$i]}"
done

for ns in "$internet_netns" "$netns"; do
  if [[ -e /run/netns/$ns ]]; then
    ip netns delete "$ns" # takes its veth pairs with it
  fi
done
if ip link show "$host_if" >/dev/null 2>&1; then
  ip link delete "$host_if"
fi
case "$state" in
  /var/lib/orchard/*) rm -rf "$state" ;;
  *) echo "down.sh: left $state in place (not under /var/lib/orchard)" >&2 ;;
esac
echo "down.sh: local cluster stopped" >&2
