#!/usr/bin/env bash
# Bring up a local Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, built from the pinned Go modules by ensure-bins.sh) inside a network
# namespace of its own with no route off this machine; the host reaches the API server at
# https://10.200.0.2:6443 over one veth pair; and a real node (scripts/k8s/node.sh:
# containerd, CNI, kubelet), unless ORCHARD_K8S_NODE=0. Idempotent: components already
# running are left alone (so a second run adds the node to a control plane started without
# it). Needs root. `make cluster` runs it; scripts/k8s/down.sh undoes all of it.
#
# The last line printed is `export KUBECONFIG=<admin kubeconfig>`.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
source "$here/common.sh"
source "$here/pki.sh"

[[ $(id -u) == 0 ]] || {
  echo "up.sh: needs root (it creates a network namespace)" >&2
  exit 1
}
for tool in ip nsenter openssl curl flock; do
  command -v "$tool" >/dev/null || {
    echo "up.sh: '$tool' is missing (apt-get install iproute2 util-linux openssl curl)" >&2
    exit 1
  }
done

bin=$("$here/ensure-bins.sh" control-plane | tail -n1)
mkdir -p "$state/run" "$state/log"
echo "$bin" >"$state/run/bin"

# --- network namespace: lo and one veth to the host, no default route ------------------------
if [[ ! -e /run/netns/$netns ]]; then
  ip netns add "$netns"
fi
ip -n "$netns" link set lo up
if ! ip link show "$host_if" >/dev/null 2>&1; then
  ip link add "$host_if" type veth peer name "$node_if" netns "$netns"
  ip addr add "$host_ip/30" dev "$host_if"
  ip -n "$netns" addr add "$node_ip/30" dev "$node_if"
fi
ip link set "$host_if" up
ip -n "$netns" link set "$node_if" up

# --- a stand-in for the internet: a namespace reachable only from the cluster's -------------
# ($internet_ip, a documentation range), where tests listen to see what egress pods get.
if [[ ! -e /run/netns/$internet_netns ]]; then
  ip netns add "$internet_netns"
fi
ip -n "$internet_netns" link set lo up
if ! ip -n "$netns" link show "$inet_if" >/dev/null 2>&1; then
  ip -n "$netns" link add "$inet_if" type veth peer name "$world_if" netns "$internet_netns"
  ip -n "$netns" addr add "$inet_gw/24" dev "$inet_if"
  ip -n "$internet_netns" addr add "$internet_ip/24" dev "$world_if"
fi
ip -n "$netns" link set "$inet_if" up
ip -n "$internet_netns" link set "$world_if" up
ip -n "$internet_netns" route replace "$pod_cidr" via "$inet_gw"

make_pki

# start_binary NAME PATH ARGS...: run PATH in the namespace (in its own session, logging to
# log/NAME.log), unless NAME runs already. start NAME ARGS...: the same for a built binary.
start_binary() {
  local name=$1 path=$2
  shift 2
  pid_alive "$name" && return 0
  setsid nsenter --net="/run/netns/$netns" -- "$path" "$@" \
    </dev/null >>"$state/log/$name.log" 2>&1 &
  echo $! >"$state/run/$name.pid"
}
start() { start_binary "$1" "$bin/$1" "${@:2}"; }

# wait_for WHAT SECONDS COMMAND...: poll until COMMAND succeeds; on timeout show the logs.
wait_for() {
  local what=$1 limit=$2 deadline
  shift 2
  deadline=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS > deadline)); then
      echo "up.sh: $what not ready after ${limit}s; last log lines:" >&2
      local name
      for name in "${components[@]}"; do
        [[ -f $state/log/$name.log ]] && tail -n 15 "$state/log/$name.log" | sed "s/^/  $name: /" >&2
      done
      exit 1
    fi
    sleep 0.5
  done
}

api() {
  curl -sf --cacert "$pki/ca.crt" --cert "$pki/admin.crt" --key "$pki/admin.key" \
    "https://$node_ip:6443$1"
}

start etcd --name orchard-local --data-dir "$state/etcd" \
  --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
  --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
  --initial-cluster orchard-local=http://127.0.0.1:2380 --unsafe-no-fsync --log-level warn
wait_for etcd 30 nsenter --net="/run/netns/$netns" -- "$bin/etcdctl" \
  --endpoints http://127.0.0.1:2379 endpoint health

# The watch cache is off so that a watch from a compacted resourceVersion gets 410 Gone from
# etcd itself (the tier compacts etcd to prove the backend survives it).
start kube-apiserver --etcd-servers http://127.0.0.1:2379 \
  --bind-address 0.0.0.0 --secure-port 6443 --advertise-address "$node_ip" \
  --tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key" \
  --client-ca-file "$pki/ca.crt" \
  --kubelet-client-certificate "$pki/apiserver-kubelet-client.crt" \
  --kubelet-client-key "$pki/apiserver-kubelet-client.key" \
  --service-account-issuer https://kubernetes.default.svc.cluster.local \
  --service-account-key-file "$pki/sa.pub" --service-account-signing-key-file "$pki/sa.key" \
  --service-cluster-ip-range "$service_cidr" --kubelet-preferred-address-types InternalIP \
  --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction \
  --allow-privileged=true --watch-cache=false --profiling=false
wait_for kube-apiserver 120 api /readyz

# The node lifecycle controller is off: the tier's stand-in node is an API object without a
# kubelet heartbeat, which it would taint unreachable and evict.
start kube-controller-manager --kubeconfig "$state/controller-manager.kubeconfig" \
  --authentication-kubeconfig "$state/controller-manager.kubeconfig" \
  --authorization-kubeconfig "$state/controller-manager.kubeconfig" \
  --bind-address 127.0.0.1 --leader-elect=false --use-service-account-credentials \
  --service-account-private-key-file "$pki/sa.key" --root-ca-file "$pki/ca.crt" \
  --cluster-signing-cert-file "$pki/ca.crt" --cluster-signing-key-file "$pki/ca.key" \
  --controllers '*,-node-lifecycle-controller' --profiling=false
start kube-scheduler --kubeconfig "$state/scheduler.kubeconfig" \
  --authentication-kubeconfig "$state/scheduler.kubeconfig" \
  --authorization-kubeconfig "$state/scheduler.kubeconfig" \
  --bind-address 127.0.0.1 --leader-elect=false --profiling=false

# Ready when the controller manager has made the default ServiceAccount (it runs) and the
# scheduler answers its health check.
wait_for kube-controller-manager 90 api /api/v1/namespaces/default/serviceaccounts/default
wait_for kube-scheduler 60 nsenter --net="/run/netns/$netns" -- \
  curl -sfk https://127.0.0.1:10259/healthz

if [[ ${ORCHARD_K8S_NODE:-1} == 1 ]]; then
  source "$here/node.sh"
  start_node
fi

version=$(api /version | sed -n 's/.*"gitVersion": *"\([^"]*\)".*/\1/p')
echo "up.sh: Kubernetes $version control plane on https://$node_ip:6443 (netns $netns)" >&2
echo "export KUBECONFIG=$state/admin.kubeconfig"
