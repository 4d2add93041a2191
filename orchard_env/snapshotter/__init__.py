"""The node-side snapshotter of the Kubernetes backend.

It runs on every sandbox node (a DaemonSet, ``python -m orchard_env.snapshotter``, host PID
namespace) and commits a sandbox container's writable layer: it finds the container's process
by its id in ``/proc/*/cgroup``, reads the upperdir of the overlay at the container's root from
``/proc/<pid>/mountinfo``, tars it as an OCI layer (overlayfs whiteouts converted) while the
container's cgroup is frozen, and pushes base image + layer to a registry with the OCI
distribution API (:mod:`.registry`). A restore is a pod whose image is the pushed reference.

Never imports the orchestrator (an import-linter contract): it ships in the orchestrator image
but runs on its own.
"""
