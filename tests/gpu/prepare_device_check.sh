#!/usr/bin/env bash
# Fills .device_check/ (ignored by git) with the cp312 manylinux x86_64 wheels
# that tests/gpu/device_check.sh installs on the lent GPU machine, which has
# Python 3.12, torch, JAX, cupy and NCCL but no Keras, no MPI of ours and no
# network. Runs here, from the repository root, with PyPI reachable:
#
#     bash tests/gpu/prepare_device_check.sh
#
# then, on the device: `bash tests/gpu/device_check.sh`, carry [".device_check"].
#
# The folder holds: keras_dist built from this working tree for CPython 3.12;
# keras at the version of .venv and those of its dependencies the device image
# lacks; mpich and mpi4py at the versions of .venv (an MPI known to work).
# The interpreter that builds keras_dist: $PYTHON312, else python3.12 on PATH,
# else ~/.pyenv/versions/3.12.1/bin/python. Cleans the folder first; fails
# when a step fails or the folder exceeds 60 MiB.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR=.device_check
LIMIT_BYTES=$((60 * 1024 * 1024))
# What the device image already holds of keras's dependencies
# (/work/.library/device/KINDS.md, "Python packages already there").
IMAGE_HAS=" absl-py numpy rich h5py ml-dtypes packaging typing-extensions "

step() { echo "== $*"; }

# The interpreter whose versions are carried (the project's venv).
VENV_PY=.venv/bin/python
[ -x "$VENV_PY" ] || VENV_PY=python3
version_in_venv() {
    "$VENV_PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"
}
normalised() { echo "$1" | tr 'A-Z_.' 'a-z--'; }
requirements() {  # WHEEL: the names of its unconditional requirements, normalised
    unzip -p "$1" '*.dist-info/METADATA' | grep '^Requires-Dist:' | grep -v 'extra *==' \
        | sed 's/^Requires-Dist: *\([A-Za-z0-9_.-]*\).*/\1/' | tr 'A-Z_.' 'a-z--' || true
}
mib() { awk -v b="$1" 'BEGIN {printf "%8.2f MiB", b / 1048576}'; }

PY312=${PYTHON312:-}
if [ -z "$PY312" ]; then
    if command -v python3.12 >/dev/null 2>&1 && python3.12 -c "" 2>/dev/null; then
        PY312=$(command -v python3.12)
    else
        PY312=$HOME/.pyenv/versions/3.12.1/bin/python
    fi
fi
if ! "$PY312" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    echo "prepare_device_check: no CPython 3.12 found (tried \$PYTHON312, python3.12, $PY312)." >&2
    exit 1
fi
step "building with $PY312 ($("$PY312" -V 2>&1)); versions from $VENV_PY"

rm -rf "$OUT_DIR"
mkdir -p "$OUT_DIR"

step "keras_dist wheel for CPython 3.12 from $(pwd)"
"$PY312" -m pip wheel -q --no-deps --disable-pip-version-check -w "$OUT_DIR" .

download() {  # NAME==VERSION: its cp312 manylinux x86_64 (or pure Python) wheel
    step "download $1"
    "$PY312" -m pip download -q --no-deps --disable-pip-version-check --only-binary=:all: \
        --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d "$OUT_DIR" "$1"
}

keras_version=$(version_in_venv keras)
download "keras==$keras_version"
for name in $(requirements "$OUT_DIR"/keras-*.whl); do
    if [[ "$IMAGE_HAS" == *" $name "* ]]; then
        echo "   keras needs $name: in the device image"
    else
        download "$name==$(version_in_venv "$name")"
    fi
done
download "mpich==$(version_in_venv mpich)"
download "mpi4py==$(version_in_venv mpi4py)"

step "requirements of the carried wheels that neither the image nor the folder has"
carried=" "
for wheel in "$OUT_DIR"/*.whl; do
    carried+="$(normalised "$(basename "$wheel" | cut -d- -f1)") "
done
unmet=0
for wheel in "$OUT_DIR"/*.whl; do
    for name in $(requirements "$wheel"); do
        if [[ "$IMAGE_HAS$carried" != *" $name "* ]]; then
            echo "   $(basename "$wheel") needs $name: NOT carried, not known in the image"
            unmet=1
        fi
    done
done
[ $unmet -eq 0 ] && echo "   none"

step "the native extension's symbol versions (the device must have these or newer)"
native=$(unzip -l "$OUT_DIR"/keras_dist-*.whl | awk '/_native.*\.so$/ {print $4}')
if [ -n "$native" ]; then
    scratch=$(mktemp -d)
    unzip -q -o "$OUT_DIR"/keras_dist-*.whl "$native" -d "$scratch"
    echo "   $native needs" $(objdump -T "$scratch/$native" | grep -o 'GLIBC[A-Z]*_[0-9.]*' \
        | sort -t_ -k2 -V -u | awk -F_ '{last[$1]=$0} END {for (k in last) print last[k]}')
    rm -rf "$scratch"
else
    echo "   the keras_dist wheel holds no native extension" >&2
    exit 1
fi

step "wheels in $OUT_DIR"
total=0
for wheel in "$OUT_DIR"/*.whl; do
    bytes=$(stat -c %s "$wheel")
    total=$((total + bytes))
    printf '   %-76s %s\n' "$(basename "$wheel")" "$(mib "$bytes")"
done
printf '   %-76s %s (limit 60 MiB)\n' "total" "$(mib "$total")"
if [ "$total" -gt "$LIMIT_BYTES" ]; then
    echo "prepare_device_check: $OUT_DIR holds $total bytes, over 60 MiB." >&2
    exit 1
fi
step "ready: bash tests/gpu/device_check.sh on the device, carry [\".device_check\"]"
