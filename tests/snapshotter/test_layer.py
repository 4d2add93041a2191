"""The snapshotter's host-side reading: container pid, root upperdir, freezer, layer tar."""

from __future__ import annotations

import gzip
import hashlib
import os
import stat
import tarfile
from pathlib import Path

import pytest

from orchard_env import errors
from orchard_env.snapshotter.layer import (
    OPAQUE_MARKER,
    find_container_pid,
    freeze,
    has_capability,
    root_upperdir,
    write_layer,
)

CID = "c0d9e9217c18430d54c2f11f2b2b2dcf3512ffecb333d20507444206dd333569"


def _fake_proc(root: Path, processes: dict[int, str]) -> Path:
    proc = root / "proc"
    for pid, cgroup in processes.items():
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text(cgroup)
    (proc / "self").mkdir()
    return proc


def test_find_container_pid_takes_the_lowest_pid_of_the_containers_cgroup(tmp_path: Path) -> None:
    proc = _fake_proc(
        tmp_path,
        {
            1: "0::/init.scope\n",
            4321: f"0::/kubepods.slice/cri-containerd-{CID}.scope\n",
            4300: f"0::/kubepods.slice/cri-containerd-{CID}.scope\n",
            77: "0::/kubepods.slice/cri-containerd-0123456789abcdef.scope\n",
        },
    )
    assert find_container_pid(f"containerd://{CID}", proc=proc) == 4300
    assert find_container_pid(CID, proc=proc) == 4300
    with pytest.raises(errors.NotFound, match="no process of container 0123456789ab"):
        find_container_pid("containerd://0123456789abcdef00", proc=proc)
    with pytest.raises(errors.InvalidRequest, match="not a hex container id"):
        find_container_pid("containerd://../../etc", proc=proc)


_SNAPSHOTS = "/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs/snapshots/91"
MOUNTINFO = (
    "2900 2800 0:311 / / rw,relatime master:1 - overlay overlay rw,"
    f"lowerdir=/var/lib/containerd/l1:/var/lib/containerd/l2,upperdir={_SNAPSHOTS}/fs,"
    f"workdir={_SNAPSHOTS}/work\n"
    "2901 2900 0:312 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw\n"
    "2902 2900 8:1 /var/lib/kubelet/pods/x/etc-hosts /etc/hosts rw,relatime - ext4 /dev/sda1 rw\n"
    "2903 2900 0:313 / /opt/orchard-agent ro,relatime - overlay overlay rw,upperdir=/elsewhere\n"
    "2904 2900 8:1 /a /run/with\\040space rw - ext4 /dev/sda1 rw\n"
)


def test_root_upperdir_reads_the_root_overlay_and_the_other_mount_points(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path, {42: "0::/x\n"})
    (proc / "42" / "mountinfo").write_text(MOUNTINFO)
    root = root_upperdir(42, proc=proc)
    assert root.upperdir == Path(f"{_SNAPSHOTS}/fs")
    assert root.mount_points == {"proc", "etc/hosts", "opt/orchard-agent", "run/with space"}


def test_root_upperdir_refuses_a_root_that_is_not_an_overlay(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path, {42: "0::/x\n"})
    (proc / "42" / "mountinfo").write_text("1 0 8:1 / / rw - ext4 /dev/sda1 rw\n")
    with pytest.raises(errors.NotSupported, match="not an overlay mount"):
        root_upperdir(42, proc=proc)
    with pytest.raises(errors.NotFound, match="cannot read the mounts of process 43"):
        root_upperdir(43, proc=proc)


def test_freeze_v2_freezes_then_thaws(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path, {42: "0::/kubepods/pod1/c1\n"})
    group = tmp_path / "cgroup" / "kubepods" / "pod1" / "c1"
    group.mkdir(parents=True)
    (group / "cgroup.freeze").write_text("0")
    (group / "cgroup.events").write_text("populated 1\nfrozen 1\n")
    with freeze(42, CID, proc=proc, cgroup_root=tmp_path / "cgroup") as reason:
        assert reason is None
        assert (group / "cgroup.freeze").read_text() == "1"
    assert (group / "cgroup.freeze").read_text() == "0"


def test_freeze_v1_and_a_cgroup_that_does_not_freeze_in_time(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path, {42: "4:freezer:/libpod_parent/libpod-x\n0::/libpod-x\n"})
    group = tmp_path / "cgroup" / "freezer" / "libpod_parent" / "libpod-x"
    group.mkdir(parents=True)
    (group / "freezer.state").write_text("THAWED")
    with freeze(42, CID, proc=proc, cgroup_root=tmp_path / "cgroup") as reason:
        assert reason is None
        assert (group / "freezer.state").read_text() == "FROZEN"
    assert (group / "freezer.state").read_text() == "THAWED"

    proc2 = _fake_proc(tmp_path / "two", {7: "0::/slow\n"})
    slow = tmp_path / "cg2" / "slow"
    slow.mkdir(parents=True)
    (slow / "cgroup.freeze").write_text("0")
    (slow / "cgroup.events").write_text("frozen 0\n")
    with (
        pytest.raises(errors.Timeout, match="did not freeze"),
        freeze(7, CID, proc=proc2, cgroup_root=tmp_path / "cg2", timeout=0.05),
    ):
        pass
    assert (slow / "cgroup.freeze").read_text() == "0"


