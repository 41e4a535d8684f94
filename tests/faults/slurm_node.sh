#!/bin/sh
# One node of the Slurm test cluster (tests/faults/test_slurm.py):
#     ip netns exec NETNS slurm_node.sh NODENAME SLURM_CONF [FSTYPE MOUNTPOINT OPTIONS]...
# `ip netns exec` gives the node a /sys of its own network namespace (MPI and
# UCX find the namespace's network devices there) but without the cgroup
# file systems slurmd needs: each FSTYPE MOUNTPOINT OPTIONS triple (the host's
# mounts under /sys/fs/cgroup) is mounted again. slurmd then runs in the
# foreground with NODENAME as its host name, in a UTS namespace of its own.
set -e
node=$1
conf=$2
shift 2
while [ $# -ge 3 ]; do
    mkdir -p "$2"
    mount -t "$1" -o "$3" "$1" "$2"
    shift 3
done
exec unshare --uts sh -c 'hostname "$0" && exec slurmd -D -f "$1"' "$node" "$conf"
