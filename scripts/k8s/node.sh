# The local cluster's real node (sourced by up.sh unless ORCHARD_K8S_NODE=0): Debian's
# containerd (CRI, runc, cgroupfs) and the CNI bridge plugin, the kubelet and kube-proxy built
# by ensure-bins.sh and the NetworkPolicy enforcer (netpol.sh), in the cluster's network
# namespace. kube-proxy (iptables mode) makes ClusterIP Services work there: a pod reaches
# the API server at the kubernetes Service's address ($api_service_ip:443), as an in-cluster
# orchestrator does. An image registry (registry.sh) serves the node's address over HTTP. Pods get 10.244.0.0/24 on bridge cni0
# inside that namespace; the host routes that range over the veth pair, so a process on the
# host (an orchestrator under test) reaches pod addresses. containerd keeps the pods' network
# namespaces under its state directory, not in /run/netns. The node is labelled
# workload=sandbox (what Orchard's sandbox pods select) and tainted
# orchard.local/real-node:NoSchedule, so only pods that tolerate it run there (the kube_real
# tier's stand-in node takes the others): e.g. those of RuntimeClass orchard-local-node
# (Orchard's runtime_class setting).
#
# Host facts this needs (kernel 6.18, cgroup v1 hybrid, no CAP_SYS_RESOURCE for root):
# failCgroupV1: false (1.35 refuses cgroup v1 by default) and containerd's
# restrict_oom_score_adj (runc cannot set the pause container's -998 without
# CAP_SYS_RESOURCE: "can't get final child's PID from pipe: EOF"). The kubelet sets
# vm.overcommit_memory=1, kernel.panic=10 and kernel.panic_on_oops=1; their values before are
# kept in run/sysctl and down.sh restores them.

source "$here/netpol.sh"
source "$here/registry.sh"

node_name=orchard-node
runtime_class=orchard-local-node
containerd_run=/run/orchard-k8s-containerd
proxy_health_port=10256