def test_freeze_says_why_it_cannot(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path, {42: "0::/nowhere\n"})
    with freeze(42, CID, proc=proc, cgroup_root=tmp_path / "cgroup") as reason:
        assert reason is not None
        assert "no writable freezer" in reason


def _upperdir(root: Path) -> Path:
    upper = root / "upper"
    (upper / "etc").mkdir(parents=True)
    (upper / "etc" / "motd").write_text("hello\n")
    (upper / "etc" / "motd").chmod(0o640)
    os.chown(upper / "etc" / "motd", 1000, 1001)
    os.link(upper / "etc" / "motd", upper / "etc" / "motd.hard")
    (upper / "etc" / "link").symlink_to("motd")
    os.mknod(upper / "etc" / "deleted", 0o600 | stat.S_IFCHR, os.makedev(0, 0))
    (upper / "var" / "cache").mkdir(parents=True)
    os.setxattr(upper / "var" / "cache", "trusted.overlay.opaque", b"y")
    (upper / "var" / "cache" / "new").write_bytes(b"\x00" * 10)
    (upper / "run" / "orchard").mkdir(parents=True)
    (upper / "run" / "orchard" / "token").write_text("secret")
    (upper / "opt" / "orchard-agent").mkdir(parents=True)
    (upper / "etc" / "hosts").write_text("")
    return upper


def test_write_layer_converts_whiteouts_and_leaves_out_the_mounts(tmp_path: Path) -> None:
    upper = _upperdir(tmp_path)
    out = tmp_path / "layer.tar.gz"
    layer = write_layer(
        upper, out, exclude=frozenset({"run/orchard", "opt/orchard-agent", "etc/hosts"})
    )
    data = out.read_bytes()
    assert layer.digest == "sha256:" + hashlib.sha256(data).hexdigest()
    assert layer.diff_id == "sha256:" + hashlib.sha256(gzip.decompress(data)).hexdigest()
    assert layer.size_bytes == len(data)

    with tarfile.open(out) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert list(members) == [
            "etc",
            "etc/.wh.deleted",
            "etc/link",
            "etc/motd",
            "etc/motd.hard",
            "opt",
            "run",
            "var",
            "var/cache",
            f"var/cache/{OPAQUE_MARKER}",
            "var/cache/new",
        ]
        motd = members["etc/motd"]
        assert (motd.mode, motd.uid, motd.gid, motd.size) == (0o640, 1000, 1001, 6)
        assert tar.extractfile(motd).read() == b"hello\n"  # type: ignore[union-attr]
        assert members["etc/motd.hard"].islnk()
        assert members["etc/motd.hard"].linkname == "etc/motd"
        assert members["etc/link"].issym()
        assert members["etc/link"].linkname == "motd"
        assert members["etc/.wh.deleted"].isreg()
        assert members["etc/.wh.deleted"].size == 0
        assert members[f"var/cache/{OPAQUE_MARKER}"].isreg()
        assert members["var/cache"].isdir()

    # The same upperdir gives the same blob: the digest does not depend on when it is written.
    again = write_layer(
        upper, tmp_path / "again.tar.gz", exclude=frozenset({"run/orchard", "opt/orchard-agent"})
    )
    assert again.digest != layer.digest  # etc/hosts is in this one
    same = write_layer(
        upper,
        tmp_path / "same.tar.gz",
        exclude=frozenset({"run/orchard", "opt/orchard-agent", "etc/hosts"}),
    )
    assert same.digest == layer.digest


def test_write_layer_of_a_missing_upperdir(tmp_path: Path) -> None:
    with pytest.raises(errors.NotFound, match="does not exist on this host"):
        write_layer(tmp_path / "gone", tmp_path / "out.tar.gz")


def test_freeze_finds_the_containers_cgroup_outside_its_own_cgroup_namespace(
    tmp_path: Path,
) -> None:
    """In a pod, /proc/<pid>/cgroup shows paths relative to the pod's own cgroup; the host's
    tree (a hostPath) is searched for the container's directory instead."""
    proc = _fake_proc(tmp_path, {42: f"0::/../../kubepods/pod9/cri-containerd-{CID}.scope\n"})
    group = tmp_path / "cgroup" / "kubepods.slice" / "pod9" / f"cri-containerd-{CID}.scope"
    group.mkdir(parents=True)
    (group / "cgroup.freeze").write_text("0")
    (group / "cgroup.events").write_text("frozen 1\n")
    with freeze(42, f"containerd://{CID}", proc=proc, cgroup_root=tmp_path / "cgroup") as reason:
        assert reason is None
        assert (group / "cgroup.freeze").read_text() == "1"
    assert (group / "cgroup.freeze").read_text() == "0"


def test_has_capability(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.write_text("Name:\tx\nCapEff:\t0000000000200000\n")
    assert has_capability(21, status=status)
    status.write_text("Name:\tx\nCapEff:\t0000000000000004\n")
    assert not has_capability(21, status=status)
    assert has_capability(2, status=status)
