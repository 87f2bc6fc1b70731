"""Density at which the sparse prefill stops paying: sparse attention (and PLAS selection) vs dense cuDNN.

Run on a GPU: ``python benchmarks/density_crossover.py [--lengths 32768 131072] [--shapes llama smollm2]``.
For each attention shape and length: cuDNN dense causal prefill, the PLAS prefill selection (summaries +
select_blocks, defaults of PLASConfig), the XAttention prefill selection (``XAttnMethod.select_prefill``,
defaults of XAttnConfig), and ``kernels.sparse_attention`` over random block masks of a given density (each
causal block of each query head's tile kept with probability p; diagonal and sink blocks always). Prints medians
(ms), each selection's share of the dense time (what ``selection_share`` of the methods estimates), and the
densities where attend alone, and PLAS selection + attend, cost what cuDNN costs (linear interpolation): the
first is the break-even after a selection is made, the second before it.
"""
from __future__ import annotations

import argparse

import torch
import triton

from hf_sparse import kernels
from hf_sparse.config import PLASConfig, XAttnConfig
from hf_sparse.methods import METHODS
from hf_sparse.selection import BlockSelection

from bench_attention import best_sdpa, median_ms

SHAPES = {"llama": (32, 8, 128), "smollm2": (9, 3, 64)}  # query heads, KV heads, head dim
BLOCK, TILE, TOP_K = 128, 128, (50, 60)
DENSITIES = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def random_selection(q_heads: int, length: int, density: float, gen: torch.Generator) -> BlockSelection:
    """Per query head and tile: every causal block with probability ``density``, diagonal and sink always."""
    tiles = blocks = triton.cdiv(length, BLOCK)
    tile_ids = torch.arange(tiles, device="cuda")[:, None]
    block_ids = torch.arange(blocks, device="cuda")[None, :]
    keep = torch.rand(1, q_heads, tiles, blocks, generator=gen, device="cuda") < density
    mask = (keep & (block_ids <= tile_ids)) | (block_ids == tile_ids) | (block_ids == 0)
    return BlockSelection.from_mask(mask, BLOCK, TILE)


def crossover(densities: list[float], ratios: list[float]) -> float:
    """Density where ``ratio`` (sparse / dense time) crosses 1 (linear interpolation; nan when it does not)."""
    for (d0, r0), (d1, r1) in zip(zip(densities, ratios), zip(densities[1:], ratios[1:])):
        if r0 <= 1.0 <= r1:
            return d0 + (1.0 - r0) * (d1 - d0) / (r1 - r0)
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--densities", type=float, nargs="+", default=list(DENSITIES))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("density_crossover.py measures GPU timings; no CUDA device found")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | bf16, "
          f"block {BLOCK}, tiles of {TILE}, PLAS selection top-k {TOP_K[0]}..{TOP_K[1]}")
    summary = []
    for shape in args.shapes:
        q_heads, kv_heads, dim = SHAPES[shape]
        for length in args.lengths:
            gen = torch.Generator(device="cuda").manual_seed(length + dim)
            query = torch.randn(1, q_heads, length, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
            key = torch.randn(1, kv_heads, length, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
            value = torch.randn_like(key)
            # noted as the model path notes it: no device-to-host read of kv_start in the timed calls
            kv_start = kernels.reference.note_range(torch.zeros(1, dtype=torch.int64, device="cuda"), 0, 0)
            scale = dim ** -0.5
            dense_ms, backend = best_sdpa(query, key, value, causal=True)

            def select():
                summ = kernels.block_summaries(key, None, kv_start, BLOCK)
                return kernels.select_blocks(query, summ, scale=scale, q_offset=0, kv_start=kv_start,
                                             block_size=BLOCK, top_k=TOP_K, query_tile=TILE, head_union=False,
                                             sink_blocks=1)
            select_ms = median_ms(select)
            xattn = METHODS["xattn"](XAttnConfig())
            xattn_ms = median_ms(lambda: xattn.select_prefill(query, None, key, scale=scale, q_offset=0,
                                                              kv_start=kv_start))
            plas_share = select_ms / dense_ms
            estimate = METHODS["plas"](PLASConfig()).selection_share(length, dim), xattn.selection_share(length, dim)
            print(f"\n{shape} ({q_heads} q / {kv_heads} KV heads, d {dim}), length {length}: dense {backend} "
                  f"{dense_ms:.2f} ms, PLAS selection {select_ms:.2f} ms ({plas_share:.3f} of dense, estimate "
                  f"{estimate[0]:.3f}), XAttention selection {xattn_ms:.2f} ms ({xattn_ms / dense_ms:.3f}, estimate "
                  f"{estimate[1]:.3f})")
            print(f"{'density':>7} {'attend ms':>9} {'attend/dense':>12} {'(sel+attend)/dense':>18}")
            measured, attend_ratios, total_ratios = [], [], []
            for target in args.densities:
                selection = random_selection(q_heads, length, target, gen)
                causal = q_heads * (selection.num_query_tiles * (selection.num_query_tiles + 1) // 2)
                density = selection.counts.sum().item() / causal
                attend_ms = median_ms(lambda: kernels.sparse_attention(query, key, value, selection, scale=scale,
                                                                       q_offset=0, kv_start=kv_start))
                measured.append(density)
                attend_ratios.append(attend_ms / dense_ms)
                total_ratios.append((select_ms + attend_ms) / dense_ms)
                print(f"{density:>7.3f} {attend_ms:>9.2f} {attend_ratios[-1]:>12.3f} {total_ratios[-1]:>18.3f}")
                del selection
            summary.append((shape, length, crossover(measured, attend_ratios), crossover(measured, total_ratios),
                            plas_share, xattn_ms / dense_ms))
            del query, key, value
            torch.cuda.empty_cache()
    print("\nbreak-even density (sparse time = dense cuDNN time)")
    print(f"{'shape':>8} {'length':>7} {'attend only':>11} {'select + attend':>15} | selection / dense: "
          f"{'PLAS':>6} {'XAttention':>10}")
    for shape, length, attend_only, total, plas_share, xattn_share in summary:
        print(f"{shape:>8} {length:>7} {attend_only:>11.3f} {total:>15.3f} | {'':>18} {plas_share:>6.3f} "
              f"{xattn_share:>10.3f}")


if __name__ == "__main__":
    main()
