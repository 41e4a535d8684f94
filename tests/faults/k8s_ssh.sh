#!/bin/sh
# A stand-in for ssh in a Kubeflow MPIJob's launcher pod (test_kubernetes.py):
#     k8s_ssh.sh [SSH OPTIONS] HOST COMMAND...
# The operator has hydra pass `-o ConnectionAttempts=10` (HYDRA_LAUNCH_EXTRA_ARGS);
# ssh's options are skipped, those that take a value with it, and
# netns_launcher.sh runs COMMAND on HOST, a network namespace (KD_NETNS_HOSTS).
while :; do
    case $1 in
        -[BbcDEeFIiJLlmOopQRSWw]) shift 2 ;;
        -*) shift ;;
        *) break ;;
    esac
done
exec "$(dirname "$0")/netns_launcher.sh" "$@"
