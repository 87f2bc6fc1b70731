"""Host time of one call of a few launches a short prefill makes (CUDA only): the int8 cache's
``kernels.quantize_append`` (its input checks, the device guard, Triton's launch), the Triton launch alone (the
compiled kernel launched directly, :mod:`hf_sparse.kernels._launch`, and through Triton's JIT), the checks alone, an
empty two-argument Triton kernel, one in-place torch operator and one ``torch.zeros``.

Each call is repeated back to back without synchronising, so with a few query tokens the GPU idles and the time per
call is the host's. Quoted in docs/features.md ("The 8K gap is the host's", "The direct launch"). From the
repository root, on a GPU:

    python studies/launch_cost.py [--tokens 16 8192] [--calls 300]
"""
from __future__ import annotations

import argparse
import time

import torch


def host_us(call, calls: int) -> float:
    """Microseconds of host time per ``call()``, over ``calls`` calls after 20 warm-up calls."""
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 8192], help="tokens written per call")
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("launch_cost.py needs a CUDA GPU")
    import importlib
    import os

    import triton
    import triton.language as tl

    from hf_sparse import kernels
    from hf_sparse.kernels._common import check_append_inputs

    op = importlib.import_module("hf_sparse.kernels.quantize_append")  # (kernels.quantize_append is the op)

    @triton.jit
    def empty_kernel(x, n):  # noqa: ARG001 (a launch and nothing else)
        tl.program_id(0)

    device, heads, head_dim, capacity = "cuda", 3, 64, max(args.tokens) + 256  # SmolLM2-135M's K/V heads
    scratch = torch.zeros(16, device=device)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
    print("| tokens | call | host us per call |\n| ---: | --- | ---: |")
    for tokens in args.tokens:
        keys = torch.randn(1, heads, tokens, head_dim, device=device, dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        key_storage = torch.empty(1, heads, capacity, head_dim, device=device, dtype=torch.int8)
        value_storage = torch.empty_like(key_storage)
        key_scales = torch.zeros(1, heads, capacity, device=device)
        value_scales = torch.zeros_like(key_scales)
        append = (keys, values, key_storage, value_storage, key_scales, value_scales, 0)
        # name: (call, HF_SPARSE_DIRECT_LAUNCH while it is timed: "1" for the direct row, which is checked to
        # have launched directly, "0" for the JIT's, None to leave the caller's setting)
        calls = {
            "kernels.quantize_append (checks, device guard, launch)": (lambda: kernels.quantize_append(*append), None),
            "its Triton launch alone (direct)": (lambda: op.quantize_append(*append), "1"),
            "its Triton launch alone, through Triton's JIT": (lambda: op.quantize_append(*append), "0"),
            "its input checks alone": (lambda: check_append_inputs(*append), None),
            "an empty Triton kernel, two arguments": (lambda: empty_kernel[(1,)](scratch, 1), None),
            "torch add_": (lambda: scratch.add_(1), None),
            "torch.zeros of a scale storage": (lambda: torch.zeros(1, heads, capacity, device=device), None),
        }
        for name, (call, setting) in calls.items():
            previous, direct = os.environ.get("HF_SPARSE_DIRECT_LAUNCH"), op._LAUNCH.launches
            if setting is not None:
                os.environ["HF_SPARSE_DIRECT_LAUNCH"] = setting
            try:
                print(f"| {tokens} | {name} | {host_us(call, args.calls):.1f} |")
            finally:
                os.environ.pop("HF_SPARSE_DIRECT_LAUNCH", None)
                if previous is not None:
                    os.environ["HF_SPARSE_DIRECT_LAUNCH"] = previous
            if setting == "1" and op._LAUNCH.launches == direct:
                raise SystemExit("the direct launch did not run: the row above timed Triton's JIT")

if __name__ == "__main__":
    main()
