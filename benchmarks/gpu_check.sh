#!/usr/bin/env bash
# Everything this project verifies on a GPU, in one go (the HARDENING.md figures and the
# benchmark figures recorded in benchmarks/results.json): the GPU test layer,
# compute-sanitizer over every design, and the benchmark tables (both designs side by side,
# the default design's, tile variants; the default scheduler against the standard ones;
# decode on uniform and heavy-tailed batches, paged against contiguous caches; the backward
# pass and its score rules against FlexAttention; token generation with a small model; masks
# and scores that read operands: packed documents, a bias table, run-time scalars; a learned
# score tensor's gradient; an FP8 cache and a serving step's pieces). Logs go to $1 (default
# gpu-check/).
#     bash benchmarks/gpu_check.sh [LOG_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
logs=${1:-gpu-check}
mkdir -p "$logs"
export PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$logs/gpu.txt"
# a hung kernel must not take the whole run: each test's Python stack is dumped after 120 s
# (the hung one names itself) and each half of the layer stops after its limit (on the H200
# with 14 workers, one BLAS thread each by tests/conftest.py: the attention file took 55 s,
# the other 192 tests 59 s)
gpu_tests() {  # LIMIT_SECONDS PYTEST_ARGS...
    timeout "$1" python3 -m pytest -m gpu -q -rA -p no:cacheprovider -n 14 \
        -o faulthandler_timeout=120 "${@:2}" 2>&1 | tee -a "$logs/gpu-tests.log" \
        | grep -E "passed|failed|error|fault came back|FAILED|Timeout" | tail -30 || status=1
}
gpu_tests 400 tests/test_gpu_attention.py
gpu_tests 700 tests --deselect tests/test_gpu_attention.py
# every design under all four tools, then the larger decode and backward case lists
python3 benchmarks/sanitize.py --log-dir "$logs/sanitize" 2>&1 | tee "$logs/sanitize.log" \
    | tail -10 || status=1
for script in sanitize_decode sanitize_backward; do
    python3 benchmarks/$script.py 2>&1 | tee "$logs/$script.log" | tail -4 || status=1
done
python3 benchmarks/hopper.py 2>&1 | tee "$logs/hopper.log" | tail -18 || status=1
python3 benchmarks/attention.py 2>&1 | tee "$logs/bench.log" | tail -16 || status=1
python3 benchmarks/schedulers.py --runs 3 --control --json "$logs/schedulers.json" 2>&1 \
    | tee "$logs/schedulers.log" | tail -16 || status=1
python3 benchmarks/tiles.py 2>&1 | tee "$logs/tiles.log" | tail -18 || status=1
python3 benchmarks/decode.py --workload all --chunks-per-sm 1,2,4 2>&1 | tee "$logs/decode.log" | tail -24 || status=1
python3 benchmarks/decode.py --workload paged 2>&1 | tee "$logs/decode_paged.log" | tail -26 || status=1
python3 benchmarks/backward.py 2>&1 | tee "$logs/backward.log" | tail -16 || status=1
python3 benchmarks/generate.py 2>&1 | tee "$logs/generate.log" | tail -24 || status=1
python3 benchmarks/operands.py 2>&1 | tee "$logs/operands.log" | tail -30 || status=1
python3 benchmarks/operand_grads.py 2>&1 | tee "$logs/operand_grads.log" | tail -12 || status=1
python3 benchmarks/decode_fp8.py 2>&1 | tee "$logs/decode_fp8.log" | tail -10 || status=1
python3 benchmarks/serving_step.py 2>&1 | tee "$logs/serving_step.log" | tail -10 || status=1
exit $status
