"""Head-union sparse decode attention: a few queries per sequence over the key blocks of one selection row.

Semantics: :func:`hf_sparse.kernels.reference.sparse_attention` for a selection with one query tile. One
program serves every query head that shares the row (all heads of a GQA group when the selection has one row
per KV head) and every query, packed as the rows of one tile, so each selected K/V block is read once for
the group. When few (batch, row) pairs would leave the GPU idle, the row's selected blocks are split evenly
(from the count, on the device: no host sync) over ``splits`` programs that write partial results; the last
of them to finish (a ticket counter per program row, reset by it) merges the partials by log-sum-exp in the
same launch (:mod:`.merge_lse`'s merge, without a second launch).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from triton.runtime.errors import OutOfResources

from ..selection import BlockSelection, RowLayout, row_starts
from ._common import (attention_outputs, cdiv, check_length, dependent_launch_args, dot_settings, fixed_max,
                      heads_per_program, next_power_of_2, sm_count, softcap_mode, softcap_sink_args, ticket_counters,
                      value_args, values_aligned, wide_offsets)
from .merge_lse import _merge_parts, parts_per_step
from .sparse_prefill import _attend_entries, _finish, _sink_scale

#: Calls with one query tile and at most this many queries per sequence use this kernel.
MAX_DECODE_QUERIES = 16
#: Launch settings (H100 defaults; `benchmarks/bench_attention.py --tune` measures others).
TUNING = {"block_n": 128, "num_warps": 4, "num_stages": 2, "programs_per_sm": 2, "max_splits": 64}
#: Overrides for int8 K/V, whose tiles take half the shared memory: a third stage (H100, 128K, docs/features.md).
TUNING_INT8 = {"num_stages": 3}
#: Overrides for head dims of at most 64, whose bf16 tiles take half the shared memory too: a third stage (SmolLM2
#: shape, 32K, batch 1, H200: 20.2 -> 15.4 us; docs/kernels.md).
TUNING_SMALL_HEAD = {"num_stages": 3}


@triton.jit
def _sparse_decode_kernel(
    Q, K, V, OUT, LSE, INDICES, COUNTS, KV_START, SKIP, K_SCALE, V_SCALE, ALIBI_SLOPES, SINKS, FINAL, FINAL_LSE,
    TICKETS, LENGTH,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd, stride_vblk,
    stride_ksb, stride_ksh, stride_kss, stride_vsb, stride_vsh, stride_vss,
    stride_on, stride_ob, stride_oh, stride_os, stride_od,
    stride_ln, stride_lb, stride_lh, stride_ls,
    stride_fb, stride_fh, stride_fs, stride_fd,
    stride_gb, stride_gh, stride_gs,
    stride_ib, stride_ih, stride_ik,
    stride_cb, stride_ch,
    key_length, q_offset, scale_log2, inv_log_base, softcap_log2, splits,
    SEL_HEADS: tl.constexpr, HEAD_GROUPS: tl.constexpr, HEADS_PER_ROW: tl.constexpr,
    HEADS_PER_PROG: tl.constexpr, GROUP: tl.constexpr, NUM_QUERIES: tl.constexpr, QUERY_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, WIDE_OFFSETS: tl.constexpr,
    LOGN: tl.constexpr, HAS_SKIP: tl.constexpr, QUANT: tl.constexpr, ALIBI: tl.constexpr,
    MERGE: tl.constexpr, DEVICE_LENGTH: tl.constexpr, V_BLOCK: tl.constexpr, V_ALIGNED: tl.constexpr,
    SOFTCAP: tl.constexpr, FIXED_MAX: tl.constexpr, HAS_SINKS: tl.constexpr, MERGE_ROWS: tl.constexpr,
    MERGE_STEP: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # programmatic dependent launch: the kernel before is done first, the one after may launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // (SEL_HEADS * HEAD_GROUPS)
    head_prog = pid % (SEL_HEADS * HEAD_GROUPS)
    sel_head = head_prog // HEAD_GROUPS
    first_head = sel_head * HEADS_PER_ROW + (head_prog % HEAD_GROUPS) * HEADS_PER_PROG
    kv_head = first_head // GROUP
    b64 = b.to(tl.int64)
    if DEVICE_LENGTH:  # valid slots read on the device (a static cache under a CUDA graph)
        key_length = tl.load(LENGTH).to(tl.int32)
        q_offset = key_length - NUM_QUERIES

    kv_start = tl.load(KV_START + b).to(tl.int32)
    pad_q = tl.minimum(tl.maximum(kv_start - q_offset, 0), NUM_QUERIES)
    rows = tl.arange(0, BLOCK_M)  # row = head in program * NUM_QUERIES + query
    head = first_head + rows // NUM_QUERIES
    query = rows % NUM_QUERIES
    head_ok = rows < HEADS_PER_PROG * NUM_QUERIES
    if HAS_SKIP:  # a skipped row: no K/V reads, no stores (the merge skips it too)
        skipped = tl.load(SKIP + b).to(tl.int32)
        head_ok = head_ok & (rows * 0 + skipped == 0)
    # Queries of the row's single tile: the leading padding queries and any past the tile see no key.
    row_ok = head_ok & (query >= pad_q) & (query - pad_q < QUERY_TILE)
    q_slot = q_offset + query
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    q = tl.load(Q + b64 * stride_qb + head[:, None].to(tl.int64) * stride_qh + query[:, None] * stride_qs
                + offs_d[None, :] * stride_qd, mask=head_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
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

    count = tl.load(COUNTS + b * stride_cb + sel_head * stride_ch)
    if HAS_SKIP:
        count = tl.where(skipped == 0, count, 0)
    per_split = (count + splits - 1) // splits
    first_entry = tl.minimum(split * per_split, count)
    last_entry = tl.minimum(first_entry + per_split, count)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
    acc, l_i, m_i = _attend_entries(
        acc, l_i, m_i, q, q_slot, row_ok, INDICES + b64 * stride_ib + sel_head * stride_ih, stride_ik,
        first_entry, last_entry,
        K + b64 * stride_kb + kv_head.to(tl.int64) * stride_kh, V + b64 * stride_vb + kv_head.to(tl.int64) * stride_vh,
        stride_ks, stride_kd, stride_vs, stride_vd, stride_vblk, kv_start, key_length, row_scale,
        K_SCALE + b64 * stride_ksb + kv_head.to(tl.int64) * stride_ksh,
        V_SCALE + b64 * stride_vsb + kv_head.to(tl.int64) * stride_vsh, stride_kss, stride_vss, alibi_log2,
        softcap_log2, BLOCK_SIZE, BLOCK_N, HEAD_DIM, HEAD_DIM_V, D_PAD, DV_PAD, True, DOT_FP32, PRECISION,
        WIDE_OFFSETS, LOGN, QUANT, ALIBI, V_BLOCK, V_ALIGNED, SOFTCAP, FIXED_MAX)
    out, lse = _finish(acc, l_i, m_i)
    if HAS_SINKS:
        if not MERGE:  # the whole row in one program; split partials get the sinks after their merge
            out = _sink_scale(out, lse, SINKS, head, head_ok)
    split64 = split.to(tl.int64)
    tl.store(OUT + split64 * stride_on + b64 * stride_ob + head[:, None].to(tl.int64) * stride_oh
             + query[:, None] * stride_os + offs_dv[None, :] * stride_od,
             out.to(OUT.dtype.element_ty), mask=head_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
    tl.store(LSE + split64 * stride_ln + b64 * stride_lb + head * stride_lh + query * stride_ls, lse, mask=head_ok)
    if MERGE:
        # Every thread's partial stores are issued (barrier) and released (the ticket) before the last program
        # of this row reads them; it merges, then resets the ticket for the next launch.
        tl.debug_barrier()
        ticket = tl.atomic_add(TICKETS + pid, 1, sem="acq_rel")
        if ticket == splits - 1:
            # The merge takes only the program's real rows (MERGE_ROWS, not the dot's padded BLOCK_M), so its
            # steps can load many parts at once (MERGE_STEP): fewer dependent L2 round trips.
            m_rows = tl.arange(0, MERGE_ROWS)
            m_head = first_head + m_rows // NUM_QUERIES
            m_query = m_rows % NUM_QUERIES
            m_ok = m_rows < HEADS_PER_PROG * NUM_QUERIES
            if HAS_SKIP:
                m_ok = m_ok & (m_rows * 0 + skipped == 0)
            dv_ok = offs_dv < HEAD_DIM_V
            merged, merged_lse = _merge_parts(
                LSE + b64 * stride_lb + m_head * stride_lh + m_query * stride_ls,
                OUT + b64 * stride_ob + m_head[:, None].to(tl.int64) * stride_oh + m_query[:, None] * stride_os
                + offs_dv[None, :] * stride_od, stride_ln, stride_on, splits, m_ok, dv_ok, MERGE_ROWS, DV_PAD,
                MERGE_STEP)
            if HAS_SINKS:
                merged = _sink_scale(merged, merged_lse, SINKS, m_head, m_ok)
            tl.store(FINAL + b64 * stride_fb + m_head[:, None].to(tl.int64) * stride_fh + m_query[:, None] * stride_fs
                     + offs_dv[None, :] * stride_fd, merged.to(FINAL.dtype.element_ty),
                     mask=m_ok[:, None] & dv_ok[None, :])
            tl.store(FINAL_LSE + b64 * stride_gb + m_head * stride_gh + m_query * stride_gs, merged_lse, mask=m_ok)
            tl.store(TICKETS + pid, 0)


def default_splits(programs: int, width: int, device: torch.device) -> int:
    """Splits per selection row: enough programs for ``programs_per_sm`` per SM, at most one per listed block."""
    if device.type != "cuda":
        return max(1, min(2, width))  # the interpreter: exercise the merge
    sms = sm_count(device)
    wanted = cdiv(TUNING["programs_per_sm"] * sms, max(1, programs))
    return max(1, min(wanted, width, TUNING["max_splits"]))


def sparse_decode(
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
    splits: int | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton decode for a selection with one query tile and at most :data:`MAX_DECODE_QUERIES` queries.

    Same result as :func:`hf_sparse.kernels.reference.sparse_attention` (``logn_base``, ``skip``, ``softcap`` and
    ``sinks`` too: the sinks rescale the output after the merge of the splits).
    ``out`` / ``lse`` are written in place when given; rows in ``skip`` are not touched. No value is read
    back to the host. ``length`` (a one-element integer tensor on the device) is the number of valid key
    slots when ``key`` / ``value`` are a static cache's whole storage; ``q_offset`` is then ``length - Sq``,
    read in the kernel, so one launch serves every step of a CUDA graph.
    """
    out, lse, inv_log_base, skip_flags, key_scale, value_scale, slopes = attention_outputs(
        query, key, value, selection, kv_start, logn_base, skip, key_scale, value_scale, alibi_slopes, out, lse)
    softcap_log2, sink_logits = softcap_sink_args(softcap, sinks, query)
    batch, q_heads, num_queries, head_dim = query.shape
    kv_heads, key_length, head_dim_v = key.shape[1], key.shape[2], value.shape[3]
    value_strides, value_block = value_args(value)
    if selection.num_query_tiles != 1 or not 1 <= num_queries <= MAX_DECODE_QUERIES:
        raise ValueError(f"sparse_decode needs one query tile and 1..{MAX_DECODE_QUERIES} queries; "
                         "use sparse_prefill otherwise")
    if batch * q_heads == 0:
        return out, lse
    sel_heads = selection.num_heads
    heads_per_row = q_heads // sel_heads
    heads_per_prog = heads_per_program(heads_per_row, num_queries, 128)
    head_groups = heads_per_row // heads_per_prog
    rows = max(16, next_power_of_2(heads_per_prog * num_queries))
    merge_rows = max(2, next_power_of_2(heads_per_prog * num_queries))
    dv_pad = max(16, next_power_of_2(head_dim_v))
    programs = batch * sel_heads * head_groups
    width = selection.indices.shape[-1]
    splits = splits or default_splits(programs, width, query.device)
    dot_fp32, precision = dot_settings(query.dtype)
    if splits == 1:
        part_out, part_lse = out[None], lse[None]
        tickets = lse  # never read
    else:
        part_out = torch.empty(splits, batch, q_heads, num_queries, head_dim_v, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(splits, batch, q_heads, num_queries, dtype=torch.float32, device=query.device)
        tickets = ticket_counters(programs, query.device)
    indices = selection.indices[:, :, 0]
    counts = selection.counts[:, :, 0]
    starts = row_starts(kv_start).to(query.device)  # any integer dtype: read as int32 in the kernel (no cast launch)
    length_arg = check_length(length, query.device)
    if length is not None:
        q_offset = key_length = 0  # read from `length` in the kernel
    tuning = {**TUNING, **(TUNING_SMALL_HEAD if max(head_dim, head_dim_v) <= 64 else {}),
              **(TUNING_INT8 if key.dtype == torch.int8 else {})}
    configs = [] if dot_fp32 or max(head_dim, head_dim_v) > 128 else [(tuning["block_n"], tuning["num_stages"])]
    configs += [(64, 2), (32, 2), (32, 1), (16, 1)]
    for block_n, stages in configs:
        block_n = min(block_n, selection.block_size)
        if selection.block_size % block_n:
            continue
        try:
            _sparse_decode_kernel[(programs, splits)](
                query, key, value, part_out, part_lse, indices, counts, starts, skip_flags, key_scale, value_scale, slopes,
                sink_logits, out, lse, tickets, length_arg,
                *query.stride(), *key.stride(), *value_strides, *key_scale.stride(), *value_scale.stride(),
                *part_out.stride(), *part_lse.stride(), *out.stride(), *lse.stride(),
                *indices.stride(), *counts.stride(),
                key_length, q_offset, scale * math.log2(math.e), inv_log_base, softcap_log2, splits,
                SEL_HEADS=sel_heads, HEAD_GROUPS=head_groups, HEADS_PER_ROW=heads_per_row,
                HEADS_PER_PROG=heads_per_prog, GROUP=q_heads // kv_heads, NUM_QUERIES=num_queries,
                QUERY_TILE=selection.query_tile, BLOCK_M=rows, BLOCK_SIZE=selection.block_size, BLOCK_N=block_n,
                HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v,
                D_PAD=max(16, next_power_of_2(head_dim)), DV_PAD=dv_pad,
                DOT_FP32=dot_fp32, PRECISION=precision, WIDE_OFFSETS=wide_offsets(key, value),
                LOGN=logn_base is not None, HAS_SKIP=skip is not None, QUANT=key.dtype == torch.int8,
                ALIBI=alibi_slopes is not None, MERGE=splits > 1, SOFTCAP=softcap_mode(softcap, query),
                FIXED_MAX=fixed_max(softcap, query, alibi_slopes), HAS_SINKS=sinks is not None,
                MERGE_ROWS=merge_rows, MERGE_STEP=parts_per_step(merge_rows, dv_pad),
                DEVICE_LENGTH=length is not None, V_BLOCK=value_block,
                V_ALIGNED=values_aligned(value_block, kv_start, block_n), num_warps=tuning["num_warps"], num_stages=stages,
                **dependent_launch_args(query.device),
            )
            break
        except OutOfResources:  # too little shared memory on this GPU for these tiles: next, smaller
            continue
    else:
        raise RuntimeError("no sparse_decode tile configuration fits this GPU's shared memory")
    return out, lse
