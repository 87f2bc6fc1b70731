"""Attention-level benchmark: hf_sparse's kernels beside dense SDPA (the fastest of cuDNN, flash and
memory-efficient) and FlexAttention on the same inputs, with the same block mask.

Shape (Llama-3-8B attention): 32 query heads, 8 KV heads, head dim 128, bfloat16, BNSD contiguous, block 128.
Prefill: batch 1, causal, query tiles of 128, PLAS top-k 55..66 for one query in 4 (PLASConfig's defaults) united
over each tile per query head, one sink block; FlexAttention (torch.compile) runs a BlockMask built from the same
BlockSelection, the diagonal blocks partial through a causal mask_mod. Decode: one query per sequence, top-k
100..120 per query head united over the GQA group, batch 1 and 8.

Inputs (``_common.structured_qkv``, seed 0): q/k with the structure of a trained model's, so that a selection
means something: each key block leans to a random direction; queries lean to a "topic" direction shared by the
heads of a GQA group (plus a per-head part) that changes every 2048 tokens, with 5% per-token noise. On i.i.d.
q/k every block scores alike and the union over 128 queries is nearly dense; that density is printed too
("iid density"). "density" = attended / causal blocks of the selection.

Tables (times: medians of triton.testing.do_bench, L2 flushed before each run; "graph": medians of CUDA-graph
replays, GPU time without Python launch overhead):
* PLAS prefill at each ``--prefill`` length: block summaries, selection, attention, and the three as one call
  sequence ("total"), against SDPA and Flex; the same selection's attention with int8 K/V (values blocked as the
  int8 cache stores them, and token-major).
* XAttention prefill (``--xattn [LENGTHS]``, default 32768 131072; ``--xattn-sharpness S ...``: inputs whose
  keys lean harder to their block, i.e. attention mass held by fewer blocks): ``XAttnMethod.select_prefill``
  (threshold 0.9, ``--xattn-stride``: the config's default, one selection row per KV head), the scoring kernel
  alone, then the same attention.
* PLAS decode at each ``--decode`` length and ``--decode-batches`` batch: one layer's decode step as the cache
  runs it (summary of the partial last block, selection, split-K attention), eager and graph, with int8 K/V.
* ``--tune``: launch settings (the ``TUNING`` dict of ``hf_sparse.kernels.sparse_prefill``, ``select_blocks``
  and ``sparse_decode``) swept at the last prefill and decode length, each setting beside the default;
  ``--tune-grid KERNEL.SETTING=V1,V2`` replaces one swept list (``decode.programs_per_sm=2,4``).

Studies, each run instead of the tables above:
* ``--crossover [LENGTHS]`` (default 32768 131072): where sparse prefill stops paying. Per attention shape
  (``--crossover-shapes``: Llama-3-8B, SmolLM2-135M) and length: cuDNN dense causal prefill, the PLAS and the
  XAttention prefill selections (their configs' defaults; their share of the dense time beside the methods'
  ``selection_share`` estimates), and ``sparse_attention`` over random block masks of each
  ``--crossover-densities`` density (diagonal and sink kept); then the densities where "attend alone" and
  "PLAS selection + attend" cost what cuDNN costs (linear interpolation).
* ``--int8-layouts [LENGTHS]`` (default 131072): decode attention graph time, bf16 vs int8 token-major vs int8
  blocked values, for rows with no padding, the same padding, and rows starting apart (left padding off the
  block grid), then the call a static cache makes (the whole storage, the valid length read on the device) with
  PLAS's selection and with every block (a dense layer of a CUDA-graph step); batches from ``--decode-batches``.
* ``--features [LENGTHS]`` (default 32768 131072): the cost of the model features the kernels compute beside
  the attention, on the prefill's PLAS selection and the decode's (batch ``--decode-batches``' first, CUDA-graph
  time): the attention alone, with Gemma 2's logit softcapping (``softcap=50``), with GPT-OSS's attention sinks
  (``sinks``, one logit per query head) and with both, each against the plain kernel, with its error against the
  PyTorch reference.
* ``--select-variant NAME=PATH`` (repeatable): A/B of copies of ``hf_sparse/kernels/select_blocks.py`` (e.g.
  ``git show HEAD~1:hf_sparse/kernels/select_blocks.py > old.py``) against the package's own, after checking
  that each gives the same selection; prefill at the ``--prefill`` lengths (plus the current kernel with its
  threshold search skipped) and decode (graph) at ``--decode`` x ``--decode-batches``, ``--select-rounds``
  rounds, the variants interleaved in each.
* ``--query-stride S[:SCALE] ...`` (e.g. ``8:1.3``): the prefill selection with only every S-th query of a tile
  searching (``PLASConfig.query_stride``) and top-k 50..60 scaled by SCALE, beside stride 1 at 50..60 (every
  query searching, FastDeploy's selection) at the ``--prefill`` lengths: density, selection and total (summaries,
  selection, attention) time against SDPA and FlexAttention with the same mask. ``4:1.1`` is PLASConfig's default.
* ``--key-scorer [RANK]`` (default 16, the rank ``fit-key-scorer`` writes): the prefill selection of
  :mod:`hf_sparse.key_scorer` (blocks ranked by their largest logit in ``RANK`` directions per KV head: random
  orthonormal ones here, so the density is the inputs', not a fitted scorer's) beside PLAS's mean pooling at the
  ``--prefill`` lengths: the scan alone (``kernels.pooled_block_logits`` of every searching query, one call), the
  whole selection as the model runs it (projections, scans in chunks, ``kernels.select_blocks_from_logits``), the
  attention and the total, against SDPA and FlexAttention with each row's own mask.

Commands (on a GPU):
    python benchmarks/bench_attention.py --xattn 32768 131072 --xattn-sharpness 1 4 [--json FILE]
    python benchmarks/bench_attention.py --tune --prefill 131072 --decode 131072
    python benchmarks/bench_attention.py --crossover
    python benchmarks/bench_attention.py --int8-layouts
    python benchmarks/bench_attention.py --features 32768 131072
    python benchmarks/bench_attention.py --select-variant before=old.py --prefill 32768 131072
    python benchmarks/bench_attention.py --query-stride 8 8:1.3 16:1.5 --prefill 32768 131072
    python benchmarks/bench_attention.py --key-scorer 16 --shape smollm2 --prefill 8192 32768 131072
Per-row numbers go to stderr as JSON while it runs; the tables come on stdout; ``--json FILE`` keeps them all.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import itertools
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from _common import (GEMMA2_9B_ATTENTION, LLAMA3_8B_ATTENTION, SMOLLM2_ATTENTION, best_sdpa, cell, environment,
                     graph_ms, header, median_ms, progress, require_cuda, speedup, structured_qkv, table, write_json)
from hf_sparse import kernels
from hf_sparse import key_scorer
from hf_sparse.config import PLASConfig, XAttnConfig
from hf_sparse.kernels import reference as ref, sparse_prefill
from hf_sparse.methods import METHODS
from hf_sparse.selection import BlockSelection, RowLayout

#: The attention shape of every table but the crossover study's (``--shape``).
SHAPE = LLAMA3_8B_ATTENTION
Q_HEADS, KV_HEADS, HEAD_DIM = SHAPE
BLOCK = 128
_DEFAULTS = PLASConfig()
DECODE_TOP_K, QUERY_STRIDE = _DEFAULTS.decode_top_k, _DEFAULTS.query_stride
#: The ``--query-stride`` study's base: every query searching at FastDeploy's top-k 50..60.
STRIDE_1_TOP_K = PLASConfig.FASTDEPLOY_PREFILL_TOP_K
CROSSOVER_SHAPES = {"llama3-8b": LLAMA3_8B_ATTENTION, "smollm2": SMOLLM2_ATTENTION,
                    "gemma2-9b": GEMMA2_9B_ATTENTION}  # Gemma 2's head dim 256, for --features (softcap)

#: ``--tune`` sweeps, per kernel module: every combination of these settings of its ``TUNING`` dict.
TUNE_GRIDS = {
    "sparse_prefill": {"block_m": [64, 128], "block_n": [64, 128], "num_warps": [4, 8], "num_stages": [2, 3, 4]},
    "select_blocks": {"logits_per_program": [8192, 16384, 32768], "logits_per_warp": [1024, 2048],
                      "max_warps": [8, 16]},
    "sparse_decode": {"programs_per_sm": [2, 4, 8], "max_splits": [64, 256], "num_warps": [4, 8],
                      "block_n": [64, 128], "num_stages": [2, 3]},
}
TUNE_ALIASES = {"prefill": "sparse_prefill", "select": "select_blocks", "decode": "sparse_decode"}


# -- the calls timed ------------------------------------------------------------------------------------------


def prefill_select(query, summaries, kv_start, op=kernels, top_k=None, query_stride=QUERY_STRIDE,
                   **options) -> BlockSelection:
    """PLAS prefill selection (``op``: the kernels' dispatch, or a module of ``select_blocks.py``'s launcher);
    ``top_k`` None: the defaults' range at this length (``PLASConfig.top_k``)."""
    top_k = top_k or _DEFAULTS.top_k("prefill", query.shape[2])
    return op.select_blocks(query, summaries, scale=query.shape[-1] ** -0.5, q_offset=0, kv_start=kv_start,
                            block_size=BLOCK, top_k=top_k, query_tile=BLOCK, head_union=False,
                            sink_blocks=1, query_stride=query_stride, **options)


