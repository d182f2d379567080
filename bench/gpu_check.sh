#!/usr/bin/env bash
# The proof run of the GPU path on a CUDA machine (aim: < 8 minutes on an H200).  Every step
# runs under its own time limit and the run goes on when one fails:
#   1. install radixserve (editable) into $PYTHON's environment, offline-friendly;
#   2. the kernel, backend, shared-prefix, CUDA graph and device-guard tests compiled for the
#      GPU (no TRITON_INTERPRET), one pytest per file (a file not in this checkout is left out);
#   3. the engine end to end (bench/gpu_e2e.py): greedy parity of the triton and torch backends
#      with transformers (float32 identical, bfloat16 within a tolerance), every engine under
#      RADIXSERVE_SYNC_DEBUG=error, the shared-prefix workload with the radix cache on and off,
#      decode tokens/s at batch 1/16/64/256 with and without CUDA graphs (default model and a
#      random Llama-3-8B-shaped one);
#   4. the kernel benchmark (bench/kernels.py --quick: decode, extend, and decode over a prefix
#      shared by all requests, plain against cascade; FULL_BENCH=1 for the whole grid);
#   5. the slow kernel sweep (dtypes x head dims x GQA ratios x page sizes) if time is left;
#   6. one summary table of all of it (bench/gpu_summary.py), each check against its target.
# Everything it prints is saved under bench/results/: gpu-check-<gpu>.log (all of it), one
# gpu-<step>-<gpu>.log per step, gpu-junit-<test file>-<gpu>.xml, gpu-steps-<gpu>.tsv (each
# step's exit code and seconds), gpu-e2e-<gpu>.json and kernels-<gpu>.json.
#
#   bash bench/gpu_check.sh     # PYTHON=python3; BUDGET_S=470 (whole run, s); E2E_ARGS="--parts parity"
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PYTHON=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-470}
RESULTS=bench/results
mkdir -p "$RESULTS"
unset TRITON_INTERPRET
t0=$(date +%s)

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
check='import torch, triton, pytest, transformers, radixserve.kernels.decode_attention, radixserve.scheduler.scheduler'
if ! "$PYTHON" -c "$check" 2>/dev/null; then
    echo "(dependencies missing; trying pip install -e .[test])"
    "$PYTHON" -m pip install -q --retries 1 --timeout 20 -e ".[test]"
fi
"$PYTHON" -c "$check; print('torch', torch.__version__, ' triton', triton.__version__, ' cuda', torch.version.cuda)" || exit 1
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}  # Triton 3.9's default, without its warning

status=0
steps="$RESULTS/gpu-steps-$slug.tsv"
: > "$steps"
elapsed() { echo $(( $(date +%s) - t0 )); }
limit() {  # limit <cap s> <s kept for the steps after>: the cap, or less to end within BUDGET_S
    local left=$(( BUDGET_S - $(elapsed) - $2 ))
    echo $(( left < $1 ? left : $1 ))
}
run() {  # run <name> <limit s> <command...>: log to $RESULTS/gpu-<name>-<gpu>.log, keep going
    local name=$1 limit=$2 start rc
    shift 2
    echo "== $name (limit $limit s; $(elapsed) s into the run)"
    start=$(date +%s)
    # SIGINT at the limit, so pytest still writes its JUnit report and gpu_e2e.py its JSON
    # (and stops its engines); SIGKILL 20 s later if that hangs.
    timeout -s INT -k 20 "$limit" "$@" 2>&1 | tee "$RESULTS/gpu-$name-$slug.log" | tail -n 40
    rc=${PIPESTATUS[0]}
    echo "$name: exit $rc in $(( $(date +%s) - start )) s"
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - start ))" >> "$steps"
    [ "$rc" -eq 0 ] || status=1
}
left_out() {  # left_out <name> <why>: a step that does not run, for the summary
    echo "== $1: left out ($2)"
    printf '%s\t%s\t0\n' "$1" "left out: $2" >> "$steps"
}
tests() {  # tests <name> <cap s> <file> [pytest args...]: one test file, compiled, its JUnit XML kept
    local name=$1 secs file=$3
    secs=$(limit "$2" 15)  # the tests come first: only the summary's 15 s are kept back
    shift 3
    if [ ! -f "$file" ]; then
        left_out "$name" "$file is not in this checkout"
    elif [ "$secs" -lt 10 ]; then
        left_out "$name" "no time left of the ${BUDGET_S} s budget"
    else
        run "$name" "$secs" "$PYTHON" -m pytest -q -p no:cacheprovider \
            --junitxml="$RESULTS/gpu-junit-$name-$slug.xml" "$@" "$file"
    fi
}

# 1. the tests (float32 held to 1e-5, bf16 to 1e-2), most important first
tests test_kernels 60 tests/kernels/test_triton_kernels.py
tests test_triton_backend 25 tests/engine/test_triton_backend.py
tests test_triton_shared_prefix 30 tests/kernels/test_triton_shared_prefix.py
tests test_cuda_graph 20 tests/engine/test_cuda_graph.py
tests test_device_guard 15 tests/engine/test_device_guard.py
# 2. the engine end to end (bench/results/gpu-e2e-<gpu>.json): its parts' budgets add up to
#    225 s (GPU_BUDGETS in bench/gpu_e2e.py), cut to --time-limit; 60 s are kept for 3. and 4.
secs=$(limit 240 60)
read -r -a e2e_args <<< "${E2E_ARGS:-}"
if [ "$secs" -ge 45 ]; then
    run e2e "$secs" "$PYTHON" bench/gpu_e2e.py --time-limit $(( secs - 15 )) ${e2e_args[@]+"${e2e_args[@]}"}
else
    left_out e2e "no time left of the ${BUDGET_S} s budget"
fi
# 3. the kernel benchmark (bench/results/kernels-<gpu>.json)
secs=$(limit 60 15)
if [ -n "${FULL_BENCH:-}" ]; then
    run bench 240 "$PYTHON" bench/kernels.py
elif [ "$secs" -ge 20 ]; then
    run bench "$secs" "$PYTHON" bench/kernels.py --quick
else
    left_out bench "no time left of the ${BUDGET_S} s budget"
fi
# 4. the slow sweep last, with what is left (mostly compile time: it may stop part way)
left=$(( BUDGET_S - $(elapsed) - 15 ))  # 15 s for the summary
if [ "$left" -ge 60 ]; then
    tests test_kernels_slow $(( left < 150 ? left : 150 )) tests/kernels/test_triton_kernels.py -m slow
else
    left_out test_kernels_slow "$left s of the ${BUDGET_S} s budget left"
fi

echo "== summary ($(elapsed) s into the run; results in $RESULTS/)"
"$PYTHON" bench/gpu_summary.py --slug "$slug" --since "$t0" || status=1
echo "== done (status $status) in $(elapsed) s"
exit $status
