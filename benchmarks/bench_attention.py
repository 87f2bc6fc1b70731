"""Attention-level benchmark: dense SDPA, FlexAttention and hf_sparse (PLAS selection + Triton kernels).

Llama-3-8B attention shape: 32 query heads, 8 KV heads, head dim 128, bfloat16, batch 1 (decode also batch 8).
Prefill: causal, block 128, query tiles of 128, top-k 50..60 per query (PLASConfig's default, mean 55), one
sink block; FlexAttention runs the same block mask (built from our BlockSelection, the diagonal blocks
masked, the others full). Decode: one query, top-k 100..120 per query head, united over each GQA group.

Inputs: random q/k with the structure trained models show, so that a PLAS selection means something: each key
block has a random direction its keys lean to; queries lean to a "topic" direction shared by the heads of a
GQA group (plus a per-head part) that changes every 2048 tokens, with small per-token noise (5%). With i.i.d. random q/k
every block scores alike and the union over 128 queries is nearly dense; that density is printed too.

XAttention prefill (``--xattn [LENGTHS]``, default 32768 131072): the same structured inputs, selection by
``XAttnMethod.select_prefill`` (antidiagonal scores, Triton, + cumulative-mass threshold 0.9, PyTorch; stride 8,
block 128, gqa_reduce "any": one selection row per KV head), then the same sparse attention kernel; SDPA and
FlexAttention (same block mask) beside it. ``--xattn-sharpness S ...`` repeats them on inputs whose keys lean
harder to their block's direction (``structured_qkv``'s ``sharpness``; default 1), i.e. attention mass held by
fewer blocks, as in long-context models: the threshold then keeps fewer blocks.

Run on a GPU:  python benchmarks/bench_attention.py  [--tune] [--xattn [LENGTHS]] [--json out.json]
(``--prefill --decode --xattn`` runs the XAttention rows alone.)
Medians of triton.testing.do_bench (L2 flushed before every run). Prints one table.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import inspect
import json
import math
import sys

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from hf_sparse import kernels
from hf_sparse.kernels import reference as ref
from hf_sparse.selection import BlockSelection

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 128
PREFILL_TOP_K, DECODE_TOP_K = (50, 60), (100, 120)
DTYPE = torch.bfloat16


def median_ms(fn, min_reps: int = 10) -> float:
    """Median over at least ``min_reps`` timed runs (do_bench sizes its repeats from ``rep`` milliseconds)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    once = max(start.elapsed_time(end), 1e-3)
    return do_bench(fn, warmup=max(25, 2 * once), rep=max(100, min_reps * once), return_mode="median")


