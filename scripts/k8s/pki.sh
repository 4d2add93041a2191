# PKI of the local cluster (sourced by up.sh): a CA, the API server's serving certificate,
# client certificates for the admin and the control-plane components, and the service
# account signing key, all made with openssl under $state/pki; then a kubeconfig per client.

# cert NAME SUBJECT [SAN]: a key and a certificate signed by the cluster CA.
cert() {
  local name=$1 subject=$2 san=${3:-}
  [[ -s $pki/$name.crt ]] && return 0
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$pki/$name.key" -subj "$subject" -out "$pki/$name.csr" 2>/dev/null
  local ext=$pki/$name.ext
  if [[ -n $san ]]; then
    printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$san" >"$ext"
  else
    printf 'extendedKeyUsage=clientAuth\n' >"$ext"
  fi
  openssl x509 -req -in "$pki/$name.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" \
    -CAcreateserial -days 30 -sha256 -extfile "$ext" -out "$pki/$name.crt" 2>/dev/null
  rm -f "$pki/$name.csr" "$ext"
}

# kubeconfig NAME: $state/NAME.kubeconfig authenticating with the NAME client certificate.
kubeconfig() {
  local name=$1
  local b64='base64 -w0'
  cat >"$state/$name.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: orchard-local
  cluster:
    server: https://$node_ip:6443
    certificate-authority-data: $($b64 <"$pki/ca.crt")
users:
- name: $name
  user:
    client-certificate-data: $($b64 <"$pki/$name.crt")
    client-key-data: $($b64 <"$pki/$name.key")
contexts:
- name: orchard-local
  context: {cluster: orchard-local, user: $name}
current-context: orchard-local
EOF
  chmod 600 "$state/$name.kubeconfig"
}

make_pki() {
  pki=$state/pki
  mkdir -p "$pki"
  chmod 700 "$pki"
  if [[ ! -s $pki/ca.crt ]]; then
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 30 \
      -keyout "$pki/ca.key" -subj "/CN=orchard-local-ca" -out "$pki/ca.crt" 2>/dev/null
  fi
  [[ -s $pki/sa.key ]] || {
    openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$pki/sa.key" 2>/dev/null
    openssl pkey -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null
  }
  cert apiserver "/CN=kube-apiserver" \
    "IP:$node_ip,IP:$api_service_ip,IP:127.0.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:localhost"
  cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client"
  cert admin "/O=system:masters/CN=orchard-admin"
  cert controller-manager "/CN=system:kube-controller-manager"
  cert scheduler "/CN=system:kube-scheduler"
  local name
  for name in admin controller-manager scheduler; do kubeconfig "$name"; done
}
