#!/usr/bin/env bash
# Prepare a fresh Debian 12 machine (as root) to run Orchard's local backend and its tests:
# Podman with runc and safe default ulimits, a disk-quota-capable storage for it (btrfs on a
# loop file, see quota_storage below), its Docker-compatible API socket, and the tools that
# build the local test images (busybox-static, debootstrap). Idempotent: a second run changes
# nothing and only says what it found. Works without a TTY.
#
# ORCHARD_QUOTA_STORAGE: no (default: the engine's default storage, where `disk` is refused),
# auto (set the quota storage up only while the engine has no images or containers), yes (also
# on an engine that has some: they stay where they are, unused, and the old storage comes back
# by removing the new configuration). Not yet the default: the test suite has not run on it.
# ORCHARD_QUOTA_STORAGE_SIZE: the loop file's size (default: half the free space, 8G-64G).
set -euo pipefail

SOCKET=/run/podman/podman.sock
CONF=/etc/containers/containers.conf
LOG=/var/log/orchard-podman.log
STORAGE_CONF=/etc/containers/storage.conf
QUOTA_IMAGE=/var/lib/orchard-engine.btrfs  # the loop file
QUOTA_MOUNT=/var/lib/orchard-engine        # the btrfs on it; graphroot is storage/ below
QUOTA_RUN=/run/orchard-engine              # a tmpfs; runroot is storage/ below
# iptables: netavark sets up the bridge network with it; curl: the socket check below;
# catatonit: the init every sandbox container runs as PID 1; python3: the interpreter the
# agent bundle is built from; gcc, libc6-dev: the bundle's static orchard-subreaper;
# python3-venv: `make install`.
# openssl, iproute2, util-linux: the local Kubernetes control plane; containerd,
# containernetworking-plugins, ipset and conntrack: its node (scripts/k8s); btrfs-progs: the
# quota-capable engine storage.
PACKAGES=(podman runc catatonit iptables busybox-static debootstrap curl python3 python3-venv
  openssl iproute2 util-linux containerd containernetworking-plugins ipset conntrack btrfs-progs
  gcc libc6-dev)

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

# --- a disk-quota-capable storage for the engine -----------------------------------------------
# Podman's default storage (overlay on the root file system, ext4 here) cannot cap what a
# container writes, so Orchard refuses a sandbox's `disk` there. btrfs can: the btrfs storage
# driver makes each container a subvolume and honours `--storage-opt size=` with a qgroup
# limit. (overlay on xfs with pquota would too, but kernels built without CONFIG_XFS_QUOTA,
# like this project's CI machines, refuse the pquota mount.) The file system lives in a
# preallocated loop file, mounted without discard so its space stays reserved: whatever
# sandboxes write stays inside it. The runroot, where the engine keeps each container's
# /etc/hosts and /etc/hostname (writable binds), goes on a tmpfs: a sandbox writing there
# spends its own memory (the pages are charged to its cgroup), not the host's disk.
# Persistent through /etc/fstab; a rerun mounts what is not mounted.
quota_conf_is_ours() { [ -f "$STORAGE_CONF" ] && grep -q "^graphroot = \"$QUOTA_MOUNT/storage\"" "$STORAGE_CONF"; }

quota_fail() { say "quota storage: $*"; return 1; }

quota_mounts() {
  # The two mounts, from /etc/fstab; each line added once.
  local line
  grep -q " $QUOTA_MOUNT btrfs " /etc/fstab 2>/dev/null \
    || echo "$QUOTA_IMAGE $QUOTA_MOUNT btrfs loop,nodiscard,noatime,nofail 0 0" >>/etc/fstab
  grep -q " $QUOTA_RUN tmpfs " /etc/fstab 2>/dev/null \
    || echo "orchard-engine-run $QUOTA_RUN tmpfs size=10%,mode=0700,nofail 0 0" >>/etc/fstab
  for line in "$QUOTA_MOUNT" "$QUOTA_RUN"; do
    mkdir -p "$line"
    mountpoint -q "$line" || mount "$line" || quota_fail "could not mount $line" || return 1
  done
  btrfs quota enable "$QUOTA_MOUNT" || quota_fail "btrfs quota enable $QUOTA_MOUNT failed"
}

quota_size() {
  # Half the free space, between 8 GiB and 64 GiB; empty when there is not room for 8 GiB.
  local free gib=$((1024 * 1024 * 1024))
  free=$(df -B1 --output=avail "$(dirname "$QUOTA_IMAGE")" | tail -1)
  local half=$((free / 2))
  [ "$half" -ge $((8 * gib)) ] || return 0
  [ "$half" -le $((64 * gib)) ] || half=$((64 * gib))
  echo "$(((half / gib) * gib))"
}

