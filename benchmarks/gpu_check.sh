#!/usr/bin/env bash
# One device call's worth of checks for the CUDA-graph decode path and its kernels, in the repository root:
#   bash benchmarks/gpu_check.sh            (PYTHONPATH is set here; results under ${OUT:-/tmp}/gpu_check)
# GPU tests of the kernels and static decode, then generate() TPOT/TTFT against eager sdpa and against sdpa with
# transformers' static cache (torch.compile'd decode) at 32K.
set -u
export PYTHONPATH="$PWD"
out="${OUT:-/tmp}/gpu_check"
mkdir -p "$out"
timeout 420 python -m pytest -q -m gpu tests/test_static_decode.py tests/test_kernels.py --tb=short \
    > "$out/pytest.txt" 2>&1; tail -3 "$out/pytest.txt"
(cd benchmarks && timeout 500 python bench_generate.py --lengths 32768 --new-tokens 128 --repeats 2 \
    --methods sdpa plas xattn sdpa-static --no-density > "$out/generate.txt" 2>&1); tail -8 "$out/generate.txt"
