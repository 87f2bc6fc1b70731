"""Launch settings of the split decode kernel, bf16 vs int8 K/V, and over every block (a dense layer of a
CUDA-graph decode step, bf16): splits, warps, key tile, stages.

Run on a GPU: ``python benchmarks/tune_decode.py [--lengths 131072] [--batches 1 8] [--kv bf16 int8 all]``
(each setting takes a list: ``--programs-per-sm 2 4 8 --max-splits 64 256 --warps 4 8 --block-n 64 128
--stages 2 3``). Prints CUDA-graph medians (us) of ``kernels.sparse_attention`` on one PLAS decode selection
per setting.
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton

from hf_sparse import kernels
from hf_sparse.kernels import reference as ref
from hf_sparse.kernels import sparse_decode
from hf_sparse.selection import BlockSelection

from bench_attention import BLOCK, DECODE_TOP_K, HEAD_DIM, graph_ms, structured_qkv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[131072])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--kv", nargs="+", default=["bf16", "int8", "all"], choices=["bf16", "int8", "all"])
    parser.add_argument("--programs-per-sm", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--max-splits", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--block-n", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    args = parser.parse_args()
    default, int8_default = dict(sparse_decode.TUNING), dict(sparse_decode.TUNING_INT8)
    sparse_decode.TUNING_INT8.clear()  # every setting below applies to int8 K/V too
    print(f"{torch.cuda.get_device_name()} | triton {triton.__version__} | default {default}, int8 {int8_default}")
    for length, batch in itertools.product(args.lengths, args.batches):
        query, key, value = structured_qkv(batch, 1, length, structured=True)
        kv_start = ref.note_range(torch.zeros(batch, dtype=torch.int64, device="cuda"), 0, 0)  # no host read in graphs
        scale = HEAD_DIM ** -0.5
        summ = kernels.block_summaries(key, None, kv_start, BLOCK)
        selection = kernels.select_blocks(query, summ, scale=scale, q_offset=length - 1, kv_start=kv_start,
                                          block_size=BLOCK, top_k=DECODE_TOP_K, query_tile=1, head_union=True,
                                          sink_blocks=1, key_length=length)
        (key8, key_scale), (value8, value_scale) = ref.quantize_per_token(key), ref.quantize_per_token(value)
        value8 = ref.blocked_values(value8, BLOCK)  # as the int8 cache stores them
        blocks = summ.shape[2]
        every_block = BlockSelection(  # the dense layer of a CUDA-graph decode step: all blocks, one row per KV head
            indices=torch.arange(blocks, dtype=torch.int32, device="cuda").expand(batch, key.shape[1], 1, blocks),
            counts=torch.full((batch, key.shape[1], 1), blocks, dtype=torch.int32, device="cuda"),
            block_size=BLOCK, query_tile=1)
        runs = {
            "bf16": lambda **kw: kernels.sparse_attention(query, key, value, selection, scale=scale,
                                                          q_offset=length - 1, kv_start=kv_start, **kw),
            "int8": lambda **kw: kernels.sparse_attention(query, key8, value8, selection, scale=scale,
                                                          q_offset=length - 1, kv_start=kv_start,
                                                          key_scale=key_scale, value_scale=value_scale, **kw),
            "all": lambda **kw: kernels.sparse_attention(query, key, value, every_block, scale=scale,
                                                         q_offset=length - 1, kv_start=kv_start, **kw),
        }
        print(f"\nlength {length}, batch {batch}, mean blocks per KV head {selection.counts.float().mean():.1f}")
        print(f"{'kv':>5} {'programs/SM':>11} {'max splits':>10} {'warps':>5} {'block_n':>7} {'stages':>6} {'us':>8}")
        runs = {name: run for name, run in runs.items() if name in args.kv}
        for programs_per_sm, max_splits, warps, block_n, stages in itertools.product(
                args.programs_per_sm, args.max_splits, args.warps, args.block_n, args.stages):
            sparse_decode.TUNING.update(programs_per_sm=programs_per_sm, max_splits=max_splits, num_warps=warps,
                                        block_n=block_n, num_stages=stages)
            for name, run in runs.items():
                us = graph_ms(run) * 1e3
                print(f"{name:>5} {programs_per_sm:>11} {max_splits:>10} {warps:>5} {block_n:>7} {stages:>6} {us:>8.1f}")
        sparse_decode.TUNING.clear()
        sparse_decode.TUNING.update(default)
        del query, key, value, key8, value8, summ, selection, every_block
        torch.cuda.empty_cache()
    sparse_decode.TUNING_INT8.update(int8_default)


if __name__ == "__main__":
    main()