quota_storage() {
  if quota_conf_is_ours; then
    quota_mounts || return 1
    say "engine storage: btrfs with quotas at $QUOTA_MOUNT ($(du -h --apparent-size "$QUOTA_IMAGE" | cut -f1) loop file $QUOTA_IMAGE), runroot on tmpfs $QUOTA_RUN"
    return 0
  fi
  case "${ORCHARD_QUOTA_STORAGE:-no}" in
    no)
      say "engine storage: left as it is: sandboxes cannot be disk-limited" \
        "(ORCHARD_QUOTA_STORAGE=auto or yes sets up a btrfs storage that can)"
      return 0 ;;
    yes) ;;
    auto)
      local images containers
      images=$(podman images -aq 2>/dev/null | wc -l) || images=unknown
      containers=$(podman ps -aq 2>/dev/null | wc -l) || containers=unknown
      if [ "$images" != 0 ] || [ "$containers" != 0 ]; then
        say "engine storage: left as it is: it holds $images images and $containers containers," \
          "which a btrfs storage would not see (sandboxes cannot be disk-limited);" \
          "ORCHARD_QUOTA_STORAGE=yes sets it up anyway (the old storage is kept, unused)"
        return 0
      fi ;;
    *) quota_fail "ORCHARD_QUOTA_STORAGE must be auto, yes or no, not ${ORCHARD_QUOTA_STORAGE}"; return 1 ;;
  esac
  grep -qw btrfs /proc/filesystems || quota_fail "this kernel has no btrfs" || return 1
  [ -e /dev/loop-control ] || quota_fail "this machine has no loop devices (/dev/loop-control)" || return 1
  local size=${ORCHARD_QUOTA_STORAGE_SIZE:-}
  if [ -z "$size" ]; then
    size=$(quota_size)
    [ -n "$size" ] || quota_fail "less than 16 GiB free for a loop file in $(dirname "$QUOTA_IMAGE")" || return 1
  fi
  if [ ! -e "$QUOTA_IMAGE" ]; then
    say "engine storage: making a $size-byte btrfs loop file $QUOTA_IMAGE"
    fallocate -l "$size" "$QUOTA_IMAGE" || { rm -f "$QUOTA_IMAGE"; quota_fail "fallocate -l $size $QUOTA_IMAGE failed"; return 1; }
    local made
    made=$(mkfs.btrfs -q "$QUOTA_IMAGE" 2>&1) \
      || { rm -f "$QUOTA_IMAGE"; quota_fail "mkfs.btrfs $QUOTA_IMAGE failed: $made"; return 1; }
  fi
  quota_mounts || return 1
  if [ -f "$STORAGE_CONF" ]; then
    local backup
    backup="$STORAGE_CONF.orchard-backup.$(date +%Y%m%d%H%M%S)"
    cp -p "$STORAGE_CONF" "$backup" || quota_fail "could not back up $STORAGE_CONF" || return 1
    say "backed up $STORAGE_CONF to $backup"
  fi
  cat >"$STORAGE_CONF" <<EOF || quota_fail "could not write $STORAGE_CONF" || return 1
# Written by Orchard's scripts/setup-host.sh (the previous file, if any, is backed up beside):
# btrfs, which can cap a container's disk (--storage-opt size=), on the loop file
# $QUOTA_IMAGE. Remove this file to go back to the default storage.
[storage]
driver = "btrfs"
graphroot = "$QUOTA_MOUNT/storage"
runroot = "$QUOTA_RUN/storage"
EOF
  say "engine storage: btrfs with quotas at $QUOTA_MOUNT, runroot on tmpfs $QUOTA_RUN; wrote $STORAGE_CONF"
  quota_changed=yes
}

quota_changed=no
quota_storage || say "engine storage: falling back to the engine's default storage (sandboxes cannot be disk-limited)"

# --- the Docker-compatible API socket ------------------------------------------------------------
answers() { curl -fsS --max-time 2 --unix-socket "$SOCKET" http://podman/_ping >/dev/null 2>&1; }

if answers; then
  say "Podman API answers at unix://$SOCKET"
  if [ "$conf_changed" = yes ]; then
    say "note: restart that Podman service so it reads the new $CONF"
  fi
  if [ "$quota_changed" = yes ]; then
    say "note: restart that Podman service so it uses the new storage ($STORAGE_CONF)"
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