def decode_select(query, summaries, kv_start, length: int, op=kernels) -> BlockSelection:
    """PLAS decode selection of one query at position ``length - 1``, united over each GQA group."""
    return op.select_blocks(query, summaries, scale=query.shape[-1] ** -0.5, q_offset=length - 1,
                            kv_start=kv_start, block_size=BLOCK, top_k=DECODE_TOP_K, query_tile=1, head_union=True,
                            sink_blocks=1, key_length=length)


def attend(query, key, value, selection, kv_start, q_offset: int = 0, **options):
    return kernels.sparse_attention(query, key, value, selection, scale=query.shape[-1] ** -0.5, q_offset=q_offset,
                                    kv_start=kv_start, **options)


def int8_kv(key, value, blocked: bool = True) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(int8 keys, int8 values, their per-token scales as ``sparse_attention`` keywords); values blocked as the
    int8 SparseCache stores them, or token-major."""
    (key8, key_scale), (value8, value_scale) = ref.quantize_per_token(key), ref.quantize_per_token(value)
    values = ref.blocked_values(value8, BLOCK) if blocked else value8
    return key8, values, {"key_scale": key_scale, "value_scale": value_scale}


def every_block(batch: int, heads: int, blocks: int, valid_blocks: int | None = None) -> BlockSelection:
    """A one-query-tile selection of every block (a dense layer of a CUDA-graph decode step)."""
    return BlockSelection(torch.arange(blocks, dtype=torch.int32, device="cuda").expand(batch, heads, 1, blocks),
                          torch.full((batch, heads, 1), valid_blocks or blocks, dtype=torch.int32, device="cuda"),
                          BLOCK, 1)


def relative_error(got, expected) -> float:
    return ((got.float() - expected.float()).norm() / expected.float().norm()).item()


def causal_tile_blocks(tiles: int) -> int:
    return tiles * (tiles + 1) // 2


def flex_block_mask(selection: BlockSelection, num_queries: int, length: int):
    """FlexAttention BlockMask with the same blocks: diagonal blocks partial (causal mask_mod), others full."""
    from torch.nn.attention.flex_attention import BlockMask

    num_blocks = -(-length // BLOCK)
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
    return BlockMask.from_kv_blocks(partial.counts, partial.indices.clamp_min(0), full.counts,
                                    full.indices.clamp_min(0), **kwargs)


def flex_ms(flex, query, key, value, selection: BlockSelection, length: int, score_mod=None) -> float:
    block_mask = flex_block_mask(selection, length, length)
    return median_ms(lambda: flex(query, key, value, block_mask=block_mask, score_mod=score_mod,
                                  scale=HEAD_DIM ** -0.5, enable_gqa=True))


def flex_softcap(cap: float):
    """FlexAttention ``score_mod`` of attention logit softcapping (``cap * tanh(score / cap)``)."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return score_mod


# -- launch-setting sweeps (--tune) ---------------------------------------------------------------------------


def tune_grids(overrides: list[str]) -> dict:
    """:data:`TUNE_GRIDS` with the ``KERNEL.SETTING=V1,V2`` overrides of ``--tune-grid``."""
    grids = {kernel: dict(grid) for kernel, grid in TUNE_GRIDS.items()}
    for text in overrides:
        try:
            name, values = text.split("=", 1)
            kernel, setting = name.split(".", 1)
            kernel = TUNE_ALIASES.get(kernel, kernel)
            grids[kernel][setting] = [int(value) for value in values.split(",")]
        except (ValueError, KeyError):
            raise SystemExit(f"--tune-grid {text!r}: expected KERNEL.SETTING=V1,V2 with KERNEL one of "
                             f"{sorted(TUNE_ALIASES)} and integer values") from None
    return grids


def sweep(kernel: str, grid: dict[str, list], timers: dict, saved_too: tuple[str, ...] = (),
          defaults: dict | None = None) -> list[dict]:
    """Every combination of ``grid`` written into ``hf_sparse.kernels.<kernel>.TUNING`` in turn (and into the
    module's dicts named in ``saved_too``, emptied meanwhile so the settings apply everywhere), each timed by
    every timer (a setting that does not compile or launch: its error); the dicts restored after. ``defaults``:
    the settings the kernel uses on these inputs, to mark (``TUNING`` when not given)."""
    module = importlib.import_module(f"hf_sparse.kernels.{kernel}")
    unknown = set(grid) - set(module.TUNING)
    if unknown:
        raise SystemExit(f"--tune: {kernel}.TUNING has no {sorted(unknown)} (it has {sorted(module.TUNING)})")
    saved = {name: dict(getattr(module, name)) for name in ("TUNING", *saved_too)}
    rows = []
    try:
        for name in saved_too:
            getattr(module, name).clear()
        for values in itertools.product(*grid.values()):
            setting = dict(zip(grid, values))
            module.TUNING.update(setting)
            used = defaults if defaults is not None else saved["TUNING"]
            row = {**setting, "default": all(used[key] == value for key, value in setting.items())}
            for label, timer in timers.items():
                try:
                    row[label] = timer()
                except Exception as error:  # noqa: BLE001 - a setting that fails is reported, not fatal
                    row[label] = f"failed: {type(error).__name__}"
            rows.append(row)
            progress(f"{kernel} {json.dumps(row)}")
    finally:
        for name, values in saved.items():
            getattr(module, name).clear()
            getattr(module, name).update(values)
    return rows


