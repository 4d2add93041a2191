# NetworkPolicy on the local cluster's node (sourced by node.sh): kube-router, built by
# ensure-bins.sh from tools/kube-router, in firewall mode only (iptables + ipset in the
# cluster's network namespace; no routing, no service proxy). kube-router v2.1.0 is the only
# version the Go module proxy serves, and security flaws are reported for it: it runs here
# only in that namespace, which has no route off this machine.
#
# Traffic from the node itself (the kubelet's probes) always reaches its pods; traffic from
# the host (10.200.0.1, e.g. an orchestrator under test) is subject to the policies like any
# other source outside the cluster.

netpol_health_port=20244

start_netpol() {
  command -v ipset >/dev/null || apt-get install -y --no-install-recommends ipset >&2
  cert kube-router "/CN=orchard:kube-router"
  kubeconfig kube-router
  # What kube-router's informers read (it syncs them all before it starts).
  "${kubectl[@]}" apply -f - >/dev/null <<EOF
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "orchard:kube-router"}
rules:
- apiGroups: [""]
  resources: [pods, namespaces, nodes, services, endpoints]
  verbs: [get, list, watch]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "orchard:kube-router"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "orchard:kube-router"}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: "orchard:kube-router"}]
EOF
  start kube-router --kubeconfig "$state/kube-router.kubeconfig" \
    --hostname-override "$node_name" --run-firewall=true --run-router=false \
    --run-service-proxy=false --service-cluster-ip-range "$service_cidr" \
    --health-port "$netpol_health_port"
  wait_for kube-router 60 nsenter --net="/run/netns/$netns" -- \
    curl -sf "http://127.0.0.1:$netpol_health_port/healthz"
}
