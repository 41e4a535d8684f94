#!/usr/bin/env bash
# keras_dist's GPU check: one call on the lent GPU machine (one H100, Python
# 3.12 with CUDA torch, JAX, cupy and NCCL; no Keras, no network). Prepare the
# wheels here first (tests/gpu/prepare_device_check.sh), then run from the
# repository root, carrying them:
#
#     bash tests/gpu/device_check.sh    (device run: carry [".device_check"], timeout_s 420)
#
# Installs the carried wheels into /tmp/site, prints what the machine has,
# then runs each section of tests/gpu/device_check.py as its own process
# under a hard timeout (the timeouts, the install's included, add up to 325 s;
# a step that runs out is stopped and counted as failed). The whole log also
# goes to $OUT/device_check.log ($OUT: the device's folder that comes back).
# Ends with the failing CHECK lines, a table of the steps and a last line
# `N passed, N failed` (steps); exit status 1 when any step failed.
set -u
cd "$(dirname "$0")/../.."
started=$SECONDS
PYTHON=${PYTHON:-python3}
WHEELS=.device_check
SITE=/tmp/site
MPICH_PREFIX=/tmp/mpich
LOG=${OUT:-/tmp}/device_check.log
: >"$LOG"
export PYTHONUNBUFFERED=1
declare -a STEP_NAMES=() STEP_RESULTS=()

say() { echo "== $*" | tee -a "$LOG"; }

record() {  # NAME STATUS SECONDS BUDGET
    local verdict=PASS
    if [ "$2" -eq 124 ] || [ "$2" -eq 137 ]; then
        verdict="FAIL (timed out after $4 s)"
    elif [ "$2" -ne 0 ]; then
        verdict="FAIL (exit status $2)"
    fi
    STEP_NAMES+=("$1")
    STEP_RESULTS+=("$verdict")
    say "step $1: $verdict in $3 s (budget $4 s; $((SECONDS - started)) s so far)"
}

step() {  # NAME BUDGET COMMAND...: runs COMMAND under a hard timeout, output to the log too
    local name=$1 budget=$2 begun=$SECONDS
    shift 2
    say "step $name (budget $budget s): $*"
    timeout -k 5 "$budget" "$@" 2>&1 | tee -a "$LOG"
    record "$name" "${PIPESTATUS[0]}" $((SECONDS - begun)) "$budget"
}

install() {
    if ! ls -l "$WHEELS"/*.whl; then
        echo "no wheels in $WHEELS: run tests/gpu/prepare_device_check.sh first, carry $WHEELS"
        return 1
    fi
    rm -rf "$SITE" "$MPICH_PREFIX"
    local others
    others=$(ls "$WHEELS"/*.whl | grep -v '/mpich-')
    # shellcheck disable=SC2086
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" $others || return 1
    # mpich's wheel installs bin/ and lib/ (libmpi) beside the environment;
    # pip --target keeps its bin/ but drops its lib/, so it gets a prefix of its own.
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --ignore-installed --prefix "$MPICH_PREFIX" "$WHEELS"/mpich-*.whl || return 1
    ls "$SITE" "$SITE/bin" "$MPICH_PREFIX/bin" "$MPICH_PREFIX/lib"
    test -x "$MPICH_PREFIX/bin/mpiexec" && test -f "$MPICH_PREFIX/lib/libmpi.so.12"
}

say "device_check on $(hostname) at $(date -u +%FT%TZ), python: $(command -v "$PYTHON")"
export WHEELS SITE MPICH_PREFIX PYTHON
export -f install
step install 20 bash -c install
# The carried packages before the image's; the carried MPICH's mpiexec first on
# PATH (kdrun looks beside python3, then on PATH; device_check.py also names it
# with --mpiexec), and mpi4py told which libmpi to load (it looks only in the
# Python environment's prefixes).
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
export PATH=$MPICH_PREFIX/bin:$SITE/bin:$PATH
export MPI4PY_LIBMPI=$MPICH_PREFIX/lib/libmpi.so.12
say "PYTHONPATH=$PYTHONPATH MPI4PY_LIBMPI=$MPI4PY_LIBMPI mpiexec=$(command -v mpiexec) kdrun=$(command -v kdrun)"
# hydra's proxies reach mpiexec at this machine's hostname; where that name
# does not resolve, they are told to use the loopback interface's address.
if getent hosts "$(hostname)" >/dev/null 2>&1; then
    say "hostname $(hostname) resolves: $(getent hosts "$(hostname)" | head -1)"
else
    export HYDRA_IFACE=lo
    say "hostname $(hostname) does not resolve: HYDRA_IFACE=lo"
fi
say "nvidia-smi -L: $(nvidia-smi -L 2>&1 | tr '\n' ' ')"
say "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-<unset>} XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-<unset>}"

CHECK=tests/gpu/device_check.py
step versions 50 "$PYTHON" "$CHECK" versions
step nccl1 60 "$PYTHON" "$CHECK" nccl1
step jax_step 60 "$PYTHON" "$CHECK" jax_step
step torch_step 45 "$PYTHON" "$CHECK" torch_step
step memory 40 "$PYTHON" "$CHECK" memory
step shared_gpu 50 "$PYTHON" "$CHECK" shared_gpu

failed=0
for verdict in "${STEP_RESULTS[@]}"; do
    [ "$verdict" = PASS ] || failed=$((failed + 1))
done
failing_checks=$(grep -E '^CHECK [^ ]+: FAIL' "$LOG")
checks_passed=$(grep -cE '^CHECK [^ ]+: PASS' "$LOG")
{
    echo "== failing checks:"
    echo "${failing_checks:-   none}"
    echo "== checks: $checks_passed passed, $(grep -c . <<<"$failing_checks") failed"
    echo "== steps ($((SECONDS - started)) s in all; full log: $LOG):"
    for i in "${!STEP_NAMES[@]}"; do
        printf '   %-12s %s\n' "${STEP_NAMES[$i]}" "${STEP_RESULTS[$i]}"
    done
    echo "$((${#STEP_RESULTS[@]} - failed)) passed, $failed failed"
} | tee -a "$LOG"
[ "$failed" -eq 0 ]
