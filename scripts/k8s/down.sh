#!/usr/bin/env bash
# Stop the local cluster scripts/k8s/up.sh started and remove what it made: its processes
# (by their pid files), the network namespace and its veth pair, and its state directory
# (PKI, kubeconfigs, etcd data, logs). Safe to run when nothing is up. `make cluster-down`.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
source "$here/common.sh"

for ((i = ${#components[@]} - 1; i >= 0; i--)); do
  name=${components[$i]}
  pid_alive "$name" || continue
  pid=$(cat "$state/run/$name.pid")
  kill "$pid"
  for _ in $(seq 50); do
    [[ -d /proc/$pid ]] || break
    sleep 0.1
  done
  [[ -d /proc/$pid ]] && kill -9 "$pid"
done

if [[ -e /run/netns/$netns ]]; then
  ip netns delete "$netns" # takes the veth pair with it
fi
if ip link show "$host_if" >/dev/null 2>&1; then
  ip link delete "$host_if"
fi
case "$state" in
  /var/lib/orchard/*) rm -rf "$state" ;;
  *) echo "down.sh: left $state in place (not under /var/lib/orchard)" >&2 ;;
esac
echo "down.sh: local cluster stopped" >&2
