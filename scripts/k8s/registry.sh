# An image registry for the local cluster (sourced by node.sh): Debian's docker-registry
# (distribution 2.8) on the node's address, $node_ip:$registry_port, plain HTTP, storing under
# $state/registry. The host pushes to it over the veth pair (Podman: --tls-verify=false) and
# the node's containerd pulls from it over HTTP (a hosts.toml of its own under
# $state/node/certs.d); nothing outside this machine can reach it. Its binary is taken from
# the Debian package (`apt-get download`, unpacked into the binary cache) rather than
# installed: the package would start a registry on the host and add a system user.

registry_port=5000
registry_address=$node_ip:$registry_port

# registry_binary: the path of docker-registry, fetched once into the cache.
registry_binary() {
  local installed
  installed=$(command -v docker-registry 2>/dev/null) && {
    echo "$installed"
    return
  }
  local cache=${ORCHARD_K8S_CACHE:-/var/cache/orchard/k8s}/docker-registry
  if [[ ! -x $cache/docker-registry ]]; then
    local tmp
    tmp=$(mktemp -d)
    (cd "$tmp" && { apt-get download -q docker-registry ||
      { apt-get update -qq && apt-get download -q docker-registry; }; }) >&2
    dpkg-deb -x "$tmp"/docker-registry_*.deb "$tmp/root"
    mkdir -p "$cache"
    mv "$tmp/root/usr/bin/docker-registry" "$cache/docker-registry"
    rm -rf "$tmp"
  fi
  echo "$cache/docker-registry"
}

# registry_hosts DIR: containerd's hosts configuration (config_path) for the registry.
registry_hosts() {
  mkdir -p "$1/$registry_address"
  cat >"$1/$registry_address/hosts.toml" <<HOSTS
server = "http://$registry_address"
[host."http://$registry_address"]
  capabilities = ["pull", "resolve"]
HOSTS
}

start_registry() {
  local n=$state/node
  mkdir -p "$state/registry"
  cat >"$n/registry.yml" <<CONFIG
version: 0.1
log: {level: warn}
storage:
  filesystem: {rootdirectory: $state/registry}
  delete: {enabled: true}
http:
  addr: $registry_address
  secret: $(openssl rand -hex 16)
CONFIG
  start_binary docker-registry "$(registry_binary)" serve "$n/registry.yml"
  wait_for docker-registry 30 curl -sf "http://$registry_address/v2/"
}
