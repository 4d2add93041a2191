# Shared settings of scripts/k8s/up.sh and down.sh (sourced, not run).
# The cluster lives in network namespace $netns, reachable from the host only over one veth
# pair ($host_if $host_ip <-> $node_if $node_ip); the namespace has no default route, so
# nothing in it can reach beyond this machine. Its one other link ($inet_if <-> $world_if)
# leads to $internet_netns, the tests' stand-in for the internet, which routes only back. Its state (PKI, kubeconfigs, etcd data, logs,
# pid files) is under $state.

netns=${ORCHARD_K8S_NETNS:-orchard-k8s}
state=${ORCHARD_K8S_STATE:-/var/lib/orchard/k8s}
host_if=ok8s-host
node_if=ok8s-node
host_ip=10.200.0.1
node_ip=10.200.0.2
service_cidr=10.96.0.0/16
pod_cidr=10.244.0.0/24
internet_netns=$netns-internet
inet_if=ok8s-inet
world_if=ok8s-world
inet_gw=198.51.100.1
internet_ip=198.51.100.10
api_service_ip=10.96.0.1
components=(etcd kube-apiserver kube-controller-manager kube-scheduler)

# stop_process NAME: stop the component its pid file names (SIGTERM, then SIGKILL after 5 s).
stop_process() {
  pid_alive "$1" || return 0
  local pid
  pid=$(cat "$state/run/$1.pid")
  kill "$pid"
  for _ in $(seq 50); do
    [[ -d /proc/$pid ]] || return 0
    sleep 0.1
  done
  kill -9 "$pid" 2>/dev/null || true
}

# pid_alive NAME: the component's pid file names a live process started from its binary.
pid_alive() {
  local pid
  pid=$(cat "$state/run/$1.pid" 2>/dev/null) || return 1
  [[ -n $pid && -d /proc/$pid ]] && [[ $(readlink "/proc/$pid/exe" 2>/dev/null) == */"$1" ]]
}
