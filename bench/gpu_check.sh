#!/usr/bin/env bash
# One short run on a CUDA machine (aim: < 8 minutes on an H200):
#   1. install radixserve (editable) into $PYTHON's environment, offline-friendly;
#   2. run the kernel and backend tests compiled for the GPU (no TRITON_INTERPRET);
#   3. benchmark the kernels (bench/kernels.py, with tile / split sweeps at the target points);
#   4. run the slow kernel sweep (dtypes x head dims x GQA ratios x page sizes) if time allows.
# Everything it prints is saved under bench/results/: gpu-check-<gpu>.log (all of it),
# gpu-{tests,bench,sweep}-<gpu>.log, and bench/kernels.py's JSON kernels-<gpu>.json.
#
#   bash bench/gpu_check.sh            # PYTHON=python3 by default; QUICK=1 for a shorter bench
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
RESULTS=bench/results
mkdir -p "$RESULTS"
unset TRITON_INTERPRET

gpu=$("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' 2>/dev/null)
if [ -z "$gpu" ]; then
    echo "gpu_check.sh: no CUDA device visible to $PYTHON (torch.cuda.is_available() is False)" >&2
    exit 2
fi
slug=$(echo "$gpu" | sed -E 's/[^A-Za-z0-9]+/-/g; s/^-+|-+$//g')
log="$RESULTS/gpu-check-$slug.log"
exec > >(tee "$log") 2>&1
echo "== $(date -u +%FT%TZ)  $gpu"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>/dev/null || true

echo "== install"
# The device machine may be offline and its python may be system-managed: install this
# checkout editable without dependencies (unless it is already the importable one), and
# fetch dependencies only if something the tests import is missing.
here='import os, radixserve, radixserve.kernels; assert os.path.realpath(radixserve.__file__).startswith(os.path.realpath("radixserve"))'
if ! "$PYTHON" -c "$here" 2>/dev/null; then
    "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . \
        || "$PYTHON" -m pip install -q --no-deps --no-build-isolation --break-system-packages -e . \
        || exit 1
fi
check='import torch, triton, pytest, radixserve.kernels.decode_attention, radixserve.scheduler.scheduler'
if ! "$PYTHON" -c "$check" 2>/dev/null; then
    echo "(dependencies missing; trying pip install -e .[dev])"
    "$PYTHON" -m pip install -q --retries 1 --timeout 20 -e ".[dev]"
fi
"$PYTHON" -c "$check; print('torch', torch.__version__, ' triton', triton.__version__, ' cuda', torch.version.cuda)" || exit 1
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}  # Triton 3.9's default, without its warning

status=0
run() {  # run <name> <timeout s> <command...>: log to $RESULTS/gpu-<name>-<gpu>.log, keep going
    local name=$1 limit=$2 start rc
    shift 2
    echo "== $name"
    start=$(date +%s)
    timeout "$limit" "$@" 2>&1 | tee "$RESULTS/gpu-$name-$slug.log" | tail -n 60
    rc=${PIPESTATUS[0]}
    echo "$name: exit $rc in $(( $(date +%s) - start )) s"
    [ "$rc" -eq 0 ] || status=1
}
pytest_args=(-q -p no:cacheprovider)
# 1. the default kernel + backend tests, compiled (bf16 held to 1e-2, float32 to 1e-5)
run tests 240 "$PYTHON" -m pytest "${pytest_args[@]}" tests/test_kernels.py tests/test_triton_backend.py
# 2. the benchmark (bench/results/kernels-<gpu>.json)
run bench 240 "$PYTHON" bench/kernels.py ${QUICK:+--quick}
# 3. the slow sweep last: mostly compile time, so it may run out of time without losing 1-2
run sweep 150 "$PYTHON" -m pytest "${pytest_args[@]}" -m slow tests/test_kernels.py

echo "== done (status $status); results in $RESULTS/"
exit $status
