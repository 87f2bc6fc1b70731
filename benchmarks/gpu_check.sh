#!/usr/bin/env bash
# One device call's worth of checks, in the repository root:
#   bash benchmarks/gpu_check.sh            (PYTHONPATH is set here; results under ${OUT:-/tmp}/gpu_check)
# The GPU tests (every file), the CPU tests that also run on CUDA and were last changed without a GPU (the density
# probe), then generate() TTFT/TPOT of plas and xattn against sdpa (TTFT) and sdpa-static (TPOT) at 32K on the
# Llama-3-8B shape. About 10 minutes in all: split it over two calls to a warm machine when one call's limit is
# 600 s.
set -u
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
out="${OUT:-/tmp}/gpu_check"
mkdir -p "$out"
timeout 560 python -m pytest -q -m gpu tests --tb=short > "$out/pytest_gpu.txt" 2>&1; tail -3 "$out/pytest_gpu.txt"
timeout 200 python -m pytest -q tests/test_equivalence.py tests/test_reference.py -k "probe or block_selection" \
    --tb=short > "$out/pytest_cuda.txt" 2>&1; tail -3 "$out/pytest_cuda.txt"
timeout 400 python benchmarks/bench_generate.py --lengths 32768 --tpot-tokens 16 128 --repeats 2 \
    --methods sdpa sdpa-static plas xattn --no-density --json "$out/generate.json" > "$out/generate.txt" 2>&1
tail -8 "$out/generate.txt"