def structured_qkv(batch: int, num_queries: int, length: int, structured: bool, seed: int = 0,
                   sharpness: float = 1.0):
    """BNSD q [B, 32, Sq, 128] (the last Sq positions) and k, v [B, 8, L, 128] in bfloat16, on the GPU.
    ``sharpness`` scales the keys' lean to their block's direction: the standard deviation of the block part of
    the logits (1: about as large as the per-token part; larger: attention mass concentrated on fewer blocks)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dim, group = HEAD_DIM, Q_HEADS // KV_HEADS

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    keys = randn(batch, KV_HEADS, length, dim)
    query = randn(batch, Q_HEADS, num_queries, dim)
    if structured:
        blocks = triton.cdiv(length, BLOCK)
        block_dir = randn(batch, KV_HEADS, blocks, dim) / math.sqrt(dim)
        keys += sharpness * math.sqrt(dim) * block_dir.repeat_interleave(BLOCK, 2)[:, :, :length]
        topic_len = 2048
        topics = triton.cdiv(length, topic_len)
        shared = randn(batch, KV_HEADS, topics, dim).repeat_interleave(group, 1)
        own = randn(batch, Q_HEADS, topics, dim)
        topic_dir = (0.8 * shared + 0.6 * own) / math.sqrt(dim)
        positions = torch.arange(length - num_queries, length, device="cuda") // topic_len
        query = 0.05 * query + math.sqrt(dim) * topic_dir[:, :, positions]
    value = randn(batch, KV_HEADS, length, dim)
    return query.to(DTYPE), keys.to(DTYPE), value.to(DTYPE)


def graph_ms(fn) -> float:
    """Median of replays of ``fn`` captured in a CUDA graph: GPU time without Python launch overhead (as in
    a serving loop that captures the decode step). L2 is not flushed between replays."""
    try:
        fn()
        torch.cuda.synchronize()
        return do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as error:  # noqa: BLE001 - report, keep the other numbers
        print(f"graph capture failed: {type(error).__name__}: {error}", file=sys.stderr)
        return float("nan")


def best_sdpa(query, key, value, causal: bool, graph: bool = False):
    """(median ms, backend name) of the fastest SDPA backend that runs these inputs (GQA natively, else on
    K/V expanded to every query head outside the timing)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    results = []
    group = query.shape[1] // key.shape[1]
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        for gqa in (True, False):
            k, v = (key, value) if gqa else (key.repeat_interleave(group, 1), value.repeat_interleave(group, 1))

            def run(k=k, v=v, gqa=gqa, backend=backend):
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(query, k, v, is_causal=causal, enable_gqa=gqa)
            try:
                ms = graph_ms(run) if graph else median_ms(run, min_reps=5)
            except Exception:  # noqa: BLE001 - a backend that refuses these inputs is skipped
                continue
            if math.isnan(ms):
                continue
            results.append((ms, backend.name.lower().replace("_attention", "") + ("" if gqa else " (K/V expanded)")))
            break
        torch.cuda.empty_cache()
    return min(results)


def flex_block_mask(selection: BlockSelection, num_queries: int, length: int):
    """FlexAttention BlockMask with the same blocks: diagonal blocks partial (causal mask_mod), others full."""
    from torch.nn.attention.flex_attention import BlockMask

    num_blocks = triton.cdiv(length, BLOCK)
    mask = selection.to_mask(num_blocks)
    tiles = torch.arange(mask.shape[2], device=mask.device)[:, None]
    blocks = torch.arange(num_blocks, device=mask.device)[None, :]
    partial = BlockSelection.from_mask(mask & (blocks == tiles), BLOCK, BLOCK)
    full = BlockSelection.from_mask(mask & (blocks < tiles), BLOCK, BLOCK)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    kwargs = dict(BLOCK_SIZE=BLOCK, mask_mod=causal)
    parameters = inspect.signature(BlockMask.from_kv_blocks).parameters
    if "seq_lengths" in parameters:
        kwargs["seq_lengths"] = (num_queries, length)
    if "compute_q_blocks" in parameters:
        kwargs["compute_q_blocks"] = False
    return BlockMask.from_kv_blocks(partial.counts, partial.indices.clamp_min(0), full.counts, full.indices.clamp_min(0),
                                    **kwargs)


