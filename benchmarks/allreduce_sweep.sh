#!/usr/bin/env bash
# 2-rank allreduce sweeps, keras_dist beside mpi4py in the same job, one per CPU transport.
#
#   benchmarks/allreduce_sweep.sh                  # shm and mpi transports, 4 B .. 256 MiB
#   TRANSPORTS=mpi MAXBYTES=64M benchmarks/allreduce_sweep.sh --dtype bfloat16
#
# Extra arguments go to `python -m keras_dist.bench`. Each run's output is
# printed and saved to benchmarks/results/allreduce_<transport>_np<N>_<date>.txt,
# preceded by the date, commit, command and load average (numbers taken on a
# loaded machine are noisy). Exits non-zero if any run failed or found wrong
# results.
set -u -o pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
NP=${NP:-2}
TRANSPORTS=${TRANSPORTS:-shm mpi}
MINBYTES=${MINBYTES:-4}
MAXBYTES=${MAXBYTES:-256M}
ITERS=${ITERS:-10}
WARMUP=${WARMUP:-2}
REPS=${REPS:-5}
RESULTS=benchmarks/results
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$RESULTS"

status=0
stamp=$(date +%Y%m%d-%H%M%S)
for transport in $TRANSPORTS; do
    out="$RESULTS/allreduce_${transport}_np${NP}_${stamp}.txt"
    command=("$PYTHON" -m keras_dist.run -np "$NP" "$PYTHON" -m keras_dist.bench allreduce
             -b "$MINBYTES" -e "$MAXBYTES" -f 4 --transport "$transport" --vs mpi
             -n "$ITERS" -w "$WARMUP" --reps "$REPS" "$@")
    {
        echo "# date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
        echo "# commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
        echo "# host: $(getconf _NPROCESSORS_ONLN) cores, load average $(cut -d' ' -f1-3 /proc/loadavg) before the run"
        echo "# command: kdrun -np $NP python -m keras_dist.bench allreduce -b $MINBYTES" \
             "-e $MAXBYTES -f 4 --transport $transport --vs mpi -n $ITERS -w $WARMUP" \
             "--reps $REPS $*"
    } | tee "$out"
    if ! "${command[@]}" 2>&1 | tee -a "$out"; then
        echo "# FAILED: transport $transport" | tee -a "$out"
        status=1
    fi
    echo "# load average after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out"
done
exit $status
