"""XAttention antidiagonal block scores: strided score GEMM, softmax and block sums, then the masses.

Semantics: ``reference.antidiagonal_block_scores``. The strided reshape is done by the loads: the score of query
group ``g`` and key group ``r`` pools ``STRIDE`` head_dim-deep GEMMs (element ``m`` of the reversed query group
against element ``m`` of the key group; summed, or their maximum with ``pool="max"``), so no reshaped copy and no
score matrix is written.
First kernel: one program per (a few query tiles, a split of their key steps, batch x query head) computes each
score of its steps once: the online max / sum-exp per query group, and each step's probabilities (relative to
the running max) summed per (query group, key block) into a scratch buffer with that step's max; the split's
max and sum go to a small stats buffer. Splitting the key steps puts the programs of one query tile side by
side, so the tile's queries, re-read at every step, stay in L2. Second kernel: one program per (query tiles,
split, batch x query head) merges the splits' stats into the final normaliser and writes the split's (tile, key
block) masses.
The launcher bounds the scratch (``SCRATCH_BYTES``) by launching the tiles in groups, and ignores
``key_chunk``. int8 keys (the int8 SparseCache) are dequantised in registers by their per-token scales.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ..selection import RowLayout, row_starts
from .reference import num_query_tiles, num_row_blocks
from ._common import check_token_scale, dot_settings, scale_args, softcap_mode, softcap_sink_args
from .sparse_prefill import _soft_cap

# Query groups (rows) and key groups (columns) a program scores per step; each a multiple of a tile / block.
# Launch setting measured on the H100 (bf16, 128K; docs/xattn.md): 128 x 128 groups with
# 8 warps and 3 stages; key steps split 8 per program.
_ROWS = 128
_COLUMNS = 128
_WARPS = 8
_STAGES = 3
_SPLIT_STEPS = 8
#: Most bytes of per-step partial masses one launch keeps (tiles are launched in groups to stay under it).
SCRATCH_BYTES = 512 * 1024 * 1024


@triton.jit
def _strided_scores(Q, K, KS, q_base, k_base, ks_base, stride_qs, stride_qd, stride_ks, stride_kd, stride_kss,
                    group_first, row_real, num_queries, kv_start, key_length, key_group, offs_d, d_ok,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STRIDE: tl.constexpr,
                    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr, POOL_MAX: tl.constexpr):
    """Unscaled antidiagonal scores ``[BLOCK_M, BLOCK_N]`` of the program's query groups against key groups
    ``key_group``: ``STRIDE`` GEMMs of head_dim depth, element ``m`` of a query group (read reversed) against
    element ``m`` of a key group, summed (``pool="mean"``; the launcher's scale divides by ``STRIDE``) or their
    maximum kept (``POOL_MAX``). With ``QUANT`` the keys are int8 with a float32 scale per slot (``KS``),
    dequantised in registers: the ``STRIDE`` keys pooled into one score have different scales."""
    if POOL_MAX:
        scores = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)
    else:
        scores = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for m in range(STRIDE):  # a loop, not unrolled: one q / k tile in flight (pipelined), not STRIDE of them
        query_ids = group_first + STRIDE - 1 - m
        q = tl.load(Q + q_base + query_ids[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                    mask=(row_real & (query_ids < num_queries))[:, None] & d_ok[None, :], other=0.0)
        slots = kv_start + key_group * STRIDE + m
        k = tl.load(K + k_base + slots[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                    mask=(slots < key_length)[:, None] & d_ok[None, :], other=0.0)
        if QUANT:
            k_scale = tl.load(KS + ks_base + slots * stride_kss, mask=slots < key_length, other=0.0)
            k = k.to(tl.float32) * k_scale[:, None]
        if DOT_FP32:
            product = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=PRECISION)
        else:
            product = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)
        if POOL_MAX:
            scores = tl.maximum(scores, product)
        else:
            scores += product
    return scores


@triton.jit
def _score_step(Q, K, KS, q_base, k_base, ks_base, stride_qs, stride_qd, stride_ks, stride_kd, stride_kss,
                group_first, group_last, row_real, num_queries, kv_start, key_length, it, offs_row, offs_col, offs_d,
                d_ok, scale_log2, softcap_log2, row_max, row_sum, part_base,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KEY_BLOCKS: tl.constexpr, GROUPS: tl.constexpr,
                STRIDE: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr,
                MASKED: tl.constexpr, SOFTCAP: tl.constexpr, POOL_MAX: tl.constexpr):
    """Step ``it`` over ``BLOCK_N`` key groups: scores, online max / sum-exp update, and the step's partial
    masses per (query group, key block) with its max written to the scratch. Maxima are of the scores times
    ``scale_log2`` (the softmax scale times log2(e), positive), so a probability is one multiply-add and an
    ``exp2``. Without ``MASKED`` every key group of the step must be visible to every real row and inside the
    keys (rows that are not real are weighted 0 later). With ``SOFTCAP`` the scaled scores are capped first
    (cap ``softcap_log2``, base 2), and the scale is then 1."""
    key_group = it * BLOCK_N + offs_col
    scores = _strided_scores(Q, K, KS, q_base, k_base, ks_base, stride_qs, stride_qd, stride_ks, stride_kd,
                             stride_kss, group_first, row_real, num_queries, kv_start, key_length, key_group,
                             offs_d, d_ok, BLOCK_M, BLOCK_N, STRIDE, DOT_FP32, PRECISION, QUANT, POOL_MAX)
    if SOFTCAP:
        scores = _soft_cap(scores * scale_log2, softcap_log2, SOFTCAP)
        scale = 1.0
    else:
        scale = scale_log2
    if MASKED:
        visible = ((kv_start + key_group * STRIDE < key_length)[None, :]
                   & ((key_group * STRIDE)[None, :] <= group_last[:, None]) & row_real[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1) * scale)
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.where(visible, tl.exp2(scores * scale - safe_max[:, None]), 0.0)
    else:
        new_max = tl.maximum(row_max, tl.max(scores, 1) * scale)
        safe_max = new_max
        probs = tl.exp2(scores * scale - safe_max[:, None])
    row_sum = row_sum * tl.exp2(row_max - safe_max) + tl.sum(probs, 1)
    step = part_base + it * ((KEY_BLOCKS + 1) * BLOCK_M)
    # Columns are (key block, key group) in row-major order: one reshape sums each block's groups.
    block_sums = tl.sum(tl.reshape(probs, (BLOCK_M, KEY_BLOCKS, GROUPS)), 2)
    offs_kb = tl.arange(0, KEY_BLOCKS)
    tl.store(step + offs_kb[None, :] * BLOCK_M + offs_row[:, None], block_sums)
    tl.store(step + KEY_BLOCKS * BLOCK_M + offs_row, new_max)
    return new_max, row_sum


@triton.jit
def _program_rows(KV_START, splits, num_queries, q_offset, first_tile, num_tiles,
                  Q_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, STRIDE: tl.constexpr, GROUPS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A program of either kernel: its split, batch, head, first local tile and index among the (tiles, batch x
    head) programs; its query groups (first query, whether real, row-relative last slot); its row's kv_start
    and its tiles' key steps. The splits of one program's tiles are neighbours in the launch order."""
    program = tl.program_id(0) // splits
    split = tl.program_id(0) % splits
    batch_head = tl.program_id(1)
    b = batch_head // Q_HEADS
    h = batch_head % Q_HEADS
    tile_start = program * (BLOCK_M // GROUPS)
    index = program * tl.num_programs(1) + batch_head
    kv_start = tl.load(KV_START + b)
    pad_q = tl.minimum(tl.maximum(kv_start - q_offset, 0), num_queries)
    offs_row = tl.arange(0, BLOCK_M)
    local_tile = tile_start + offs_row // GROUPS
    group_first = pad_q + (first_tile + local_tile) * BLOCK_SIZE + (offs_row % GROUPS) * STRIDE
    row_real = (local_tile < num_tiles) & (group_first < num_queries)
    group_last = q_offset + group_first + STRIDE - 1 - kv_start  # row-relative slot of the group's last query
    last_slot = tl.max(tl.where(row_real, group_last, -1), 0)
    num_iters = tl.where(last_slot >= 0, last_slot // (STRIDE * BLOCK_N) + 1, 0)
    return split, b, h, tile_start, index, kv_start, group_first, row_real, group_last, num_iters


@triton.jit
def _antidiagonal_scores_kernel(
    Q, K, KS, KV_START, PART, STATS,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_ksb, stride_ksh, stride_kss,
    num_queries, key_length, q_offset, first_tile, num_tiles, scale_log2, softcap_log2, max_iters, splits,
    split_iters,
    Q_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, STRIDE: tl.constexpr,
    GROUPS: tl.constexpr, TILES: tl.constexpr, KEY_BLOCKS: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr,
    SOFTCAP: tl.constexpr, POOL_MAX: tl.constexpr,
):
    """Scores of one split of a program's key steps (see the module docstring)."""
    # Rows: TILES query tiles x GROUPS query groups; columns: KEY_BLOCKS key blocks x GROUPS key groups.
    BLOCK_M: tl.constexpr = TILES * GROUPS
    BLOCK_N: tl.constexpr = KEY_BLOCKS * GROUPS
    split, b, h, tile_start, index, kv_start, group_first, row_real, group_last, num_iters = _program_rows(
        KV_START, splits, num_queries, q_offset, first_tile, num_tiles, Q_HEADS, BLOCK_SIZE, STRIDE, GROUPS,
        BLOCK_M, BLOCK_N)
    offs_row = tl.arange(0, BLOCK_M)
    offs_col = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    q_base = b * stride_qb + h * stride_qh
    k_base = b * stride_kb + (h // GROUP) * stride_kh
    ks_base = b * stride_ksb + (h // GROUP) * stride_ksh
    # Scratch of the program's tiles: per step, KEY_BLOCKS partial masses and the running max of each query group.
    part_base = PART + (index.to(tl.int64) * max_iters) * ((KEY_BLOCKS + 1) * BLOCK_M)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    # Steps whose key groups every real row sees, inside the keys, run without masks; this split's steps only.
    first_last = tl.min(tl.where(row_real, group_last, 2147483647), 0)
    visible_groups = tl.minimum(first_last // STRIDE + 1, (key_length - kv_start + STRIDE - 1) // STRIDE)
    full_iters = tl.minimum(tl.where(first_last >= 0, visible_groups // BLOCK_N, 0), num_iters)
    it_start = split * split_iters
    it_end = tl.minimum(it_start + split_iters, num_iters)
    for it in tl.range(it_start, tl.minimum(full_iters, it_end), flatten=True):
        row_max, row_sum = _score_step(
            Q, K, KS, q_base, k_base, ks_base, stride_qs, stride_qd, stride_ks, stride_kd, stride_kss, group_first,
            group_last, row_real, num_queries, kv_start, key_length, it, offs_row, offs_col, offs_d, d_ok,
            scale_log2, softcap_log2, row_max, row_sum, part_base, BLOCK_M, BLOCK_N, KEY_BLOCKS, GROUPS, STRIDE,
            DOT_FP32, PRECISION, QUANT, False, SOFTCAP, POOL_MAX)
    for it in tl.range(tl.maximum(full_iters, it_start), it_end, flatten=True):
        row_max, row_sum = _score_step(
            Q, K, KS, q_base, k_base, ks_base, stride_qs, stride_qd, stride_ks, stride_kd, stride_kss, group_first,
            group_last, row_real, num_queries, kv_start, key_length, it, offs_row, offs_col, offs_d, d_ok,
            scale_log2, softcap_log2, row_max, row_sum, part_base, BLOCK_M, BLOCK_N, KEY_BLOCKS, GROUPS, STRIDE,
            DOT_FP32, PRECISION, QUANT, True, SOFTCAP, POOL_MAX)
    stats = STATS + (index.to(tl.int64) * splits + split) * (2 * BLOCK_M)  # written even by an empty split
    tl.store(stats + offs_row, row_max)
    tl.store(stats + BLOCK_M + offs_row, row_sum)


@triton.jit
def _antidiagonal_masses_kernel(
    OUT, KV_START, PART, STATS,
    stride_ob, stride_oh, stride_ot, stride_on,
    num_queries, q_offset, first_tile, num_tiles, num_blocks, max_iters, splits, split_iters,
    Q_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, STRIDE: tl.constexpr,
    GROUPS: tl.constexpr, TILES: tl.constexpr, KEY_BLOCKS: tl.constexpr,
):
    """Masses of one split of a program's key steps, from the scores kernel's scratch and every split's stats."""
    BLOCK_M: tl.constexpr = TILES * GROUPS
    BLOCK_N: tl.constexpr = KEY_BLOCKS * GROUPS
    split, b, h, tile_start, index, kv_start, group_first, row_real, group_last, num_iters = _program_rows(
        KV_START, splits, num_queries, q_offset, first_tile, num_tiles, Q_HEADS, BLOCK_SIZE, STRIDE, GROUPS,
        BLOCK_M, BLOCK_N)
    offs_row = tl.arange(0, BLOCK_M)
    stats = STATS + (index.to(tl.int64) * splits) * (2 * BLOCK_M)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for other in range(0, splits):
        row_max = tl.maximum(row_max, tl.load(stats + other * (2 * BLOCK_M) + offs_row))
    final_max = tl.where(row_real & (row_max > float("-inf")), row_max, 0.0)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    for other in range(0, splits):
        split_max = tl.load(stats + other * (2 * BLOCK_M) + offs_row)
        split_sum = tl.load(stats + other * (2 * BLOCK_M) + BLOCK_M + offs_row)
        row_sum += tl.where(split_max == float("-inf"), 0.0, split_sum * tl.exp2(split_max - final_max))
    inv_sum = tl.where(row_real, 1.0 / tl.maximum(row_sum, 1e-30), 0.0)

    part_base = PART + (index.to(tl.int64) * max_iters) * ((KEY_BLOCKS + 1) * BLOCK_M)
    offs_kb = tl.arange(0, KEY_BLOCKS)
    offs_tile = tile_start + tl.arange(0, TILES)
    out_tiles = OUT + b * stride_ob + h * stride_oh + offs_tile[None, :] * stride_ot
    for it in range(split * split_iters, tl.minimum(split * split_iters + split_iters, num_iters)):
        step = part_base + it * ((KEY_BLOCKS + 1) * BLOCK_M)
        step_max = tl.load(step + KEY_BLOCKS * BLOCK_M + offs_row)
        # 2^(step max - final max) <= 1; a group that had seen nothing by this step has only zero masses
        weight = tl.where(step_max == float("-inf"), 0.0, tl.exp2(step_max - final_max)) * inv_sum
        part = tl.load(step + offs_kb[:, None] * BLOCK_M + offs_row[None, :]) * weight[None, :]
        masses = tl.sum(tl.reshape(part, (KEY_BLOCKS, TILES, GROUPS)), 2)  # rows are (tile, group) row-major
        block = it * KEY_BLOCKS + offs_kb
        tl.store(out_tiles + block[:, None] * stride_on, masses,
                 mask=(block < num_blocks)[:, None] & (offs_tile < num_tiles)[None, :])


def antidiagonal_block_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    scale: float,
    q_offset: int,
    kv_start: torch.Tensor | RowLayout,
    block_size: int,
    stride: int,
    first_tile: int = 0,
    num_tiles: int | None = None,
    key_chunk: int | None = None,
    key_scale: torch.Tensor | None = None,
    softcap: float | None = None,
    pool: str = "mean",
) -> torch.Tensor:
    """Triton version of :func:`hf_sparse.kernels.reference.antidiagonal_block_scores` (float32 output); an
    int8 ``key`` with its float32 ``key_scale`` ``[B, Hkv, Skv]`` is dequantised in registers; ``softcap`` caps
    the scaled scores before the softmax; ``pool`` ("mean" or "max") pools each antidiagonal's products."""
    if query.dim() != 4 or key.dim() != 4 or query.shape[0] != key.shape[0] or query.shape[1] % key.shape[1]:
        raise ValueError(f"need BNSD query [B,Hq,Sq,D] and key [B,Hkv,Skv,D]; got {tuple(query.shape)}, {tuple(key.shape)}")
    quantized = key.dtype == torch.int8
    if query.shape[-1] != key.shape[-1] or query.device != key.device or (query.dtype != key.dtype and not quantized):
        raise ValueError("query and key must share head dim, dtype (or key int8 with key_scale) and device")
    if quantized != (key_scale is not None):
        raise ValueError("an int8 key needs key_scale (and key_scale only goes with an int8 key)")
    if quantized:
        check_token_scale("key_scale", key_scale, key)
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    softcap_log2, _ = softcap_sink_args(softcap, None, query)
    if pool not in ("mean", "max"):
        raise ValueError(f"pool must be 'mean' or 'max', got {pool!r}")
    if block_size % stride or stride & (stride - 1):
        raise ValueError(f"stride {stride} must be a power of two dividing block_size {block_size}")
    batch, q_heads, num_queries, dim = query.shape
    kv_heads, key_length = key.shape[1], key.shape[2]
    num_blocks = num_row_blocks(key_length, kv_start, block_size)
    if num_tiles is None:
        num_tiles = num_query_tiles(num_queries, q_offset, kv_start, block_size) - first_tile
    kv_start = row_starts(kv_start).to(device=query.device, dtype=torch.int32)
    out = torch.zeros(batch, q_heads, num_tiles, num_blocks, dtype=torch.float32, device=query.device)
    if num_tiles <= 0 or num_blocks <= 0:
        return out
    groups = block_size // stride
    score_scale = scale if pool == "max" else scale / stride  # the mean's 1/S folded into the softmax scale
    dot_fp32, precision = dot_settings(query.dtype)
    key_scale, _ = scale_args(key_scale, None, key)
    # About 64 query groups x 128 key groups per step (at least 16 each, as tl.dot needs); halved on
    # OutOfResources (float32 operands at head dim 128 need twice the shared memory of bfloat16 ones).
    rows, columns = _ROWS, _COLUMNS
    while True:
        tiles = max(1, rows // groups)
        key_blocks = max(1, columns // groups)
        block_m, block_n = tiles * groups, key_blocks * groups
        max_iters = triton.cdiv(triton.cdiv(key_length, stride), block_n)
        per_program = max_iters * (key_blocks + 1) * block_m * 4
        programs_per_launch = max(1, SCRATCH_BYTES // (per_program * batch * q_heads))
        tiles_per_launch = programs_per_launch * tiles
        split_iters = max(1, min(max_iters, _SPLIT_STEPS))
        splits = triton.cdiv(max_iters, split_iters)
        launch_programs = min(triton.cdiv(num_tiles, tiles), programs_per_launch) * batch * q_heads
        stats = torch.empty(launch_programs * splits * 2 * block_m, dtype=torch.float32, device=query.device)
        part = torch.empty(launch_programs * per_program // 4, dtype=torch.float32, device=query.device)
        try:
            for start in range(0, num_tiles, tiles_per_launch):
                count = min(tiles_per_launch, num_tiles - start)
                target = out[:, :, start:start + count]
                programs = triton.cdiv(count, tiles)
                _antidiagonal_scores_kernel[(programs * splits, batch * q_heads)](
                    query, key, key_scale, kv_start, part, stats,
                    *query.stride(), *key.stride(), *key_scale.stride(),
                    num_queries, key_length, q_offset, first_tile + start, count,
                    score_scale * math.log2(math.e), softcap_log2, max_iters, splits, split_iters,
                    Q_HEADS=q_heads, GROUP=q_heads // kv_heads, BLOCK_SIZE=block_size, STRIDE=stride, GROUPS=groups,
                    TILES=tiles, KEY_BLOCKS=key_blocks, HEAD_DIM=dim, D_PAD=max(16, triton.next_power_of_2(dim)),
                    DOT_FP32=dot_fp32, PRECISION=precision, QUANT=quantized, SOFTCAP=softcap_mode(softcap, query),
                    POOL_MAX=pool == "max", num_warps=_WARPS,
                    num_stages=_STAGES,
                )
                _antidiagonal_masses_kernel[(programs * splits, batch * q_heads)](
                    target, kv_start, part, stats, *target.stride(),
                    num_queries, q_offset, first_tile + start, count, num_blocks, max_iters, splits, split_iters,
                    Q_HEADS=q_heads, BLOCK_SIZE=block_size, STRIDE=stride, GROUPS=groups, TILES=tiles,
                    KEY_BLOCKS=key_blocks, num_warps=4,
                )
            break
        except OutOfResources:
            if key_blocks * groups > 16:
                columns //= 2
            elif tiles * groups > 16:
                rows //= 2
            else:
                raise
    return out
