#!/usr/bin/env bash
# The GPU checks of keras_dist, for a machine with a CUDA GPU, PyTorch, JAX and
# cupy (no TensorFlow needed). From the repository root:
#
#     bash tests/gpu/run_gpu_checks.sh
#
# Installs what is missing with pip (keras_dist itself without its
# dependencies, keras, mpich, mpi4py, pytest, pytest-timeout, hypothesis),
# then runs tests/gpu with KERAS_BACKEND=torch and KERAS_BACKEND=jax, at one
# rank. With one GPU, the multi-rank NCCL tests skip (NCCL puts one rank on
# each GPU) and say so. Under 8 minutes: every pytest run has a hard timeout.
# Exit status: 0 when both runs pass, else the first failing run's.
set -u
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}
started=$SECONDS

missing=()
for entry in keras:keras mpi4py:mpi4py pytest:pytest pytest_timeout:pytest-timeout \
             hypothesis:hypothesis; do
    "$PYTHON" -c "import ${entry%%:*}" 2>/dev/null || missing+=("${entry#*:}")
done
"$PYTHON" -m pip show mpich >/dev/null 2>&1 || missing+=(mpich)
if [ ${#missing[@]} -gt 0 ]; then
    echo "== installing: ${missing[*]}"
    "$PYTHON" -m pip install -q "${missing[@]}" || echo "== pip could not install all of them"
fi

# keras_dist itself (unless already installed); where the build cannot fetch
# its build tools, the source tree serves (without the native extension: one
# rank needs none).
if (cd / && "$PYTHON" -c "import keras_dist") 2>/dev/null; then
    echo "== keras_dist already installed"
elif ! "$PYTHON" -m pip install -q -e . --no-deps 2>/tmp/keras_dist_install.log; then
    if ! "$PYTHON" -m pip install -q -e . --no-deps --no-build-isolation \
            2>>/tmp/keras_dist_install.log; then
        echo "== pip install -e . failed (see /tmp/keras_dist_install.log); using the source tree"
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi

"$PYTHON" - <<'PY'
import importlib
for name in ("cupy", "torch", "jax", "keras", "mpi4py"):
    try:
        module = importlib.import_module(name)
        print(f"== {name} {getattr(module, '__version__', '?')}")
    except Exception as error:  # noqa: BLE001
        print(f"== {name}: not importable ({type(error).__name__}: {error})")
try:
    import cupy
    print("== GPUs visible to cupy:", cupy.cuda.runtime.getDeviceCount())
except Exception as error:  # noqa: BLE001
    print("== cupy sees no GPU:", error)
PY

export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX, torch and cupy share the GPU
status=0
for backend in torch jax; do
    echo "== KERAS_BACKEND=$backend pytest tests/gpu"
    KERAS_BACKEND=$backend timeout 200 "$PYTHON" -m pytest tests/gpu -v -rs \
        -p no:cacheprovider --timeout 150
    result=$?
    echo "== KERAS_BACKEND=$backend: exit status $result"
    [ $status -eq 0 ] && status=$result
done
echo "== done in $((SECONDS - started)) s, exit status $status"
exit $status