def prefill_row(length: int, flex, tune: bool) -> dict:
    query, key, value = structured_qkv(1, length, length, structured=True)
    kv_start = ref.note_range(torch.zeros(1, dtype=torch.int64, device="cuda"), 0, 0)
    scale = HEAD_DIM ** -0.5

    def summaries():
        return kernels.block_summaries(key, None, kv_start, BLOCK)

    def select(summ):
        return kernels.select_blocks(query, summ, scale=scale, q_offset=0, kv_start=kv_start, block_size=BLOCK,
                                     top_k=PREFILL_TOP_K, query_tile=BLOCK, head_union=False, sink_blocks=1)

    def attend(selection):
        return kernels.sparse_attention(query, key, value, selection, scale=scale, q_offset=0, kv_start=kv_start)

    summ = summaries()
    selection = select(summ)
    num_blocks = summ.shape[2]
    causal_blocks = (torch.arange(selection.num_query_tiles) + 1).sum().item() * Q_HEADS
    density = selection.counts.sum().item() / causal_blocks
    row = {"length": length, "density": density, "mean_blocks": selection.counts.float().mean().item()}
    row["summaries_ms"] = median_ms(summaries)
    row["select_ms"] = median_ms(lambda: select(summ))
    row["sparse_ms"] = median_ms(lambda: attend(selection))
    row["sparse_total_ms"] = median_ms(lambda: attend(select(summaries())))
    flops = 4 * BLOCK * BLOCK * HEAD_DIM * selection.counts.sum().item()
    row["sparse_tflops"] = flops / row["sparse_ms"] / 1e9
    row["sdpa_ms"], row["sdpa_backend"] = best_sdpa(query, key, value, causal=True)
    if flex is not None:
        block_mask = flex_block_mask(selection, length, length)
        row["flex_ms"] = median_ms(lambda: flex(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=True))
        del block_mask
    if tune:
        row["tuning"] = tune_prefill(selection, attend)
    # int8 K/V, values blocked (the int8 cache's layout) and token-major: the same selection's attention
    (key8, key_scale), (value8, value_scale) = ref.quantize_per_token(key), ref.quantize_per_token(value)
    for name, values in (("int8", ref.blocked_values(value8, BLOCK)), ("int8_tokens", value8)):
        row[f"sparse_{name}_ms"] = median_ms(lambda: kernels.sparse_attention(
            query, key8, values, selection, scale=scale, q_offset=0, kv_start=kv_start, key_scale=key_scale,
            value_scale=value_scale))
    del key8, value8, key_scale, value_scale, values
    # density of the same selection on i.i.d. random q/k (no structure): what the union does to it
    q_iid, k_iid, _ = structured_qkv(1, length, length, structured=False, seed=1)
    summ_iid = kernels.block_summaries(k_iid, None, kv_start, BLOCK)
    sel_iid = kernels.select_blocks(q_iid, summ_iid, scale=scale, q_offset=0, kv_start=kv_start, block_size=BLOCK,
                                    top_k=PREFILL_TOP_K, query_tile=BLOCK, head_union=False, sink_blocks=1)
    row["iid_density"] = sel_iid.counts.sum().item() / causal_blocks
    del query, key, value, q_iid, k_iid, selection, sel_iid, summ, summ_iid
    torch.cuda.empty_cache()
    return row


def xattn_row(length: int, flex, threshold: float = 0.9, stride: int = 8, sharpness: float = 1.0) -> dict:
    """XAttention prefill on the structured inputs: scoring (XAttnMethod.select_prefill) + sparse attention."""
    from hf_sparse.config import XAttnConfig
    from hf_sparse.methods.xattn import XAttnMethod

    query, key, value = structured_qkv(1, length, length, structured=True, sharpness=sharpness)
    # noted as the model path notes it (attention.py): no device-to-host read of kv_start per chunk
    kv_start = ref.note_range(torch.zeros(1, dtype=torch.int64, device="cuda"), 0, 0)
    scale = HEAD_DIM ** -0.5
    config = XAttnConfig(block_size=BLOCK, stride=stride, threshold=threshold)
    method = XAttnMethod(config)

    def select(q=query, k=key):
        return method.select_prefill(q, None, k, scale=scale, q_offset=0, kv_start=kv_start)

    def scores():  # the Triton scoring kernel alone, all tiles in one launch
        return kernels.antidiagonal_block_scores(query, key, scale=scale, q_offset=0, kv_start=kv_start,
                                                 block_size=BLOCK, stride=stride)

    def attend(selection):
        return kernels.sparse_attention(query, key, value, selection, scale=scale, q_offset=0, kv_start=kv_start)

    selection = select()
    num_tiles = selection.num_query_tiles
    causal_blocks = (torch.arange(num_tiles) + 1).sum().item() * KV_HEADS
    group = Q_HEADS // KV_HEADS
    row = {"method": "xattn", "length": length, "threshold": threshold, "stride": stride, "sharpness": sharpness,
           "density": selection.counts.sum().item() / causal_blocks,
           "mean_blocks": selection.counts.float().mean().item()}
    out, _ = attend(selection)
    if length <= 32768:  # the PyTorch reference on the same selection (too slow beyond)
        expected, _ = ref.sparse_attention(query[:, :, -2048:], key, value, selection_tail(selection, 2048, length),
                                           scale=scale, q_offset=length - 2048, kv_start=kv_start)
        tail = out[:, :, -2048:].float()
        row["rel_error_last_2048"] = ((tail - expected.float()).norm() / expected.float().norm()).item()
    del out
    row["score_kernel_ms"] = median_ms(scores)
    row["select_ms"] = median_ms(select)  # scores (in prefill_chunk pieces) + threshold + GQA union + indices
    row["sparse_ms"] = median_ms(lambda: attend(selection))
    row["sparse_total_ms"] = median_ms(lambda: attend(select()))
    flops = 4 * BLOCK * BLOCK * HEAD_DIM * selection.counts.sum().item() * group
    row["sparse_tflops"] = flops / row["sparse_ms"] / 1e9
    row["sdpa_ms"], row["sdpa_backend"] = best_sdpa(query, key, value, causal=True)
    if flex is not None:
        per_query_head = BlockSelection.from_mask(
            selection.to_mask(triton.cdiv(length, BLOCK)).repeat_interleave(group, 1), BLOCK, BLOCK)
        block_mask = flex_block_mask(per_query_head, length, length)
        row["flex_ms"] = median_ms(lambda: flex(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=True))
        del block_mask, per_query_head
    # density on i.i.d. random q/k (no structure)
    q_iid, k_iid, _ = structured_qkv(1, length, length, structured=False, seed=1)
    row["iid_density"] = select(q_iid, k_iid).counts.sum().item() / causal_blocks
    del query, key, value, q_iid, k_iid, selection
    torch.cuda.empty_cache()
    return row