# -- the tables -----------------------------------------------------------------------------------------------


def prefill_row(length: int, flex, grids: dict | None) -> dict:
    query, key, value = structured_qkv(1, length, length, shape=SHAPE)
    kv_start = RowLayout.uniform(1, "cuda")

    def summaries():
        return kernels.block_summaries(key, None, kv_start, BLOCK)

    summ = summaries()
    selection = prefill_select(query, summ, kv_start)
    causal_blocks = causal_tile_blocks(selection.num_query_tiles) * Q_HEADS
    attended = selection.counts.sum().item()
    row = {"length": length, "density": attended / causal_blocks, "mean_blocks": selection.counts.float().mean().item()}
    row["summaries_ms"] = median_ms(summaries)
    row["select_ms"] = median_ms(lambda: prefill_select(query, summ, kv_start))
    row["attend_ms"] = median_ms(lambda: attend(query, key, value, selection, kv_start))
    row["total_ms"] = median_ms(lambda: attend(query, key, value, prefill_select(query, summaries(), kv_start),
                                               kv_start))
    row["attend_tflops"] = 4 * BLOCK * BLOCK * HEAD_DIM * attended / row["attend_ms"] / 1e9
    row["sdpa_ms"], row["sdpa_backend"] = best_sdpa(query, key, value, causal=True)
    if flex is not None:
        row["flex_ms"] = flex_ms(flex, query, key, value, selection, length)
    for name, blocked in (("int8", True), ("int8_tokens", False)):
        key8, values8, scales = int8_kv(key, value, blocked)
        row[f"attend_{name}_ms"] = median_ms(lambda: attend(query, key8, values8, selection, kv_start, **scales))
    if grids is not None:
        row["tune_attend"] = sweep("sparse_prefill", grids["sparse_prefill"],
                                   {"ms": lambda: median_ms(lambda: attend(query, key, value, selection, kv_start))},
                                   saved_too=("TUNING_SMALL_HEAD",), defaults=sparse_prefill.launch_settings(HEAD_DIM))
        row["tune_select"] = sweep("select_blocks", grids["select_blocks"],
                                   {"ms": lambda: median_ms(lambda: prefill_select(query, summ, kv_start))})
        # where the selection's time goes: the same launch with the threshold search skipped
        row["select_no_search_ms"] = median_ms(lambda: prefill_select(query, summ, kv_start, search_steps=0))
    q_iid, k_iid, _ = structured_qkv(1, length, length, structured=False, seed=1, shape=SHAPE)
    iid = prefill_select(q_iid, kernels.block_summaries(k_iid, None, kv_start, BLOCK), kv_start)
    row["iid_density"] = iid.counts.sum().item() / causal_blocks
    return row


