#!/usr/bin/env bash
# Prepare a fresh Debian 12 machine (as root) to run Orchard's local backend and its tests:
# Podman with runc and safe default ulimits, its Docker-compatible API socket, and the tools
# that build the local test images (busybox-static, debootstrap). Idempotent: a second run
# changes nothing and only says what it found. Works without a TTY.
set -euo pipefail

SOCKET=/run/podman/podman.sock
CONF=/etc/containers/containers.conf
LOG=/var/log/orchard-podman.log
# iptables: netavark sets up the bridge network with it; curl: the socket check below;
# catatonit: the init every sandbox container runs as PID 1; python3: the interpreter the
# agent bundle is built from; python3-venv: `make install`.
# openssl, iproute2, util-linux: the local Kubernetes control plane; containerd,
# containernetworking-plugins and ipset: its node (scripts/k8s).
PACKAGES=(podman runc catatonit iptables busybox-static debootstrap curl python3 python3-venv
  openssl iproute2 util-linux containerd containernetworking-plugins ipset)

say() { printf 'setup-host: %s\n' "$*"; }
die() { printf 'setup-host: error: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "run me as root (sudo bash $0)"
command -v apt-get >/dev/null || die "this script supports Debian/Ubuntu (apt-get not found)"
export DEBIAN_FRONTEND=noninteractive

# --- packages ---------------------------------------------------------------------------------
missing=()
for pkg in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
  [ "$status" = "install ok installed" ] || missing+=("$pkg")
done
if [ ${#missing[@]} -eq 0 ]; then
  say "packages present: ${PACKAGES[*]}"
else
  say "installing: ${missing[*]}"
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# --- engine configuration ------------------------------------------------------------------------
# crun rejects hybrid cgroup layouts, and default ulimits above the hard limits make every
# container fail to start: use runc and modest ulimits.
conf_changed=no
if [ -f "$CONF" ] && grep -Eq '^[[:space:]]*runtime[[:space:]]*=[[:space:]]*"runc"' "$CONF" \
  && grep -Eq '^[[:space:]]*default_ulimits[[:space:]]*=' "$CONF"; then
  say "$CONF already sets runtime = \"runc\" and default_ulimits"
else
  if [ -f "$CONF" ]; then
    backup="$CONF.orchard-backup.$(date +%Y%m%d%H%M%S)"
    cp -p "$CONF" "$backup"
    say "backed up $CONF to $backup"
  fi
  mkdir -p "$(dirname "$CONF")"
  cat >"$CONF" <<'EOF'
# Written by Orchard's scripts/setup-host.sh (the previous file, if any, is backed up beside).
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]

[engine]
runtime = "runc"
EOF
  conf_changed=yes
  say "wrote $CONF"
fi

# --- the Docker-compatible API socket ------------------------------------------------------------
answers() { curl -fsS --max-time 2 --unix-socket "$SOCKET" http://podman/_ping >/dev/null 2>&1; }

if answers; then
  say "Podman API answers at unix://$SOCKET"
  if [ "$conf_changed" = yes ]; then
    say "note: restart that Podman service so it reads the new $CONF"
  fi
else
  mkdir -p "$(dirname "$SOCKET")"
  rm -f "$SOCKET"  # a stale socket file from a service that is gone
  say "starting podman system service on unix://$SOCKET (log: $LOG)"
  # From /: the service's working directory is where conmon drops its files (an "oom"
  # marker when a sandbox's command is OOM-killed), so never the caller's checkout.
  (cd / && setsid nohup podman system service --time=0 "unix://$SOCKET" >>"$LOG" 2>&1 </dev/null &)
  for _ in $(seq 1 60); do
    answers && break
    sleep 0.5
  done
  answers || die "the Podman API socket did not answer within 30 s; see $LOG"
  say "Podman API answers at unix://$SOCKET"
fi
