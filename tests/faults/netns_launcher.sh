#!/bin/sh
# A stand-in for ssh that hydra uses as its launcher (HYDRA_LAUNCHER=ssh,
# HYDRA_LAUNCHER_EXEC=<this file>) to start its proxy on a "host" that is a
# network namespace of this machine:
#     netns_launcher.sh [-x ...] HOST COMMAND...
# KD_NETNS_HOSTS maps hosts: "ADDRESS=NETNS=HOSTNAME,...". COMMAND runs in
# NETNS, in a UTS namespace of its own whose hostname is HOSTNAME.
while [ "${1#-}" != "$1" ]; do shift; done
host=$1
shift
for entry in $(echo "$KD_NETNS_HOSTS" | tr ',' ' '); do
    address=${entry%%=*}
    rest=${entry#*=}
    if [ "$address" = "$host" ]; then
        exec ip netns exec "${rest%%=*}" unshare --uts sh -c "hostname ${rest#*=} && exec $*"
    fi
done
echo "netns_launcher.sh: unknown host $host (KD_NETNS_HOSTS=$KD_NETNS_HOSTS)" >&2
exit 255