def xattn_row(length: int, flex, sharpness: float, threshold: float = 0.9, stride: int | None = None) -> dict:
    """XAttention prefill on the structured inputs: scoring + threshold selection, then the sparse attention
    (``stride``: ``XAttnConfig``'s default when None)."""
    stride = XAttnConfig().stride if stride is None else stride
    query, key, value = structured_qkv(1, length, length, sharpness=sharpness, shape=SHAPE)
    kv_start = RowLayout.uniform(1, "cuda")
    method = METHODS["xattn"](XAttnConfig(block_size=BLOCK, stride=stride, threshold=threshold))
    group = Q_HEADS // KV_HEADS

    def select(q=query, k=key):
        return method.select_prefill(q, None, k, scale=HEAD_DIM ** -0.5, q_offset=0, kv_start=kv_start)

    def scores():  # the Triton scoring kernel alone, every tile in one launch
        return kernels.antidiagonal_block_scores(query, key, scale=HEAD_DIM ** -0.5, q_offset=0, kv_start=kv_start,
                                                 block_size=BLOCK, stride=stride)

    selection = select()
    causal_blocks = causal_tile_blocks(selection.num_query_tiles) * KV_HEADS
    attended = selection.counts.sum().item()
    row = {"length": length, "threshold": threshold, "stride": stride, "sharpness": sharpness,
           "density": attended / causal_blocks, "mean_blocks": selection.counts.float().mean().item()}
    if length <= 32768:  # the PyTorch reference on the last 2048 queries (too slow beyond)
        out, _ = attend(query, key, value, selection, kv_start)
        first_tile = (length - 2048) // BLOCK
        tail = BlockSelection(selection.indices[:, :, first_tile:], selection.counts[:, :, first_tile:], BLOCK, BLOCK)
        expected, _ = ref.sparse_attention(query[:, :, -2048:], key, value, tail, scale=HEAD_DIM ** -0.5,
                                           q_offset=length - 2048, kv_start=kv_start)
        row["rel_error_last_2048"] = relative_error(out[:, :, -2048:], expected)
    row["score_kernel_ms"] = median_ms(scores)
    row["select_ms"] = median_ms(select)  # scores in prefill_chunk pieces + threshold + GQA union + indices
    row["attend_ms"] = median_ms(lambda: attend(query, key, value, selection, kv_start))
    row["total_ms"] = median_ms(lambda: attend(query, key, value, select(), kv_start))
    row["attend_tflops"] = 4 * BLOCK * BLOCK * HEAD_DIM * attended * group / row["attend_ms"] / 1e9
    row["sdpa_ms"], row["sdpa_backend"] = best_sdpa(query, key, value, causal=True)
    if flex is not None:
        per_query_head = BlockSelection.from_mask(
            selection.to_mask(-(-length // BLOCK)).repeat_interleave(group, 1), BLOCK, BLOCK)
        row["flex_ms"] = flex_ms(flex, query, key, value, per_query_head, length)
    q_iid, k_iid, _ = structured_qkv(1, length, length, structured=False, seed=1, shape=SHAPE)
    row["iid_density"] = select(q_iid, k_iid).counts.sum().item() / causal_blocks
    return row


def decode_row(length: int, batch: int, grids: dict | None) -> dict:
    query, key, value = structured_qkv(batch, 1, length, shape=SHAPE)
    kv_start = RowLayout.uniform(batch, "cuda")  # nothing read back to the host inside a graph
    num_blocks = -(-length // BLOCK)
    summ = kernels.block_summaries(key, None, kv_start, BLOCK)  # kept by the cache between steps

    def step():
        # one decode step of one layer as the cache runs it: the partial block's summary, selection, attention
        summ[:, :, num_blocks - 1:] = kernels.block_summaries(key, None, kv_start, BLOCK, num_blocks - 1, 1)
        return attend(query, key, value, decode_select(query, summ, kv_start, length), kv_start, length - 1)

    selection = decode_select(query, summ, kv_start, length)
    expected, _ = ref.sparse_attention(query, key, value, selection, scale=HEAD_DIM ** -0.5, q_offset=length - 1,
                                       kv_start=kv_start)
    blocks_read = selection.counts.sum().item()
    row = {"length": length, "batch": batch, "density": blocks_read / (batch * KV_HEADS * num_blocks),
           "mean_blocks": blocks_read / (batch * KV_HEADS), "rel_error": relative_error(step()[0], expected),
           "kv_bytes": blocks_read * BLOCK * HEAD_DIM * 2 * 2, "summary_bytes": summ.numel() * 4,
           "dense_bytes": batch * KV_HEADS * length * HEAD_DIM * 2 * 2,
           "int8_kv_bytes": blocks_read * BLOCK * (HEAD_DIM + 4) * 2}
    calls = {"select": lambda: decode_select(query, summ, kv_start, length),
             "attend": lambda: attend(query, key, value, selection, kv_start, length - 1), "total": step}
    for name, call in calls.items():
        row[f"{name}_ms"] = median_ms(call)
        row[f"{name}_graph_ms"] = graph_ms(call)
    row["sdpa_ms"], row["sdpa_backend"] = best_sdpa(query, key, value, causal=False)
    row["sdpa_graph_ms"], row["sdpa_graph_backend"] = best_sdpa(query, key, value, causal=False, graph=True)
    int8_calls = {}
    for name, blocked in (("int8", True), ("int8_tokens", False)):
        key8, values8, scales = int8_kv(key, value, blocked)
        int8_calls[name] = (lambda key8=key8, values8=values8, scales=scales:
                            attend(query, key8, values8, selection, kv_start, length - 1, **scales))
        row[f"{name}_rel_error"] = relative_error(int8_calls[name]()[0], expected)
        row[f"attend_{name}_graph_ms"] = graph_ms(int8_calls[name])
    if grids is not None:
        every = every_block(batch, KV_HEADS, num_blocks)
        row["tune_attend"] = sweep("sparse_decode", grids["sparse_decode"], {
            "bf16 us": lambda: 1e3 * graph_ms(calls["attend"]), "int8 us": lambda: 1e3 * graph_ms(int8_calls["int8"]),
            "every block us": lambda: 1e3 * graph_ms(lambda: attend(query, key, value, every, kv_start, length - 1))},
            saved_too=("TUNING_INT8", "TUNING_SMALL_HEAD"))
    return row


def feature_rows(length: int, batch: int, flex) -> list[dict]:
    """Attention time with each feature against without, prefill (do_bench) and decode (graph); with ``flex``,
    FlexAttention's prefill with the same block mask, plain and capped (``score_mod``)."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    sinks = torch.randn(Q_HEADS, device="cuda", generator=gen)
    options = {"plain": {}, "softcap": {"softcap": 50.0}, "sinks": {"sinks": sinks},
               "both": {"softcap": 50.0, "sinks": sinks}}
    rows = []
    for phase in ("prefill", "decode"):
        num_queries, rows_batch = (length, 1) if phase == "prefill" else (1, batch)
        query, key, value = structured_qkv(rows_batch, num_queries, length, shape=SHAPE)
        kv_start = RowLayout.uniform(rows_batch, "cuda")
        summ = kernels.block_summaries(key, None, kv_start, BLOCK)
        if phase == "prefill":
            selection, q_offset, timer = prefill_select(query, summ, kv_start), 0, median_ms
        else:
            selection, q_offset, timer = decode_select(query, summ, kv_start, length), length - 1, graph_ms
        plain_ms = None
        for name, extra in options.items():
            call = (lambda extra=extra: attend(query, key, value, selection, kv_start, q_offset, **extra))
            got, _ = call()
            if phase == "decode" or length <= 32768:  # the reference's memory grows with the selection
                expected, _ = ref.sparse_attention(query, key, value, selection, scale=HEAD_DIM ** -0.5,
                                                   q_offset=q_offset, kv_start=kv_start, **extra)
                error = relative_error(got, expected)
            else:
                error = None
            ms = timer(call)
            plain_ms = plain_ms or ms
            rows.append({"phase": phase, "length": length, "batch": rows_batch, "feature": name, "ms": ms,
                         "vs_plain": ms / plain_ms, "rel_error": error})
            if flex is not None and phase == "prefill" and name in ("plain", "softcap"):
                rows[-1]["flex_ms"] = flex_ms(flex, query, key, value, selection, length,
                                              flex_softcap(extra["softcap"]) if extra else None)
            progress(json.dumps(rows[-1]))
    return rows


def print_features(rows: list[dict]) -> None:
    print(f"\nModel features in the attention kernels ({Q_HEADS} q / {KV_HEADS} KV heads, d {HEAD_DIM}, bf16, "
          "block 128, PLAS selections; prefill: do_bench median, decode: CUDA-graph replays; softcap 50, sinks: "
          "one random logit per query head; time vs the plain kernel; error vs the PyTorch reference)")
    print(table([("phase", lambda r: r["phase"]), ("length", lambda r: str(r["length"])),
                 ("batch", lambda r: str(r["batch"])), ("feature", lambda r: r["feature"]),
                 ("ms" , lambda r: f"{r['ms']:.3f}"), ("vs plain", lambda r: f"{r['vs_plain']:.3f}"),
                 ("rel error", lambda r: "-" if r["rel_error"] is None else f"{r['rel_error']:.1e}"),
                 ("Flex, same mask", lambda r: f"{r['flex_ms']:.3f}" if "flex_ms" in r else "-"),
                 ("ms / Flex", lambda r: f"{r['ms'] / r['flex_ms']:.3f}" if "flex_ms" in r else "-")], rows))


def print_tables(prefill_rows: list, xattn_rows: list, decode_rows: list) -> None:
    def ms(key, spec=".2f"):
        return lambda r: cell(r.get(key), spec)

    def us(key):
        return lambda r: cell(r.get(key, float("nan")) * 1e3, ".1f")

    def ratio(top, bottom):
        return lambda r: speedup(r.get(top, float("nan")) / r.get(bottom, float("nan")))

    def gbps(bytes_key, time_key):
        return lambda r: cell(r[bytes_key] / r[time_key] / 1e6, ".0f")

    shared = [("length", lambda r: str(r["length"])), ("density", ms("density", ".3f")),
              ("iid density", ms("iid_density", ".3f")), ("SDPA", ms("sdpa_ms")),
              ("backend", lambda r: r["sdpa_backend"]), ("Flex, same mask", ms("flex_ms"))]
    totals = [("total", ms("total_ms")), ("SDPA / total", ratio("sdpa_ms", "total_ms")),
              ("total / Flex", ratio("total_ms", "flex_ms")), ("attend TFLOP/s", ms("attend_tflops", ".0f"))]
    if prefill_rows:
        top_k = _DEFAULTS.prefill_top_k
        print(f"\nPLAS prefill, batch 1, causal, top-k {top_k[0]}..{top_k[1]} (times keys / "
              f"{_DEFAULTS.prefill_top_k_length} past that many) for one query in "
              f"{QUERY_STRIDE} united over {BLOCK} queries (ms); int8: the same selection with int8 K/V, values "
              "blocked / token-major")
        print(table(shared + [("summaries", ms("summaries_ms")), ("select", ms("select_ms")),
                              ("attend", ms("attend_ms"))] + totals
                    + [("int8 attend", ms("attend_int8_ms")), ("vs bf16", ratio("attend_ms", "attend_int8_ms")),
                       ("int8 token-major", ms("attend_int8_tokens_ms")),
                       ("vs bf16", ratio("attend_ms", "attend_int8_tokens_ms"))], prefill_rows))
    if xattn_rows:
        strides = "/".join(str(stride) for stride in sorted({row["stride"] for row in xattn_rows}))
        print(f"\nXAttention prefill, batch 1, causal, threshold 0.9, stride {strides}, one selection per KV head "
              "(ms); scoring = the Triton scoring kernel alone, select = select_prefill (scoring in 16K-query chunks, "
              "threshold, GQA union)")
        print(table(shared[:1] + [("sharpness", ms("sharpness", ".1f"))] + shared[1:]
                    + [("scoring", ms("score_kernel_ms")), ("select", ms("select_ms")), ("attend", ms("attend_ms"))]
                    + totals + [("scoring / attend", ratio("score_kernel_ms", "attend_ms")),
                                ("rel error, last 2048", ms("rel_error_last_2048", ".1e"))], xattn_rows))
    if decode_rows:
        print(f"\nPLAS decode, one query, top-k {DECODE_TOP_K[0]}..{DECODE_TOP_K[1]} per head united over the GQA "
              "group (us; GB/s on the bytes read). eager: launched from Python, L2 flushed; graph: CUDA-graph "
              "replays. int8: the attention with int8 K/V (graph; blocked values / token-major)")
        print(table([("length", lambda r: str(r["length"])), ("batch", lambda r: str(r["batch"])),
                     ("density", ms("density", ".3f")), ("eager SDPA", us("sdpa_ms")), ("eager total", us("total_ms")),
                     ("eager SDPA / total", ratio("sdpa_ms", "total_ms")), ("SDPA", us("sdpa_graph_ms")),
                     ("GB/s", gbps("dense_bytes", "sdpa_graph_ms")), ("select", us("select_graph_ms")),
                     ("attend", us("attend_graph_ms")), ("GB/s", gbps("kv_bytes", "attend_graph_ms")),
                     ("total", us("total_graph_ms")), ("SDPA / total", ratio("sdpa_graph_ms", "total_graph_ms")),
                     ("int8 attend", us("attend_int8_graph_ms")),
                     ("vs bf16", ratio("attend_graph_ms", "attend_int8_graph_ms")),
                     ("int8 GB/s", gbps("int8_kv_bytes", "attend_int8_graph_ms")),
                     ("int8 rel error", ms("int8_rel_error", ".4f")),
                     ("int8 token-major", us("attend_int8_tokens_graph_ms")),
                     ("vs bf16", ratio("attend_graph_ms", "attend_int8_tokens_graph_ms"))], decode_rows))
    for kind, rows in (("prefill", prefill_rows), ("decode", decode_rows)):
        for row in rows:
            where = f"{kind} {row['length']}" + (f" batch {row['batch']}" if "batch" in row else "")
            for key, what in (("tune_attend", "attention"), ("tune_select", "selection")):
                if key in row:
                    print_sweep(f"{where}: {what} by launch setting", row[key])
            if "select_no_search_ms" in row:
                print(f"{where}: selection with the threshold search skipped {row['select_no_search_ms']:.2f} ms")


def print_sweep(title: str, rows: list[dict]) -> None:
    settings = [key for key, value in rows[0].items() if isinstance(value, int) and not isinstance(value, bool)]
    times = [key for key in rows[0] if key not in settings and key != "default"]
    print(f"\n{title} (* = the default; ms unless named)")
    columns = [("", lambda r: "*" if r["default"] else "")]
    columns += [(key, lambda r, key=key: str(r[key])) for key in settings]
    columns += [(key, lambda r, key=key: cell(r[key], ".3f" if key == "ms" else ".1f")) for key in times]
    print(table(columns, rows))


# -- studies ----------------------------------------------------------------------------------------------------


def random_selection(q_heads: int, length: int, density: float, gen: torch.Generator) -> BlockSelection:
    """Per query head and tile: every causal block with probability ``density``, diagonal and sink always."""
    tiles = blocks = -(-length // BLOCK)
    tile_ids = torch.arange(tiles, device="cuda")[:, None]
    block_ids = torch.arange(blocks, device="cuda")[None, :]
    keep = torch.rand(1, q_heads, tiles, blocks, generator=gen, device="cuda") < density
    mask = (keep & (block_ids <= tile_ids)) | (block_ids == tile_ids) | (block_ids == 0)
    return BlockSelection.from_mask(mask, BLOCK, BLOCK)


def break_even(densities: list[float], ratios: list[float]) -> float:
    """Density where ``ratio`` (sparse / dense time) crosses 1 (linear interpolation; NaN when it does not)."""
    for (d0, r0), (d1, r1) in zip(zip(densities, ratios), zip(densities[1:], ratios[1:])):
        if r0 <= 1.0 <= r1:
            return d0 + (1.0 - r0) * (d1 - d0) / (r1 - r0)
    return float("nan")


def crossover_row(shape_name: str, length: int, densities: list[float]) -> dict:
    shape = CROSSOVER_SHAPES[shape_name]
    query, key, value = structured_qkv(1, length, length, structured=False, shape=shape)
    kv_start = RowLayout.uniform(1, "cuda")
    dense_ms, backend = best_sdpa(query, key, value, causal=True)
    # Every query searching: the selection cost PLASMethod.SELECTION_COST estimates (an upper bound at a stride).
    plas_ms = median_ms(lambda: prefill_select(query, kernels.block_summaries(key, None, kv_start, BLOCK), kv_start,
                                               query_stride=1))
    xattn = METHODS["xattn"](XAttnConfig())
    xattn_ms = median_ms(lambda: xattn.select_prefill(query, None, key, scale=shape.head_dim ** -0.5, q_offset=0,
                                                      kv_start=kv_start))
    row = {"shape": shape_name, "length": length, "dense_ms": dense_ms, "dense_backend": backend,
           "plas_select_ms": plas_ms, "xattn_select_ms": xattn_ms,
           "plas_share_estimate": METHODS["plas"](PLASConfig()).selection_share(length, shape.head_dim),
           "xattn_share_estimate": xattn.selection_share(length, shape.head_dim), "points": []}
    gen = torch.Generator(device="cuda").manual_seed(length + shape.head_dim)
    for target in densities:
        selection = random_selection(shape.q_heads, length, target, gen)
        causal = shape.q_heads * causal_tile_blocks(selection.num_query_tiles)
        attend_ms = median_ms(lambda: attend(query, key, value, selection, kv_start))
        row["points"].append({"density": selection.counts.sum().item() / causal, "attend_ms": attend_ms})
        progress(f"crossover {shape_name} {length} {json.dumps(row['points'][-1])}")
    measured = [point["density"] for point in row["points"]]
    attend_ratios = [point["attend_ms"] / dense_ms for point in row["points"]]
    row["break_even_attend"] = break_even(measured, attend_ratios)
    row["break_even_plas_total"] = break_even(measured, [ratio + plas_ms / dense_ms for ratio in attend_ratios])
    return row


def print_crossover(rows: list[dict]) -> None:
    for row in rows:
        shape = CROSSOVER_SHAPES[row["shape"]]
        print(f"\ncrossover, {row['shape']} ({shape.q_heads} q / {shape.kv_heads} KV heads, head dim {shape.head_dim}), "
              f"length {row['length']}: dense "
              f"{row['dense_backend']} {row['dense_ms']:.2f} ms; sparse_attention over random block masks (ms)")
        print(table([("density", lambda p: f"{p['density']:.3f}"), ("attend", lambda p: f"{p['attend_ms']:.2f}"),
                     ("attend / dense", lambda p: f"{p['attend_ms'] / row['dense_ms']:.3f}"),
                     ("(PLAS selection + attend) / dense",
                      lambda p: f"{(p['attend_ms'] + row['plas_select_ms']) / row['dense_ms']:.3f}")], row["points"]))
    print(f"\nbreak-even densities (sparse time = dense cuDNN time), bf16, batch 1, causal, block {BLOCK}; selections "
          "at their configs' defaults, their share of the dense time beside the methods' selection_share estimate")
    print(table([("shape", lambda r: r["shape"]), ("length", lambda r: str(r["length"])),
                 ("dense", lambda r: f"{r['dense_ms']:.2f}"),
                 ("PLAS selection", lambda r: f"{r['plas_select_ms']:.2f}"),
                 ("share (estimate)", lambda r: f"{r['plas_select_ms'] / r['dense_ms']:.3f} "
                                                f"({r['plas_share_estimate']:.3f})"),
                 ("XAttention selection", lambda r: f"{r['xattn_select_ms']:.2f}"),
                 ("share (estimate)", lambda r: f"{r['xattn_select_ms'] / r['dense_ms']:.3f} "
                                                 f"({r['xattn_share_estimate']:.3f})"),
                 ("break-even: attend alone", lambda r: cell(r["break_even_attend"], ".3f")),
                 ("break-even: PLAS selection + attend", lambda r: cell(r["break_even_plas_total"], ".3f"))], rows))


def layout_times(query, key, value, selection, **call) -> dict:
    """Graph medians (us) of the decode attention on one selection with bf16, int8 token-major and int8 blocked
    values."""
    times = {"bf16": graph_ms(lambda: attend(query, key, value, selection, **call)) * 1e3}
    for name, blocked in (("int8 token-major", False), ("int8 blocked", True)):
        key8, values8, scales = int8_kv(key, value, blocked)
        times[name] = graph_ms(lambda: attend(query, key8, values8, selection, **call, **scales)) * 1e3
    return times


def int8_layout_rows(length: int, batch: int) -> list[dict]:
    query, key, value = structured_qkv(batch, 1, length, shape=SHAPE)
    rows = []
    # rows at one start (none, or 256 slots of padding in each) and rows apart (batch 1: off the block grid)
    for case, starts in (("no padding", [0] * batch), ("padding 256 in every row", [256] * batch),
                         ("rows apart", [77] if batch == 1 else [(i * 977) % 3000 for i in range(batch)])):
        kv_start = RowLayout(torch.tensor(starts, device="cuda"), min(starts), max(starts))
        selection = decode_select(query, kernels.block_summaries(key, None, kv_start, BLOCK), kv_start, length)
        rows.append({"call": case, "length": length, "batch": batch, **layout_times(
            query, key, value, selection, kv_start=kv_start, q_offset=length - 1)})
        progress(f"int8 layouts {json.dumps(rows[-1])}")
    # the static cache's call: the whole storage, the valid slots (no multiple of 16) read on the device
    valid = length - 3
    capacity = -(-(length + 40) // BLOCK) * BLOCK
    keys = torch.zeros(batch, KV_HEADS, capacity, HEAD_DIM, dtype=key.dtype, device="cuda")
    values = torch.zeros_like(keys)
    keys[:, :, :length], values[:, :, :length] = key, value
    kv_start = RowLayout.uniform(batch, "cuda")
    plas = decode_select(query, kernels.block_summaries(keys[:, :, :valid], None, kv_start, BLOCK), kv_start, valid)
    every = every_block(batch, KV_HEADS, capacity // BLOCK, -(-valid // BLOCK))
    for case, selection in (("static call, PLAS selection", plas), ("static call, every block", every)):
        rows.append({"call": case, "length": length, "batch": batch, **layout_times(
            query, keys, values, selection, kv_start=kv_start, q_offset=0,
            length=torch.tensor([valid], device="cuda"))})
        progress(f"int8 layouts {json.dumps(rows[-1])}")
    return rows


def print_int8_layouts(rows: list[dict]) -> None:
    print("\nint8 decode attention by value layout and call (graph, us; speed-up vs bf16 on the same selection). "
          "rows apart: left padding off the block grid; static call: the whole storage, the valid length on the "
          "device; every block: a dense layer of a CUDA-graph decode step")
    columns = [("call", lambda r: r["call"]), ("length", lambda r: str(r["length"])),
               ("batch", lambda r: str(r["batch"])), ("bf16", lambda r: f"{r['bf16']:.1f}")]
    for name in ("int8 token-major", "int8 blocked"):
        columns.append((name, lambda r, name=name: f"{r[name]:.1f} ({speedup(r['bf16'] / r[name])})"))
    print(table(columns, rows))


def variant_module_name(name: str) -> str:
    return "hf_sparse.kernels._variant_" + "".join(c if c.isalnum() else "_" for c in name)


def load_select_variant(name: str, path: str, folder: Path):
    """A copy of ``select_blocks.py`` as a module of ``hf_sparse.kernels`` (its relative imports resolve there);
    its text is copied into ``folder`` first, so ``PATH`` may be a pipe (``<(git show REV:...)``)."""
    copy = folder / f"select_blocks_{len(list(folder.iterdir()))}.py"
    copy.write_text(Path(path).read_text())
    module_name = variant_module_name(name)
    spec = importlib.util.spec_from_file_location(module_name, copy)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def compare_variants(variants: dict, select, label: str, rounds: int, timer) -> list[dict]:
    """Check each variant's selection against the current one's, then time them, interleaved, ``rounds`` times."""
    base = select(variants["current"])
    rows = [{"call": label, "variant": name, "times": []} for name in variants]
    for row, op in zip(rows, variants.values()):
        got = select(op)
        row["equal"] = torch.equal(got.indices, base.indices) and torch.equal(got.counts, base.counts)
    for _ in range(rounds):
        for row, op in zip(rows, variants.values()):
            row["times"].append(timer(lambda: select(op)))
    for row in rows:
        row["median"] = statistics.median(row["times"])
        progress(f"select variant {json.dumps(row)}")
    return rows


def prefill_variant_rows(variants: dict, length: int, rounds: int) -> list[dict]:
    query, key, _ = structured_qkv(1, length, length, shape=SHAPE)
    kv_start = RowLayout.uniform(1, "cuda")
    summ = kernels.block_summaries(key, None, kv_start, BLOCK)
    label = f"prefill {length} (ms)"
    rows = compare_variants(variants, lambda op: prefill_select(query, summ, kv_start, op=op), label, rounds, median_ms)
    no_search = median_ms(lambda: prefill_select(query, summ, kv_start, search_steps=0))
    return rows + [{"call": label, "variant": "current, search skipped", "equal": None, "times": [no_search],
                    "median": no_search}]


def decode_variant_rows(variants: dict, length: int, batch: int, rounds: int) -> list[dict]:
    query, key, _ = structured_qkv(batch, 1, length, shape=SHAPE)
    kv_start = RowLayout.uniform(batch, "cuda")
    summ = kernels.block_summaries(key, None, kv_start, BLOCK)
    return compare_variants(variants, lambda op: decode_select(query, summ, kv_start, length, op=op),
                            f"decode {length} batch {batch} (us, graph)", rounds, lambda fn: 1e3 * graph_ms(fn))


def select_variants(specs: list[str], prefill_lengths: list[int], decode_lengths: list[int], batches: list[int],
                    rounds: int) -> list[dict]:
    folder = Path(tempfile.mkdtemp(prefix="select_variants_"))
    variants = {"current": importlib.import_module("hf_sparse.kernels.select_blocks")}
    rows = []
    try:
        for spec in specs:
            name, _, path = spec.partition("=")
            if not path or name == "current":
                raise SystemExit(f"--select-variant {spec!r}: expected NAME=PATH with NAME other than 'current'")
            variants[name] = load_select_variant(name, path, folder)
        for length in prefill_lengths:
            rows += fresh(prefill_variant_rows(variants, length, rounds))
        for length, batch in itertools.product(decode_lengths, batches):
            rows += fresh(decode_variant_rows(variants, length, batch, rounds))
    finally:
        for name in variants:
            sys.modules.pop(variant_module_name(name), None)
        shutil.rmtree(folder, ignore_errors=True)
    return rows


def print_select_variants(rows: list[dict]) -> None:
    print("\nselection kernel variants (hf_sparse/kernels/select_blocks.py copies), interleaved rounds")
    print(table([("call", lambda r: r["call"]), ("variant", lambda r: r["variant"]),
                 ("selection = current", lambda r: "-" if r["equal"] is None else str(r["equal"])),
                 ("median", lambda r: f"{r['median']:.2f}"),
                 ("rounds", lambda r: " / ".join(f"{t:.2f}" for t in r["times"]))], rows))


# -- main -------------------------------------------------------------------------------------------------------


def time_selection(row: dict, select, whole, selection: BlockSelection, qkv: tuple, kv_start, flex) -> dict:
    """``row`` with a prefill selection's times (ms): ``select`` (the selection), its attention, ``whole`` (the
    selection from scratch) then the attention as one call sequence ("total"), and FlexAttention over the same mask
    when ``flex`` is given."""
    query, key, value = qkv
    row["select_ms"] = median_ms(select)
    row["attend_ms"] = median_ms(lambda: attend(query, key, value, selection, kv_start))
    row["total_ms"] = median_ms(lambda: attend(query, key, value, whole(), kv_start))
    if flex is not None:
        row["flex_ms"] = flex_ms(flex, query, key, value, selection, key.shape[2])
    return row


#: The columns of :func:`time_selection`'s times beside SDPA's, in the studies' tables.
SELECTION_COLUMNS = [
    ("select", lambda r: cell(r["select_ms"], ".2f")), ("attend", lambda r: cell(r["attend_ms"], ".2f")),
    ("total", lambda r: cell(r["total_ms"], ".2f")), ("SDPA", lambda r: cell(r["sdpa_ms"], ".2f")),
    ("SDPA / total", lambda r: speedup(r["sdpa_ms"] / r["total_ms"])),
    ("Flex, same mask", lambda r: cell(r.get("flex_ms"), ".2f")),
    ("total / Flex", lambda r: speedup(r["total_ms"] / r["flex_ms"]) if "flex_ms" in r else "-")]


def stride_spec(value: str) -> tuple[int, float]:
    """argparse type of ``--query-stride``: "S" or "S:SCALE" (top-k scaled by SCALE)."""
    stride, _, scale = value.partition(":")
    try:
        spec = int(stride), float(scale or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected S or S:SCALE, e.g. 8 or 8:1.3") from None
    if spec[0] < 1 or spec[0] > BLOCK or spec[1] < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: S must be in [1, {BLOCK}] and SCALE >= 1")
    return spec


def query_stride_rows(length: int, specs: list[tuple[int, float]], flex, device: str = "cuda") -> list[dict]:
    """Prefill selection at each (stride, top-k scale) of ``specs`` after stride 1 (every query searching); with
    ``flex``, FlexAttention over each row's own block mask beside it."""
    query, key, value = structured_qkv(1, length, length, shape=SHAPE, device=device)
    kv_start = RowLayout.uniform(1, device)
    summ = kernels.block_summaries(key, None, kv_start, BLOCK)
    sdpa_ms, backend = best_sdpa(query, key, value, causal=True)
    rows = []
    for stride, scale in [(1, 1.0)] + [spec for spec in specs if spec != (1, 1.0)]:
        top_k = tuple(round(k * scale) for k in STRIDE_1_TOP_K)

        def select(summaries=summ, top_k=top_k, stride=stride):
            return prefill_select(query, summaries, kv_start, top_k=top_k, query_stride=stride)

        selection = select()
        row = {"length": length, "stride": stride, "top_k": top_k, "sdpa_ms": sdpa_ms, "sdpa_backend": backend,
               "density": selection.counts.sum().item() / (causal_tile_blocks(selection.num_query_tiles) * Q_HEADS)}
        rows.append(time_selection(row, select, lambda: select(kernels.block_summaries(key, None, kv_start, BLOCK)),
                                   selection, (query, key, value), kv_start, flex))
        progress(f"query stride {json.dumps(row)}")
    return rows


def print_query_strides(rows: list[dict]) -> None:
    print(f"\nPLAS prefill selection with one query in S searching per tile of {BLOCK} (PLASConfig.query_stride), "
          "top-k scaled (ms); total = summaries + selection + attention")
    print(table([("length", lambda r: str(r["length"])), ("S", lambda r: str(r["stride"])),
                 ("top-k", lambda r: f"{r['top_k'][0]}..{r['top_k'][1]}"),
                 ("density", lambda r: cell(r["density"], ".3f"))] + SELECTION_COLUMNS, rows))


def random_directions(rank: int, seed: int = 0) -> torch.Tensor:
    """``[KV_HEADS, rank, HEAD_DIM]`` float32 orthonormal directions per KV head (a key scorer's shape)."""
    gen = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(KV_HEADS, HEAD_DIM, rank, generator=gen))
    return basis.mT.contiguous()


def key_scorer_rows(length: int, rank: int, flex, device: str = "cuda") -> list[dict]:
    """PLAS's prefill selection by mean pooling and by the key scorer of ``rank`` random directions, each with its
    attention, against SDPA and FlexAttention over the row's own mask."""

    query, key, value = structured_qkv(1, length, length, shape=SHAPE, device=device)
    kv_start = RowLayout.uniform(1, device)
    directions = random_directions(rank).to(device)  # (a model keeps its directions on its device)
    scale = HEAD_DIM ** -0.5
    top_k = _DEFAULTS.top_k("prefill", length)
    sdpa_ms, backend = best_sdpa(query, key, value, causal=True)

    def pooled():
        return prefill_select(query, kernels.block_summaries(key, None, kv_start, BLOCK), kv_start)

    def scored():
        return key_scorer.select_prefill(query, key, directions, scale=scale, q_offset=0, kv_start=kv_start,
                                         block_size=BLOCK, top_k=top_k, query_tile=BLOCK, sink_blocks=1,
                                         search_steps=_DEFAULTS.search_steps, query_stride=QUERY_STRIDE)

    searching = ref.searching_queries(length, BLOCK, QUERY_STRIDE).to(query.device)
    projected_query, projected_key = key_scorer._projected(query, key, directions)
    projected_query = projected_query[:, :, searching].contiguous()

    def scan():
        return kernels.pooled_block_logits(projected_query, projected_key, BLOCK, scale, searching, "max")

    rows = []
    for scorer, select in (("mean pooling", pooled), (f"key scorer, rank {rank}", scored)):
        selection = select()
        row = {"length": length, "scorer": scorer, "rank": rank if select is scored else None, "top_k": top_k,
               "sdpa_ms": sdpa_ms, "sdpa_backend": backend,
               "density": selection.counts.sum().item() / (causal_tile_blocks(selection.num_query_tiles) * Q_HEADS)}
        if select is scored:
            row["scan_ms"] = median_ms(scan)
        rows.append(time_selection(row, select, select, selection, (query, key, value), kv_start, flex))
        progress(f"key scorer {json.dumps(row)}")
    return rows


def print_key_scorer(rows: list[dict]) -> None:
    print(f"\nPLAS prefill selection by mean pooling and by the key scorer (random orthonormal directions), one query "
          f"in {QUERY_STRIDE} searching, PLASConfig's top-k (ms); scan = pooled_block_logits of every searching query "
          "(one call); select = the whole selection (mean pooling: summaries + select_blocks); total = select + attend")
    print(table([("length", lambda r: str(r["length"])), ("scorer", lambda r: r["scorer"]),
                 ("top-k", lambda r: f"{r['top_k'][0]}..{r['top_k'][1]}"),
                 ("density", lambda r: cell(r["density"], ".3f")),
                 ("scan", lambda r: cell(r.get("scan_ms"), ".2f"))] + SELECTION_COLUMNS, rows))


def fresh(result):
    """``result`` of a row function, once the caching allocator has let go of the row's inputs."""
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", type=int, nargs="*", default=[8192, 32768, 131072],
                        help="PLAS prefill lengths (none: no prefill table) (default: %(default)s)")
    parser.add_argument("--decode", type=int, nargs="*", default=[32768, 131072],
                        help="decode lengths (none: no decode table) (default: %(default)s)")
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8], help="(default: %(default)s)")
    parser.add_argument("--xattn", type=int, nargs="*", metavar="LENGTH",
                        help="also XAttention prefill rows at these lengths (no value: 32768 131072)")
    parser.add_argument("--xattn-sharpness", type=float, nargs="+", default=[1.0],
                        help="XAttention rows on inputs of these key-block sharpnesses (default: %(default)s)")
    parser.add_argument("--xattn-stride", type=int, default=XAttnConfig().stride,
                        help="antidiagonal stride of the XAttention rows (default: %(default)s, XAttnConfig's)")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compilation takes a while)")
    parser.add_argument("--tune", action="store_true",
                        help="sweep the kernels' launch settings at the last prefill and decode length")
    parser.add_argument("--tune-grid", action="append", default=[], metavar="KERNEL.SETTING=V1,V2",
                        help="replace one swept list of --tune (KERNEL: prefill, select or decode); repeatable. "
                             + "; ".join(f"{kernel}: {grid}" for kernel, grid in TUNE_GRIDS.items()))
    parser.add_argument("--crossover", type=int, nargs="*", metavar="LENGTH",
                        help="study: the density where sparse prefill stops paying (no value: 32768 131072)")
    parser.add_argument("--crossover-shapes", nargs="+", choices=list(CROSSOVER_SHAPES),
                        default=["llama3-8b", "smollm2"])
    parser.add_argument("--crossover-densities", type=float, nargs="+",
                        default=[0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0], help="(default: %(default)s)")
    parser.add_argument("--int8-layouts", type=int, nargs="*", metavar="LENGTH",
                        help="study: int8 decode by value layout and call (no value: 131072)")
    parser.add_argument("--features", type=int, nargs="*", metavar="LENGTH",
                        help="study: softcap and attention sinks against the plain kernels (no value: 32768 131072)")
    parser.add_argument("--select-variant", action="append", default=[], metavar="NAME=PATH",
                        help="study: A/B of this copy of hf_sparse/kernels/select_blocks.py against the package's")
    parser.add_argument("--select-rounds", type=int, default=3, help="rounds of --select-variant (default: 3)")
    parser.add_argument("--query-stride", type=stride_spec, nargs="+", metavar="S[:SCALE]",
                        help="study: prefill selection with one query in S searching, top-k scaled by SCALE")
    parser.add_argument("--key-scorer", type=int, nargs="?", const=16, metavar="RANK",
                        help="study: the key scorer's prefill selection (RANK random directions, default 16) beside "
                             "mean pooling at the --prefill lengths")
    parser.add_argument("--json", help="write every number to this file")
    parser.add_argument("--shape", choices=list(CROSSOVER_SHAPES), default="llama3-8b",
                        help="attention shape of the tables and sweeps (default: %(default)s)")
    args = parser.parse_args()
    global SHAPE, Q_HEADS, KV_HEADS, HEAD_DIM
    SHAPE = CROSSOVER_SHAPES[args.shape]
    Q_HEADS, KV_HEADS, HEAD_DIM = SHAPE
    if args.key_scorer is not None and not 1 <= args.key_scorer <= HEAD_DIM:
        parser.error(f"--key-scorer {args.key_scorer}: the rank must be in [1, {HEAD_DIM}] (the head dim of "
                     f"--shape {args.shape})")
    grids = tune_grids(args.tune_grid) if args.tune else None
    require_cuda("bench_attention.py")
    env = environment()
    results = {"environment": env, "shape": {"q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                             "block": BLOCK, "dtype": "bfloat16"}}
    studies = (args.crossover is not None or args.int8_layouts is not None or args.select_variant
               or args.features is not None or args.query_stride or args.key_scorer is not None)
    flex = None
    if not args.no_flex:
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention)
    if args.features is not None:
        results["features"] = [row for length in args.features or [32768, 131072]
                                for row in fresh(feature_rows(length, args.decode_batches[0], flex))]
    if args.crossover is not None:
        results["crossover"] = [
            fresh(crossover_row(shape, length, args.crossover_densities))
            for shape, length in itertools.product(args.crossover_shapes, args.crossover or [32768, 131072])]
    if args.int8_layouts is not None:
        results["int8_layouts"] = [
            row for length, batch in itertools.product(args.int8_layouts or [131072], args.decode_batches)
            for row in fresh(int8_layout_rows(length, batch))]
    if args.select_variant:
        results["select_variants"] = select_variants(args.select_variant, args.prefill, args.decode,
                                                     args.decode_batches, args.select_rounds)
    if args.query_stride:
        results["query_stride"] = [row for length in args.prefill
                                   for row in fresh(query_stride_rows(length, args.query_stride, flex))]
    if args.key_scorer is not None:
        results["key_scorer"] = [row for length in args.prefill
                                 for row in fresh(key_scorer_rows(length, args.key_scorer, flex))]
    if not studies:
        results["prefill"], results["xattn"], results["decode"] = [], [], []
        for length in args.prefill:
            results["prefill"].append(fresh(prefill_row(length, flex, grids if length == args.prefill[-1] else None)))
            progress(f"prefill {json.dumps(results['prefill'][-1])}")
        for length in [32768, 131072] if args.xattn == [] else args.xattn or []:
            for sharpness in args.xattn_sharpness:
                results["xattn"].append(fresh(xattn_row(length, flex, sharpness, stride=args.xattn_stride)))
                progress(f"xattn {json.dumps(results['xattn'][-1])}")
        for length, batch in itertools.product(args.decode, args.decode_batches):
            results["decode"].append(fresh(decode_row(length, batch, grids if length == args.decode[-1] else None)))
            progress(f"decode {json.dumps(results['decode'][-1])}")
    print(f"\n{header(env)}\n{args.shape} attention: {Q_HEADS} query heads, {KV_HEADS} KV heads, head dim {HEAD_DIM}, "
          f"bfloat16, block {BLOCK}; structured inputs (seed 0)")
    print_tables(results.get("prefill", []), results.get("xattn", []), results.get("decode", []))
    if "crossover" in results:
        print_crossover(results["crossover"])
    if "int8_layouts" in results:
        print_int8_layouts(results["int8_layouts"])
    if "select_variants" in results:
        print_select_variants(results["select_variants"])
    if "features" in results:
        print_features(results["features"])
    if "query_stride" in results:
        print_query_strides(results["query_stride"])
    if "key_scorer" in results:
        print_key_scorer(results["key_scorer"])
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
