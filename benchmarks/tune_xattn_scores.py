"""Launch settings of the XAttention scoring kernel: query groups and key groups per step, warps, stages, and
key steps per program (split).

Run on a GPU: ``python benchmarks/tune_xattn_scores.py [--lengths 32768 131072] [--settings 64,128,4,3 ...]
[--split-steps 4 8 16] [--rounds 3]``. For each setting, the whole
prompt scored in 16K-query chunks (as ``XAttnMethod.select_prefill`` does; bf16, 32 q / 8 KV heads, head dim
128, block 128, stride 8, the attention benchmark's structured inputs), the median of ``triton.testing.do_bench``
and the largest difference from the default setting's masses (a setting that computes something else shows).
A setting over the GPU's shared memory is halved by the launcher, as in normal use (the row shows the one asked
for). ``--split-steps`` times each setting with each number of key steps per program (default: the kernel's).
``--settings`` times only the listed ``rows,columns,warps,stages`` settings, ``--rounds`` times over, the
settings interleaved in each round (an A/B less exposed to drift than one sweep).
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton

from hf_sparse.kernels import xattn_scores

from bench_attention import BLOCK, HEAD_DIM, structured_qkv

STRIDE, CHUNK = 8, 16384


def score_all(query, key, kv_start, tiles):
    """Masses of every query tile, chunk by chunk (a list of [1, 32, chunk tiles, blocks] tensors)."""
    return [xattn_scores.antidiagonal_block_scores(query, key, scale=HEAD_DIM ** -0.5, q_offset=0, kv_start=kv_start,
                                                   block_size=BLOCK, stride=STRIDE, first_tile=first,
                                                   num_tiles=min(CHUNK // BLOCK, tiles - first))
            for first in range(0, tiles, CHUNK // BLOCK)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--settings", nargs="+", metavar="R,C,W,S",
                        help="rows,columns,warps,stages settings to time (default: the whole sweep)")
    parser.add_argument("--split-steps", type=int, nargs="+", help="key steps per program (default: the kernel's)")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    settings = ([tuple(int(v) for v in text.split(",")) for text in args.settings] if args.settings
                else list(itertools.product((64, 128), (64, 128, 256), (4, 8), (2, 3))))
    settings = [setting + (split,) for setting in settings
                for split in (args.split_steps or [xattn_scores._SPLIT_STEPS])]
    names = ("_ROWS", "_COLUMNS", "_WARPS", "_STAGES", "_SPLIT_STEPS")
    default = {name: getattr(xattn_scores, name) for name in names}
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | default "
          f"{default}")
    for length in args.lengths:
        query, key, _ = structured_qkv(1, length, length, structured=True)
        kv_start = torch.zeros(1, dtype=torch.int32, device="cuda")
        tiles = length // BLOCK
        expected = score_all(query, key, kv_start, tiles)
        print(f"\n{length} tokens\n{'rows':>5} {'columns':>7} {'warps':>5} {'stages':>6} {'split':>5} {'ms':>8} "
              f"{'max diff':>9}")
        for rows, columns, warps, stages, split in settings * args.rounds:
            for name, value in zip(names, (rows, columns, warps, stages, split)):
                setattr(xattn_scores, name, value)
            try:
                got = score_all(query, key, kv_start, tiles)
                diff = max(float((a - b).abs().max()) for a, b in zip(got, expected))
                ms = triton.testing.do_bench(lambda: score_all(query, key, kv_start, tiles), warmup=25,
                                             rep=200 if length < 100000 else 800)
                print(f"{rows:>5} {columns:>7} {warps:>5} {stages:>6} {split:>5} {ms:>8.2f} {diff:>9.1e}", flush=True)
            except Exception as error:  # noqa: BLE001 - a setting that does not launch is reported, not fatal
                print(f"{rows:>5} {columns:>7} {warps:>5} {stages:>6} {split:>5} failed: {type(error).__name__}",
                      flush=True)
        for name, value in default.items():
            setattr(xattn_scores, name, value)
        del query, key, expected
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
