"""Union-sparse prefill attention: each query tile attends to the key blocks its selection row lists.

Semantics: :func:`hf_sparse.kernels.reference.sparse_attention`. One program computes ``BLOCK_M`` rows: the
queries of one tile (or a part of it) times the query heads that share a selection row and a KV head, so
with one row per KV head (head union) each selected K/V block is loaded once for the whole GQA group.
Online softmax in base 2, float32 accumulation. Selected ids are ascending, so the blocks that every query
of the program sees in full come first (found by a binary search over the row): they run without any
mask; only the remaining (diagonal, or past the end) blocks evaluate the causal and length masks.

Programs run KV head by KV head, heaviest tile first, the query heads of a tile side by side: the blocks
that neighbouring tiles and the heads of a GQA group select overlap, and are then read from L2, not HBM.
Leading padding queries of left-padded rows get zeros and log-sum-exp ``-inf``, as in the reference.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from triton.runtime.errors import OutOfResources

from ..selection import BlockSelection, RowLayout, row_starts
from ._common import (FIXED_MAX_HEADROOM, attention_outputs, cdiv, dot_settings, fixed_max, next_power_of_2,
                      softcap_mode, softcap_sink_args, value_args, values_aligned, wide_offsets)

#: Launch settings of the prefill kernel (H100 / H200 defaults; benchmarks/bench_attention.py --tune tries others).
#: Head dim 128 (Llama-3-8B shape, H100, 32K): one warp group over 64-key steps, two programs per SM that overlap
#: one's softmax with the other's matrix products: plain 7.93 ms, capped 7.92, against 8.48 / 9.64 with 8 warps over
#: 128-key steps in 3 stages (docs/benchmarks.md, "Softcapping and attention sinks").
TUNING = {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 2}
#: What differs for int8 K/V at head dims past 64: 8 warps over 128-key steps in 3 stages (Llama-3-8B shape, 32K:
#: 13.05 ms against 14.48 with TUNING's settings).
TUNING_INT8 = {"block_n": 128, "num_warps": 8, "num_stages": 3}
#: What differs for head dims of at most 64 (SmolLM2's): 128-key steps in 3 stages (SmolLM2 shape, H100, 32K / 128K:
#: plain 1.42 / 6.54 ms against 1.42 / 6.71, capped 1.55 / 7.27 against 1.72 / 7.98 with 64-key steps in 2 stages).
TUNING_SMALL_HEAD = {"block_n": 128, "num_warps": 4, "num_stages": 3}
#: What differs for int8 K/V at head dims of at most 64: 64-key steps in 2 stages (1.8x faster than 128-key steps).
TUNING_SMALL_HEAD_INT8 = {"block_n": 64, "num_warps": 4, "num_stages": 2}


def launch_settings(head_dim: int, quantized: bool = False) -> dict[str, int]:
    """The launch settings for queries / keys of ``head_dim`` (values: the larger of the two head dims);
    ``quantized``: int8 K/V."""
    if head_dim > 64:
        return {**TUNING, **(TUNING_INT8 if quantized else {})}
    return {**TUNING, **TUNING_SMALL_HEAD, **(TUNING_SMALL_HEAD_INT8 if quantized else {})}


def launch_configs(dot_fp32: bool, head_dim: int, block_size: int,
                   quantized: bool = False) -> list[tuple[int, int, int]]:
    """``(block_m, block_n, num_stages)`` to try in order: the tuned one, then smaller shared-memory footprints
    (float32 operands and head dims past 128 need 2-4x the bytes per tile)."""
    configs = []
    if not (dot_fp32 or head_dim > 128):
        tuned = launch_settings(head_dim, quantized)
        configs.append((tuned["block_m"], tuned["block_n"], tuned["num_stages"]))
    configs += [(64, 64, 2), (64, 32, 2), (64, 32, 1), (32, 16, 1)]
    return [(m, min(n, block_size), stages) for m, n, stages in configs if block_size % min(n, block_size) == 0]


def queries_per_program(heads: int, query_tile: int, block_m: int) -> int:
    """Queries of one tile that a program of ``block_m`` rows takes, for each of its ``heads`` query heads."""
    return max(1, min(next_power_of_2(query_tile), block_m // heads))


def program_heads(heads_per_row: int, query_tile: int, block_m: int) -> int:
    """Query heads of one selection row (a GQA group's, for a selection per KV head) that one program takes
    together, each with at least 16 rows: the divisor of ``heads_per_row`` that computes the fewest rows per tile
    (heads x queries rounded up to a power of two and to the 64 rows of one warp group's MMA, times the programs a
    tile needs), the most heads among equals (they share each K/V block load). Three heads per row (SmolLM2) in 128
    rows: three heads of 42 queries need four programs per tile of 128 queries (512 rows for 384), one head of 128
    queries three (384); for a tile of 16 queries the three heads share one program of 64 rows."""
    def rows_per_tile(heads: int) -> int:
        queries = queries_per_program(heads, query_tile, block_m)
        rows = max(64, next_power_of_2(heads * queries))
        return (heads_per_row // heads) * cdiv(query_tile, queries) * rows

    fitting = [heads for heads in range(1, heads_per_row + 1)
               if heads_per_row % heads == 0 and heads * 16 <= block_m] or [1]
    return min(fitting, key=lambda heads: (rows_per_tile(heads), -heads))


@triton.jit
def _tanh(x, MODE: tl.constexpr):
    """``tanh(x)`` for attention logit softcapping (``MODE``: ``_common.SOFTCAP_EXACT`` or ``SOFTCAP_FAST``).
    Exact: written with ``exp2`` so that it also runs in the interpreter, ``1 - 2 / (2^(2x log2 e) + 1)``, exact at
    both ends (the power overflowing to inf gives 1, underflowing to 0 gives -1). Fast: the GPU's
    ``tanh.approx.f32``."""
    if MODE == 2:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        # a division without IEEE rounding (a few ulp): the precise division of fp32 `/` is a long instruction
        # sequence per score, which made the capped kernel half again as slow.
        return 1.0 - tl.fdiv(2.0, tl.exp2(x * 2.8853900817779268) + 1.0, ieee_rounding=False)


@triton.jit
def _soft_cap(scores, cap, MODE: tl.constexpr):
    """``cap * tanh(scores / cap)`` (attention logit softcapping, :func:`_tanh`). The base-2 scores of the kernels
    take the cap times log2(e) (``_common.softcap_sink_args``)."""
    return cap * _tanh(scores * (1.0 / cap), MODE)


@triton.jit
def _sink_scale(out, lse, SINKS, head, head_ok):
    """``out * sigmoid(lse - sink[head])`` per row: a finished output with a zero-valued key of logit ``sink``
    added to its softmax (``reference.attention_sinks``); rows that saw no key (lse -inf) stay zero."""
    sink = tl.load(SINKS + head, mask=head_ok, other=0.0)
    return out * (1.0 / (1.0 + tl.exp(sink - lse)))[:, None]


@triton.jit
def _attend_entries(
    acc, l_i, m_i, q, q_slot, row_ok,
    idx_ptr, stride_ik, first_entry, last_entry,
    k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd, stride_vblk,
    kv_start, key_length, scale_log2, ks_base, vs_base, stride_kss, stride_vss, alibi_log2, softcap_log2,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    MASKED: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, WIDE_OFFSETS: tl.constexpr,
    ROW_SCALE: tl.constexpr, QUANT: tl.constexpr, ALIBI: tl.constexpr, V_BLOCK: tl.constexpr, V_ALIGNED: tl.constexpr,
    SOFTCAP: tl.constexpr, FIXED_MAX: tl.constexpr,
):
    """Online-softmax attention of ``q`` over the row blocks listed in entries ``[first_entry, last_entry)``.

    Without ``MASKED`` every slot of every listed block must be visible to every row. With ``ROW_SCALE``
    ``scale_log2`` is a ``[BLOCK_M]`` vector (a scale per row: logN scaling), else a scalar. With ``QUANT``
    K/V are int8 with a float32 scale per slot (``ks_base`` / ``vs_base``): int8 values are exact in the dot
    dtype, so a key's scale multiplies its score column and a value's scale the probability column that
    weights it; no dequantised tile is formed. With ``ALIBI`` ``alibi_log2`` ``[BLOCK_M]`` holds each row's
    slope times log2(e), and ``slope * (key slot - query slot)`` is added to the (base-2) scores. With ``SOFTCAP``
    the scaled scores are capped (``cap * tanh(score / cap)``, cap ``softcap_log2``; the cap folded into the
    softmax's max and exponent where no bias comes between) before the bias and the masks. With ``FIXED_MAX``
    (a cap and no bias: ``_common.fixed_max``) no capped score exceeds the cap, and the softmax subtracts the
    constant ``cap - FIXED_MAX_HEADROOM`` instead of a running row maximum: no maximum, no rescaling.
    With ``V_BLOCK`` (> 0) the values are blocked (``reference.blocked_values``): slot ``s`` of channel ``d``
    at ``(s // V_BLOCK) * stride_vblk + d * stride_vd + (s % V_BLOCK) * stride_vs``; with ``V_ALIGNED`` every
    row starts at a multiple of ``BLOCK_N`` (and ``V_BLOCK`` is one), so a tile's slots are contiguous.
    """
    kv_tile = kv_start // BLOCK_N  # V_ALIGNED: the row's first tile of BLOCK_N slots
    m_fixed = softcap_log2 - FIXED_MAX_HEADROOM  # FIXED_MAX: the softmax's constant maximum
    if SOFTCAP:
        # Capped scores are cap * tanh(score / cap): the score's scale and 1 / cap are one factor, and (without a
        # bias between) the cap multiplies inside the softmax's max and exp2 argument (fewer operations per score).
        scale_log2 = scale_log2 * (1.0 / softcap_log2)
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < HEAD_DIM_V
    # One K/V tile of BLOCK_N slots per step (a block of BLOCK_SIZE is BLOCK_SIZE // BLOCK_N steps): one tile's
    # loads in flight per pipeline stage, as few registers as the plain loop over tiles.
    for step in range(first_entry * (BLOCK_SIZE // BLOCK_N), last_entry * (BLOCK_SIZE // BLOCK_N)):
        i = step // (BLOCK_SIZE // BLOCK_N)
        n0 = (step % (BLOCK_SIZE // BLOCK_N)) * BLOCK_N
        block = tl.load(idx_ptr + i * stride_ik)
        if V_ALIGNED:  # the same slot, written so that the compiler sees a multiple of BLOCK_N (wide masked loads)
            first = kv_tile * BLOCK_N + block * BLOCK_SIZE
        else:
            first = kv_start + block * BLOCK_SIZE
        slots = first + n0 + tl.arange(0, BLOCK_N)
        if WIDE_OFFSETS:
            slot_offs = slots.to(tl.int64)
        else:
            slot_offs = slots
        k_ptrs = k_base + slot_offs[None, :] * stride_ks + offs_d[:, None] * stride_kd
        if V_BLOCK == 0:
            v_ptrs = v_base + slot_offs[:, None] * stride_vs + offs_dv[None, :] * stride_vd
        elif V_ALIGNED:
            tile = kv_tile + block * (BLOCK_SIZE // BLOCK_N) + n0 // BLOCK_N
            in_block = (tile % (V_BLOCK // BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)
            storage_block = tile // (V_BLOCK // BLOCK_N)
            if WIDE_OFFSETS:
                storage_block = storage_block.to(tl.int64)
            v_ptrs = (v_base + storage_block * stride_vblk + in_block[:, None] * stride_vs
                      + offs_dv[None, :] * stride_vd)
        else:
            v_ptrs = (v_base + (slot_offs // V_BLOCK)[:, None] * stride_vblk
                      + (slot_offs % V_BLOCK)[:, None] * stride_vs + offs_dv[None, :] * stride_vd)
        if MASKED:
            n_ok = slots < key_length
            k = tl.load(k_ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
            if V_ALIGNED:
                # One mask for the tile (it lies in one stored block, which exists when it starts before the
                # length) keeps the loads wide; slots past the length hold finite int8 that probability 0 weights.
                tile_in = (tl.zeros([BLOCK_N], tl.int32) + (first + n0)) < key_length
                v = tl.load(v_ptrs, mask=tile_in[:, None] & dv_ok[None, :], other=0.0)
            else:
                v = tl.load(v_ptrs, mask=n_ok[:, None] & dv_ok[None, :], other=0.0)
        elif D_PAD == HEAD_DIM and DV_PAD == HEAD_DIM_V:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=dv_ok[None, :], other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        elif QUANT:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if QUANT:
            if MASKED:
                k_scale = tl.load(ks_base + slot_offs * stride_kss, mask=n_ok, other=0.0)
                v_scale = tl.load(vs_base + slot_offs * stride_vss, mask=n_ok, other=0.0)
            else:
                k_scale = tl.load(ks_base + slot_offs * stride_kss)
                v_scale = tl.load(vs_base + slot_offs * stride_vss)
        if ROW_SCALE:
            scores = tl.dot(q, k, input_precision=PRECISION) * scale_log2[:, None]
        else:
            scores = tl.dot(q, k, input_precision=PRECISION) * scale_log2
        if QUANT:
            scores = scores * k_scale[None, :]
        cap = 1.0  # what the scores are in units of: the cap while it is folded into the softmax below
        if SOFTCAP:
            scores = _tanh(scores, SOFTCAP)
            if ALIBI:
                scores = scores * softcap_log2
            else:
                cap = softcap_log2
        if ALIBI:
            scores += alibi_log2[:, None] * (slots[None, :] - q_slot[:, None]).to(tl.float32)
        if MASKED:
            visible = n_ok[None, :] & (slots[None, :] <= q_slot[:, None]) & row_ok[:, None]
            scores = tl.where(visible, scores, float("-inf"))
        if FIXED_MAX:  # capped scores are at most `cap`: a constant in place of the running maximum
            p = tl.exp2(scores * cap - m_fixed)
            l_i = l_i + tl.sum(p, 1)
            if QUANT:
                p = p * v_scale[None, :]
            acc = acc + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        else:
            m_new = tl.maximum(m_i, tl.max(scores, 1) * cap)
            if MASKED:
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_use = m_new
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(scores * cap - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if QUANT:
                p = p * v_scale[None, :]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
    if FIXED_MAX:
        m_i = tl.zeros_like(l_i) + m_fixed
    return acc, l_i, m_i


@triton.jit
def _finish(acc, l_i, m_i):
    """Normalised output and natural-log LSE; rows that saw no key give zeros and ``-inf``."""
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    return out, lse


@triton.jit
def _sparse_prefill_kernel(
    Q, K, V, OUT, LSE, INDICES, COUNTS, KV_START, SKIP, K_SCALE, V_SCALE, ALIBI_SLOPES, SINKS,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd, stride_vblk,
    stride_ksb, stride_ksh, stride_kss, stride_vsb, stride_vsh, stride_vss,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_lb, stride_lh, stride_ls,
    stride_ib, stride_ih, stride_it, stride_ik,
    stride_cb, stride_ch, stride_ct,
    num_queries, key_length, q_offset, scale_log2, inv_log_base, softcap_log2, num_tiles, num_slots,
    KV_HEADS: tl.constexpr, PROGS_PER_KV: tl.constexpr, HEAD_GROUPS: tl.constexpr, HEADS_PER_ROW: tl.constexpr,
    HEADS_PER_PROG: tl.constexpr, GROUP: tl.constexpr,
    QUERY_TILE: tl.constexpr, QUERIES_PER_PROG: tl.constexpr, SUBTILES: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, ENTRY_SEARCH: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, WIDE_OFFSETS: tl.constexpr,
    LOGN: tl.constexpr, HAS_SKIP: tl.constexpr, QUANT: tl.constexpr, ALIBI: tl.constexpr,
    V_BLOCK: tl.constexpr, V_ALIGNED: tl.constexpr, SOFTCAP: tl.constexpr, FIXED_MAX: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    # One flat grid, K/V-locality first: per (batch, KV head) all its slots, heaviest tile first, and per slot
    # the programs of the group's query heads next to each other (they share K/V blocks through L2).
    pid = tl.program_id(0)
    group_prog = pid % PROGS_PER_KV
    slot = num_slots - 1 - (pid // PROGS_PER_KV) % num_slots
    kv_row = pid // (PROGS_PER_KV * num_slots)
    b = kv_row // KV_HEADS
    head_prog = (kv_row % KV_HEADS) * PROGS_PER_KV + group_prog
    sel_head = head_prog // HEAD_GROUPS
    first_head = sel_head * HEADS_PER_ROW + (head_prog % HEAD_GROUPS) * HEADS_PER_PROG
    kv_head = first_head // GROUP
    b64 = b.to(tl.int64)

    kv_start = tl.load(KV_START + b).to(tl.int32)
    pad_q = tl.minimum(tl.maximum(kv_start - q_offset, 0), num_queries)
    rows = tl.arange(0, BLOCK_M)
    head = first_head + rows // QUERIES_PER_PROG
    head_ok = rows < HEADS_PER_PROG * QUERIES_PER_PROG
    num_tiles_run = num_tiles
    if HAS_SKIP:  # a skipped row: no loads, no stores, its outputs keep their contents
        skipped = tl.load(SKIP + b).to(tl.int32)
        head_ok = head_ok & (rows * 0 + skipped == 0)
        num_tiles_run = tl.where(skipped == 0, num_tiles, 0)
    offs_dv = tl.arange(0, DV_PAD)
    out_rows = OUT + b64 * stride_ob + head.to(tl.int64) * stride_oh
    lse_rows = LSE + b64 * stride_lb + head * stride_lh

    # Leading padding queries (no tile covers them): zeros and -inf, chunk `slot` of them.
    pad_query = slot * QUERIES_PER_PROG + rows % QUERIES_PER_PROG
    is_pad = head_ok & (pad_query < pad_q)
    tl.store(out_rows[:, None] + pad_query[:, None].to(tl.int64) * stride_os + offs_dv[None, :] * stride_od,
             tl.zeros([BLOCK_M, DV_PAD], tl.float32).to(OUT.dtype.element_ty),
             mask=is_pad[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
    tl.store(lse_rows + pad_query * stride_ls, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=is_pad)

    tile = slot // SUBTILES
    if tile < num_tiles_run:
        first_in_tile = (slot % SUBTILES) * QUERIES_PER_PROG
        in_tile = first_in_tile + rows % QUERIES_PER_PROG
        query = pad_q + tile * QUERY_TILE + in_tile
        row_ok = head_ok & (in_tile < QUERY_TILE) & (query < num_queries)
        q_slot = q_offset + query
        offs_d = tl.arange(0, D_PAD)
        q = tl.load(Q + b64 * stride_qb + head[:, None].to(tl.int64) * stride_qh + query[:, None].to(tl.int64) * stride_qs
                    + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        if LOGN:  # Qwen's logN: scores of row position n (1-based) times max(1, log(n) / log(m))
            position = tl.maximum(q_slot - kv_start + 1, 1).to(tl.float32)
            row_scale = scale_log2 * tl.maximum(tl.log(position) * inv_log_base, 1.0)
        else:
            row_scale = scale_log2
        if ALIBI:
            alibi_log2 = tl.load(ALIBI_SLOPES + head, mask=head_ok, other=0.0) * 1.4426950408889634
        else:
            alibi_log2 = 0.0

        idx_ptr = INDICES + b64 * stride_ib + sel_head * stride_ih + tile * stride_it
        count = tl.load(COUNTS + b * stride_cb + sel_head * stride_ch + tile * stride_ct)
        # Blocks ending at or before the program's first query slot (and inside the keys) need no mask.
        first_slot = q_offset + pad_q + tile * QUERY_TILE + first_in_tile
        full_limit = tl.minimum(first_slot + 1, key_length) - kv_start  # row-relative slots [0, full_limit)
        last_full = tl.where(full_limit >= 0, full_limit // BLOCK_SIZE, 0) - 1
        low = count * 0
        high = count
        for _ in tl.static_range(ENTRY_SEARCH):
            mid = (low + high) // 2
            probe = tl.load(idx_ptr + mid * stride_ik, mask=low < high, other=0)
            go_right = (low < high) & (probe <= last_full)
            go_left = (low < high) & (probe > last_full)
            low = tl.where(go_right, mid + 1, low)
            high = tl.where(go_left, mid, high)
        num_full = low

        k_base = K + b64 * stride_kb + kv_head.to(tl.int64) * stride_kh
        v_base = V + b64 * stride_vb + kv_head.to(tl.int64) * stride_vh
        ks_base = K_SCALE + b64 * stride_ksb + kv_head.to(tl.int64) * stride_ksh
        vs_base = V_SCALE + b64 * stride_vsb + kv_head.to(tl.int64) * stride_vsh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
        acc, l_i, m_i = _attend_entries(
            acc, l_i, m_i, q, q_slot, row_ok, idx_ptr, stride_ik, 0, num_full,
            k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd, stride_vblk, kv_start, key_length, row_scale,
            ks_base, vs_base, stride_kss, stride_vss, alibi_log2, softcap_log2,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, HEAD_DIM_V, D_PAD, DV_PAD, False, DOT_FP32, PRECISION, WIDE_OFFSETS, LOGN,
            QUANT, ALIBI, V_BLOCK, V_ALIGNED, SOFTCAP, FIXED_MAX)
        acc, l_i, m_i = _attend_entries(
            acc, l_i, m_i, q, q_slot, row_ok, idx_ptr, stride_ik, num_full, count,
            k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd, stride_vblk, kv_start, key_length, row_scale,
            ks_base, vs_base, stride_kss, stride_vss, alibi_log2, softcap_log2,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, HEAD_DIM_V, D_PAD, DV_PAD, True, DOT_FP32, PRECISION, WIDE_OFFSETS, LOGN,
            QUANT, ALIBI, V_BLOCK, V_ALIGNED, SOFTCAP, FIXED_MAX)
        out, lse = _finish(acc, l_i, m_i)
        if HAS_SINKS:
            out = _sink_scale(out, lse, SINKS, head, row_ok)
        tl.store(out_rows[:, None] + query[:, None].to(tl.int64) * stride_os + offs_dv[None, :] * stride_od,
                 out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
        tl.store(lse_rows + query * stride_ls, lse, mask=row_ok)


def sparse_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    selection: BlockSelection,
    *,
    scale: float,
    q_offset: int,
    kv_start: torch.Tensor | RowLayout,
    logn_base: int | None = None,
    skip: torch.Tensor | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`hf_sparse.kernels.reference.sparse_attention` for any selection.

    Returns ``(out [B, Hq, Sq, Dv]`` in the query dtype, ``lse [B, Hq, Sq]`` float32); ``out`` / ``lse`` are
    written in place when given (any strides). Every element of the rows not in ``skip`` is written; the
    rows in ``skip`` are not touched. ``softcap`` caps the scores in the inner loop, ``sinks`` rescale the
    finished output (the lse stays that of the real keys).
    """
    out, lse, inv_log_base, skip_flags, key_scale, value_scale, slopes = attention_outputs(
        query, key, value, selection, kv_start, logn_base, skip, key_scale, value_scale, alibi_slopes, out, lse)
    softcap_log2, sink_logits = softcap_sink_args(softcap, sinks, query)
    batch, q_heads, num_queries, head_dim = query.shape
    kv_heads, key_length, head_dim_v = key.shape[1], key.shape[2], value.shape[3]
    value_strides, value_block = value_args(value)
    if batch * q_heads * num_queries == 0:
        return out, lse
    block_size, query_tile = selection.block_size, selection.query_tile
    sel_heads = selection.num_heads
    heads_per_row = q_heads // sel_heads
    dot_fp32, precision = dot_settings(query.dtype)
    starts = row_starts(kv_start).to(query.device)  # any integer dtype: read as int32 in the kernel (no cast launch)
    width = selection.indices.shape[-1]
    common = dict(
        KV_HEADS=kv_heads, HEADS_PER_ROW=heads_per_row, GROUP=q_heads // kv_heads, QUERY_TILE=query_tile,
        BLOCK_SIZE=block_size, ENTRY_SEARCH=max(1, int(width).bit_length()), HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v,
        D_PAD=max(16, next_power_of_2(head_dim)), DV_PAD=max(16, next_power_of_2(head_dim_v)),
        DOT_FP32=dot_fp32, PRECISION=precision, WIDE_OFFSETS=wide_offsets(key, value),
        LOGN=logn_base is not None, HAS_SKIP=skip is not None, QUANT=key.dtype == torch.int8,
        ALIBI=alibi_slopes is not None, SOFTCAP=softcap_mode(softcap, query),
        FIXED_MAX=fixed_max(softcap, query, alibi_slopes), HAS_SINKS=sinks is not None,
    )
    quantized = key.dtype == torch.int8
    warps = launch_settings(max(head_dim, head_dim_v), quantized)["num_warps"]
    for block_m, block_n, stages in launch_configs(dot_fp32, max(head_dim, head_dim_v), block_size, quantized):
        heads_per_prog = program_heads(heads_per_row, query_tile, block_m)
        queries_per_prog = queries_per_program(heads_per_prog, query_tile, block_m)
        rows = max(16, next_power_of_2(heads_per_prog * queries_per_prog))
        subtiles = cdiv(query_tile, queries_per_prog)
        num_tiles = selection.num_query_tiles
        num_slots = max(num_tiles * subtiles, cdiv(num_queries, queries_per_prog))
        head_groups = heads_per_row // heads_per_prog
        try:
            _sparse_prefill_kernel[(batch * sel_heads * head_groups * num_slots,)](
                query, key, value, out, lse, selection.indices, selection.counts, starts, skip_flags,
                key_scale, value_scale, slopes, sink_logits,
                *query.stride(), *key.stride(), *value_strides, *key_scale.stride(), *value_scale.stride(),
                *out.stride(), *lse.stride(),
                *selection.indices.stride(), *selection.counts.stride(),
                num_queries, key_length, q_offset, scale * math.log2(math.e), inv_log_base, softcap_log2, num_tiles,
                num_slots,
                PROGS_PER_KV=sel_heads * head_groups // kv_heads, HEAD_GROUPS=head_groups,
                HEADS_PER_PROG=heads_per_prog, QUERIES_PER_PROG=queries_per_prog, SUBTILES=subtiles,
                BLOCK_M=rows, BLOCK_N=block_n, num_warps=warps if rows >= 128 else 4, num_stages=stages,
                V_BLOCK=value_block, V_ALIGNED=values_aligned(value_block, kv_start, block_n), **common,
            )
            break
        except OutOfResources:  # this GPU's shared memory is too small for the tiles: try the next, smaller set
            continue
    else:
        raise RuntimeError("no sparse_prefill tile configuration fits this GPU's shared memory")
    return out, lse