start_node() {
  local missing=()
  command -v containerd >/dev/null || missing+=(containerd)
  [[ -x /usr/lib/cni/bridge ]] || missing+=(containernetworking-plugins)
  command -v catatonit >/dev/null || missing+=(catatonit)
  command -v conntrack >/dev/null || missing+=(conntrack)
  if ((${#missing[@]})); then
    apt-get install -y --no-install-recommends "${missing[@]}" >&2
  fi
  "$here/ensure-bins.sh" all >/dev/null
  local n=$state/node
  mkdir -p "$n/cni" "$n/containerd" "$n/kubelet" "$n/logs"
  [[ -f $state/run/sysctl ]] ||
    sysctl -n vm.overcommit_memory kernel.panic kernel.panic_on_oops >"$state/run/sysctl"
  cert node "/O=system:nodes/CN=system:node:$node_name"
  kubeconfig node
  cat >"$n/containerd.toml" <<EOF
version = 2
root = "$n/containerd/root"
state = "$containerd_run"
[grpc]
  address = "$containerd_run/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/orchard/pause:1"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$n/cni"
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "$n/certs.d"
EOF
  registry_hosts "$n/certs.d"
  cat >"$n/cni/10-orchard.conflist" <<EOF
{"cniVersion": "0.4.0", "name": "orchard", "plugins": [
  {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$pod_cidr"}]],
            "dataDir": "$n/cni-ipam", "routes": [{"dst": "0.0.0.0/0"}]}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
EOF
  ip route replace "$pod_cidr" via "$node_ip" dev "$host_if"
  start_binary containerd "$(command -v containerd)" --config "$n/containerd.toml"
  wait_for containerd 30 test -S "$containerd_run/containerd.sock"
  python3 "$here/pause-image.py" "$n/pause.tar"
  ctr --address "$containerd_run/containerd.sock" -n k8s.io images import "$n/pause.tar" >/dev/null
  start_registry
  cat >"$n/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://$containerd_run/containerd.sock
authentication:
  x509: {clientCAFile: $pki/ca.crt}
  webhook: {enabled: true}
  anonymous: {enabled: false}
authorization: {mode: Webhook}
failSwapOn: false
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
podLogsDir: $n/logs
podPidsLimit: 4096
# The kubelet (1.35: KEP-2535, beta) otherwise treats an image it has once pulled from a
# registry as no longer preloaded: the same image imported under another name then fails
# with ErrImageNeverPull. The test cluster has no pull secrets to protect.
imagePullCredentialsVerificationPolicy: NeverVerify
clusterDNS: [10.96.0.10]
clusterDomain: cluster.local
registerWithTaints:
- {key: orchard.local/real-node, effect: NoSchedule}
EOF
  start_binary kubelet "$bin/kubelet" --config "$n/kubelet.yaml" \
    --kubeconfig "$state/node.kubeconfig" --root-dir "$n/kubelet" \
    --hostname-override "$node_name" --node-ip "$node_ip" --node-labels workload=sandbox
  wait_for kubelet 90 node_ready
  local kubectl=("$bin/kubectl" --kubeconfig "$state/admin.kubeconfig")
  # Admission taints a new node not-ready; the node lifecycle controller, which lifts the
  # taint once the node is Ready, is off (up.sh).
  "${kubectl[@]}" taint nodes "$node_name" node.kubernetes.io/not-ready:NoSchedule- \
    >/dev/null 2>&1 || true
  # Pods of this RuntimeClass (containerd's runc handler) are sent to this node: the
  # RuntimeClass admission plugin adds its node selector and toleration to them.
  "${kubectl[@]}" apply -f - >/dev/null <<EOF
apiVersion: node.k8s.io/v1
kind: RuntimeClass
metadata: {name: $runtime_class}
handler: runc
scheduling:
  nodeSelector: {kubernetes.io/hostname: $node_name}
  tolerations: [{key: orchard.local/real-node, operator: Exists, effect: NoSchedule}]
EOF
  start_netpol
  start_proxy
}

# kube-proxy in iptables mode (the kernel has no IPVS), configured here: the pod range as the
# cluster's (traffic from elsewhere to a Service is masqueraded), NodePorts on the node's
# address only (no route_localnet), the conntrack sysctls left as they are (0 = unchanged).
start_proxy() {
  local n=$state/node
  cert kube-proxy "/CN=system:kube-proxy" # bound to system:node-proxier by default RBAC
  kubeconfig kube-proxy
  cat >"$n/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clientConnection: {kubeconfig: $state/kube-proxy.kubeconfig}
hostnameOverride: $node_name
clusterCIDR: $pod_cidr
healthzBindAddress: 127.0.0.1:$proxy_health_port
metricsBindAddress: 127.0.0.1:10249
nodePortAddresses: [$node_ip/32]
iptables: {localhostNodePorts: false}
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
EOF
  start kube-proxy --config "$n/kube-proxy.yaml"
  wait_for kube-proxy 60 nsenter --net="/run/netns/$netns" -- \
    curl -sf "http://127.0.0.1:$proxy_health_port/healthz"
}

node_ready() {
  api "/api/v1/nodes/$node_name" | python3 -c 'import json, sys
conditions = json.load(sys.stdin)["status"].get("conditions") or []
sys.exit(not any(c["type"] == "Ready" and c["status"] == "True" for c in conditions))'
}

# stop_node: the pods first (the kubelet stops their containers and CNI takes their network
# namespaces down), then the kubelet and containerd; then what they leave: mounts, the
# kubepods cgroups, and the sysctls the kubelet changed.
stop_node() {
  local ctr_=(ctr --address "$containerd_run/containerd.sock" -n k8s.io) id
  if pid_alive kubelet && pid_alive kube-apiserver; then
    "$(cat "$state/run/bin")/kubectl" --kubeconfig "$state/admin.kubeconfig" delete pods -A \
      --field-selector "spec.nodeName=$node_name" --grace-period 0 --force >/dev/null 2>&1 || true
    for _ in $(seq 120); do
      [[ -z $("${ctr_[@]}" tasks ls -q 2>/dev/null) ]] && break
      sleep 0.5
    done
  fi
  stop_process kube-proxy
  stop_process docker-registry
  stop_process kube-router
  stop_process kubelet
  if pid_alive containerd; then
    for id in $("${ctr_[@]}" tasks ls -q 2>/dev/null); do
      "${ctr_[@]}" tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true
      "${ctr_[@]}" tasks delete -f "$id" >/dev/null 2>&1 || true
    done
  fi
  stop_process containerd
  local mount
  for mount in $(findmnt -rn -o TARGET | grep -E "^($state/node|$containerd_run)" | sort -r); do
    umount -l "$mount" 2>/dev/null || true
  done
  find /sys/fs/cgroup/*/kubepods -depth -type d -exec rmdir {} + 2>/dev/null || true
  if [[ -f $state/run/sysctl ]]; then
    local values
    mapfile -t values <"$state/run/sysctl"
    sysctl -q vm.overcommit_memory="${values[0]}" kernel.panic="${values[1]}" \
      kernel.panic_on_oops="${values[2]}"
  fi
  rm -rf "$containerd_run"
}