def selection_tail(selection: BlockSelection, num_queries: int, length: int) -> BlockSelection:
    """The rows of the last ``num_queries`` queries (whole tiles) of a prefill selection."""
    first = (length - num_queries) // selection.query_tile
    return BlockSelection(selection.indices[:, :, first:], selection.counts[:, :, first:], selection.block_size,
                          selection.query_tile)


def tune_prefill(selection, attend) -> list:
    prefill_mod = importlib.import_module("hf_sparse.kernels.sparse_prefill")  # the module, not kernels.<op>

    saved = dict(prefill_mod.TUNING)
    results = []
    for block_n, warps, stages in ((64, 8, 3), (128, 8, 2), (64, 4, 3), (128, 8, 3), (64, 8, 4)):
        prefill_mod.TUNING.update(block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            results.append(((block_n, warps, stages), median_ms(lambda: attend(selection))))
        except Exception as error:  # noqa: BLE001 - a config that does not compile is reported, not fatal
            results.append(((block_n, warps, stages), f"failed: {type(error).__name__}"))
    prefill_mod.TUNING.clear()
    prefill_mod.TUNING.update(saved)
    return results


def tune_select(summ, select) -> list:
    select_mod = importlib.import_module("hf_sparse.kernels.select_blocks")

    saved = dict(select_mod.TUNING)
    results = []
    for per_program, per_warp, max_warps in ((16384, 1024, 16), (32768, 2048, 16), (8192, 1024, 8)):
        select_mod.TUNING.update(logits_per_program=per_program, logits_per_warp=per_warp, max_warps=max_warps)
        try:
            results.append(((per_program, per_warp, max_warps), median_ms(lambda: select(summ))))
        except Exception as error:  # noqa: BLE001
            results.append(((per_program, per_warp, max_warps), f"failed: {type(error).__name__}"))
    select_mod.TUNING.clear()
    select_mod.TUNING.update(saved)
    # where the time goes: the same launch with the threshold search skipped (scores, forced blocks, union)
    results.append(("no search", median_ms(lambda: select(summ, search_steps=0))))
    return results


def decode_row(length: int, batch: int, tune: bool) -> dict:
    query, key, value = structured_qkv(batch, 1, length, structured=True)
    kv_start = ref.note_range(torch.zeros(batch, dtype=torch.int64, device="cuda"), 0, 0)  # no host read in graphs
    scale = HEAD_DIM ** -0.5
    num_blocks = triton.cdiv(length, BLOCK)
    summ = kernels.block_summaries(key, None, kv_start, BLOCK)  # kept by the cache between steps

    def step():
        # what one decode step does per layer: the partial block's summary, the selection, the attention
        summ[:, :, num_blocks - 1:] = kernels.block_summaries(key, None, kv_start, BLOCK, num_blocks - 1, 1)
        selection = kernels.select_blocks(query, summ, scale=scale, q_offset=length - 1, kv_start=kv_start,
                                          block_size=BLOCK, top_k=DECODE_TOP_K, query_tile=1, head_union=True,
                                          sink_blocks=1, key_length=length)
        return kernels.sparse_attention(query, key, value, selection, scale=scale, q_offset=length - 1,
                                        kv_start=kv_start)

    selection = kernels.select_blocks(query, summ, scale=scale, q_offset=length - 1, kv_start=kv_start,
                                      block_size=BLOCK, top_k=DECODE_TOP_K, query_tile=1, head_union=True,
                                      sink_blocks=1, key_length=length)
    out, _ = step()
    expected, _ = ref.sparse_attention(query, key, value, selection, scale=scale, q_offset=length - 1, kv_start=kv_start)
    error = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
    blocks_read = selection.counts.sum().item()
    kv_bytes = blocks_read * BLOCK * HEAD_DIM * 2 * 2
    summary_bytes = summ.numel() * 4
    row = {"length": length, "batch": batch, "density": blocks_read / (batch * KV_HEADS * num_blocks),
           "mean_blocks": blocks_read / (batch * KV_HEADS), "rel_error": error}
    row["select_ms"] = median_ms(lambda: kernels.select_blocks(
        query, summ, scale=scale, q_offset=length - 1, kv_start=kv_start, block_size=BLOCK, top_k=DECODE_TOP_K,
        query_tile=1, head_union=True, sink_blocks=1, key_length=length))
    row["attend_ms"] = median_ms(lambda: kernels.sparse_attention(query, key, value, selection, scale=scale,
                                                                  q_offset=length - 1, kv_start=kv_start))
    row["sparse_total_ms"] = median_ms(step)
    row["sparse_gbps"] = (kv_bytes + summary_bytes) / row["sparse_total_ms"] / 1e6
    row["attend_gbps"] = kv_bytes / row["attend_ms"] / 1e6
    row["sdpa_ms"], row["sdpa_backend"] = best_sdpa(query, key, value, causal=False)
    row["sdpa_graph_ms"], row["sdpa_graph_backend"] = best_sdpa(query, key, value, causal=False, graph=True)
    row["sparse_graph_ms"] = graph_ms(step)
    row["select_graph_ms"] = graph_ms(lambda: kernels.select_blocks(
        query, summ, scale=scale, q_offset=length - 1, kv_start=kv_start, block_size=BLOCK, top_k=DECODE_TOP_K,
        query_tile=1, head_union=True, sink_blocks=1, key_length=length))
    row["attend_graph_ms"] = graph_ms(lambda: kernels.sparse_attention(query, key, value, selection, scale=scale,
                                                                       q_offset=length - 1, kv_start=kv_start))
    # int8 K/V (per-token scales, dequantised in the kernel): the same selection's attention, values blocked as
    # the int8 SparseCache stores them and token-major
    (key8, key_scale), (value8, value_scale) = ref.quantize_per_token(key), ref.quantize_per_token(value)
    int8 = dict(key_scale=key_scale, value_scale=value_scale)
    for name, values in (("int8", ref.blocked_values(value8, BLOCK)), ("int8_tokens", value8)):
        out8, _ = kernels.sparse_attention(query, key8, values, selection, scale=scale, q_offset=length - 1,
                                           kv_start=kv_start, **int8)
        row[f"{name}_rel_error"] = ((out8.float() - expected.float()).norm() / expected.float().norm()).item()
        row[f"attend_{name}_graph_ms"] = graph_ms(lambda: kernels.sparse_attention(
            query, key8, values, selection, scale=scale, q_offset=length - 1, kv_start=kv_start, **int8))
    row["int8_kv_bytes"] = blocks_read * BLOCK * (HEAD_DIM + 4) * 2
    del key8, value8, key_scale, value_scale, out8, values
    row["dense_bytes"] = batch * KV_HEADS * length * HEAD_DIM * 2 * 2
    row["kv_bytes"], row["summary_bytes"] = kv_bytes, summary_bytes
    row["sdpa_gbps"] = row["dense_bytes"] / row["sdpa_ms"] / 1e6
    if tune:
        row["tuning"] = tune_decode(query, key, value, selection, scale, length, kv_start)
    del query, key, value, summ, selection
    torch.cuda.empty_cache()
    return row


def tune_decode(query, key, value, selection, scale, length, kv_start) -> list:
    decode_mod = importlib.import_module("hf_sparse.kernels.sparse_decode")

    saved = dict(decode_mod.TUNING)
    results = []
    for block_n, warps, stages, per_sm in ((64, 4, 3, 2), (128, 4, 2, 2), (64, 4, 4, 4), (128, 8, 3, 2), (64, 4, 3, 1)):
        decode_mod.TUNING.update(block_n=block_n, num_warps=warps, num_stages=stages, programs_per_sm=per_sm)
        try:
            results.append(((block_n, warps, stages, per_sm), graph_ms(lambda: kernels.sparse_attention(
                query, key, value, selection, scale=scale, q_offset=length - 1, kv_start=kv_start))))
        except Exception as error:  # noqa: BLE001
            results.append(((block_n, warps, stages, per_sm), f"failed: {type(error).__name__}"))
    decode_mod.TUNING.clear()
    decode_mod.TUNING.update(saved)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", type=int, nargs="*", default=[8192, 32768, 131072])
    parser.add_argument("--decode", type=int, nargs="*", default=[32768, 131072])
    parser.add_argument("--decode-batches", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--xattn", type=int, nargs="*", default=None,
                        help="also XAttention prefill rows at these lengths (no value: 32768 131072)")
    parser.add_argument("--xattn-sharpness", type=float, nargs="+", default=[1.0],
                        help="XAttention rows on inputs of these key-block sharpnesses (structured_qkv; default 1)")
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument("--tune", action="store_true", help="also time kernel launch-setting variants")
    parser.add_argument("--json", help="write all numbers here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention.py measures GPU timings; no CUDA device found")
    flex = None
    if not args.no_flex:
        from torch.nn.attention.flex_attention import flex_attention
        flex = torch.compile(flex_attention)

    prefill_rows, decode_rows, xattn_rows = [], [], []
    for length in args.prefill:
        prefill_rows.append(prefill_row(length, flex, args.tune and length == args.prefill[-1]))
        print(json.dumps(prefill_rows[-1]), file=sys.stderr, flush=True)
    if args.tune and args.prefill:
        query, key, _ = structured_qkv(1, args.prefill[-1], args.prefill[-1], structured=True)
        kv_start = ref.note_range(torch.zeros(1, dtype=torch.int64, device="cuda"), 0, 0)
        summ = kernels.block_summaries(key, None, kv_start, BLOCK)
        prefill_rows[-1]["select_tuning"] = tune_select(summ, lambda s, search_steps=16: kernels.select_blocks(
            query, s, scale=HEAD_DIM ** -0.5, q_offset=0, kv_start=kv_start, block_size=BLOCK, top_k=PREFILL_TOP_K,
            query_tile=BLOCK, head_union=False, sink_blocks=1, search_steps=search_steps))
        print(json.dumps(prefill_rows[-1]["select_tuning"]), file=sys.stderr, flush=True)
        del query, key, summ
        torch.cuda.empty_cache()
    for length in ([32768, 131072] if args.xattn == [] else args.xattn or []):
        for sharpness in args.xattn_sharpness:
            xattn_rows.append(xattn_row(length, flex, sharpness=sharpness))
            print(json.dumps(xattn_rows[-1]), file=sys.stderr, flush=True)
    for length in args.decode:
        for batch in args.decode_batches:
            decode_rows.append(decode_row(length, batch, args.tune and length == args.decode[-1]))
            print(json.dumps(decode_rows[-1]), file=sys.stderr, flush=True)

    device = torch.cuda.get_device_name()
    header = (f"{device} | torch {torch.__version__} | triton {triton.__version__} | {datetime.date.today()} | "
              f"Llama-3-8B attention: {Q_HEADS} q heads, {KV_HEADS} kv heads, d={HEAD_DIM}, bf16, block {BLOCK}")
    print("\n" + header)
    if prefill_rows:
        print(f"prefill, batch 1, causal, top-k {PREFILL_TOP_K[0]}..{PREFILL_TOP_K[1]} per query, union over 128 "
              "queries; medians in ms")
        print(f"{'length':>7} {'density':>7} {'iid dens':>8} | {'SDPA':>8} {'backend':>7} | {'Flex':>7} | {'summ':>6} "
              f"{'select':>6} {'attend':>7} {'TFLOP/s':>7} {'total':>7} | {'SDPA/total':>10} {'total/Flex':>10} "
              f"{'Flex/attend':>11}")
    for r in prefill_rows:
        flex_ms = r.get("flex_ms", float("nan"))
        print(f"{r['length']:>7} {r['density']:>7.3f} {r['iid_density']:>8.3f} | {r['sdpa_ms']:>8.2f} "
              f"{r['sdpa_backend'][:7]:>7} | {flex_ms:>7.2f} | {r['summaries_ms']:>6.2f} {r['select_ms']:>6.2f} "
              f"{r['sparse_ms']:>7.2f} {r['sparse_tflops']:>7.0f} {r['sparse_total_ms']:>7.2f} | "
              f"{r['sdpa_ms'] / r['sparse_total_ms']:>9.2f}x {r['sparse_total_ms'] / flex_ms:>9.2f}x "
              f"{flex_ms / r['sparse_ms']:>10.2f}x")
    if xattn_rows:
        print("XAttention prefill, batch 1, causal, threshold 0.9, stride 8, one selection per KV head (any head of "
              "the group); medians in ms; score = Triton scoring kernel alone, select = select_prefill (scores in "
              "16K-query chunks + threshold + GQA union)")
        print(f"{'length':>7} {'sharp':>5} {'density':>7} {'iid dens':>8} | {'SDPA':>8} {'backend':>7} | "
              f"{'Flex':>7} | {'score':>6} {'select':>7} {'attend':>7} {'TFLOP/s':>7} {'total':>7} | {'SDPA/total':>10} "
              f"{'total/Flex':>10} {'select/attend':>13}")
        for r in xattn_rows:
            flex_ms = r.get("flex_ms", float("nan"))
            print(f"{r['length']:>7} {r['sharpness']:>5.1f} {r['density']:>7.3f} {r['iid_density']:>8.3f} | "
                  f"{r['sdpa_ms']:>8.2f} {r['sdpa_backend'][:7]:>7} | {flex_ms:>7.2f} | {r['score_kernel_ms']:>6.2f} "
                  f"{r['select_ms']:>7.2f} {r['sparse_ms']:>7.2f} {r['sparse_tflops']:>7.0f} {r['sparse_total_ms']:>7.2f} | "
                  f"{r['sdpa_ms'] / r['sparse_total_ms']:>9.2f}x {r['sparse_total_ms'] / flex_ms:>9.2f}x "
                  f"{r['select_ms'] / r['sparse_ms']:>12.2f}x")
    if decode_rows:
        print(f"decode, 1 query, top-k {DECODE_TOP_K[0]}..{DECODE_TOP_K[1]} per head, union over the GQA group; "
              "medians in us; GB/s on bytes actually read. eager: launched from Python, L2 flushed; "
              "graph: CUDA-graph replays (GPU time)")
        print(f"{'length':>7} {'batch':>5} {'density':>7} | {'SDPA':>7} {'GB/s':>5} {'sparse':>7} {'GB/s':>5} "
              f"{'ratio':>6} | {'SDPA':>7} {'GB/s':>5} {'select':>6} {'attend':>6} {'GB/s':>5} {'sparse':>7} {'GB/s':>5} "
              f"{'ratio':>6}")
        print(f"{'':>7} {'':>5} {'':>7} | {'eager':>35} | {'graph':>61}")
    for r in decode_rows:
        kv_total = r["kv_bytes"] + r["summary_bytes"]
        print(f"{r['length']:>7} {r['batch']:>5} {r['density']:>7.3f} | {r['sdpa_ms'] * 1e3:>7.1f} "
              f"{r['sdpa_gbps']:>5.0f} {r['sparse_total_ms'] * 1e3:>7.1f} {r['sparse_gbps']:>5.0f} "
              f"{r['sdpa_ms'] / r['sparse_total_ms']:>5.2f}x | {r['sdpa_graph_ms'] * 1e3:>7.1f} "
              f"{r['dense_bytes'] / r['sdpa_graph_ms'] / 1e6:>5.0f} {r['select_graph_ms'] * 1e3:>6.1f} "
              f"{r['attend_graph_ms'] * 1e3:>6.1f} {r['kv_bytes'] / r['attend_graph_ms'] / 1e6:>5.0f} "
              f"{r['sparse_graph_ms'] * 1e3:>7.1f} {kv_total / r['sparse_graph_ms'] / 1e6:>5.0f} "
              f"{r['sdpa_graph_ms'] / r['sparse_graph_ms']:>5.2f}x")
    if decode_rows:
        print("decode attention with int8 K/V (per-token scales, dequantised in the kernel), graph, us: bf16 attend "
              "-> int8 attend, values blocked as the int8 cache stores them (speed-up, GB/s on int8 bytes, error vs "
              "the bf16 reference); int8 with token-major values")
    for r in decode_rows:
        print(f"{r['length']:>7} {r['batch']:>5} {r['attend_graph_ms'] * 1e3:>7.1f} -> {r['attend_int8_graph_ms'] * 1e3:>7.1f} "
              f"({r['attend_graph_ms'] / r['attend_int8_graph_ms']:.2f}x, "
              f"{r['int8_kv_bytes'] / r['attend_int8_graph_ms'] / 1e6:.0f} GB/s, rel error {r['int8_rel_error']:.4f}); "
              f"token-major {r['attend_int8_tokens_graph_ms'] * 1e3:.1f} "
              f"({r['attend_graph_ms'] / r['attend_int8_tokens_graph_ms']:.2f}x)")
    if prefill_rows:
        print("prefill attention with int8 K/V, ms: bf16 attend -> int8 attend, values blocked (speed-up); token-major")
    for r in prefill_rows:
        print(f"{r['length']:>7} {r['sparse_ms']:>7.2f} -> {r['sparse_int8_ms']:>7.2f} "
              f"({r['sparse_ms'] / r['sparse_int8_ms']:.2f}x); token-major {r['sparse_int8_tokens_ms']:.2f} "
              f"({r['sparse_ms'] / r['sparse_int8_tokens_ms']:.2f}x)")
    if args.tune:
        for r in prefill_rows:
            if "tuning" in r:
                print(f"prefill {r['length']} attend (block_n, warps, stages) -> ms:", r["tuning"])
            if "select_tuning" in r:
                print(f"prefill {r['length']} select (logits/program, logits/warp, max warps) -> ms:", r["select_tuning"])
        for r in (r for r in decode_rows if "tuning" in r):
            print(f"decode {r['length']} x{r['batch']} attend, graph (block_n, warps, stages, programs/SM) -> ms:",
                  r["tuning"])
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": device, "header": header, "prefill": prefill_rows, "decode": decode_rows,
                       "xattn": xattn_rows}, handle, indent=1)


if __name__ == "__main__":
    main()
