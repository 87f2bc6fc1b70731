"""PLAS block selection: block scores, threshold top-k, forced blocks and tile union fused in one kernel.

Semantics: :func:`hf_sparse.kernels.reference.select_blocks`. One program per (batch, selection row, query
tile) walks the row's queries (and, with ``head_union``, the query heads of its GQA group) ``BLOCK_Q`` at a
time: logits ``q . Kc * scale`` against every summary (tensor cores, K-looped over the head dim; with
``ALIBI`` plus the bias at each block's centre), the threshold search per query, the forced diagonal and sink blocks, and an OR into the tile's block mask (a
scratch row of ``NB_PAD`` bytes). Scores stay in registers: nothing of size ``[B, H, Sq, num_blocks]`` is
written. The mask is compacted in the same program (prefix sum) into the ascending ``BlockSelection`` row,
-1 padded, and its count. Decode (one tile of few rows) runs ``_decode_select_kernel`` instead: its logits
come from programs spread over the blocks (one program per row would read the whole summary row through a
single SM) into a buffer of rows x blocks, and the last program of each row selects, in the same launch.

The threshold search is the reference's, on logits as there: ``p_j >= f * max(p)`` is ``l_j >= max(l) +
log(f)``, so neither the softmax normaliser nor an exp per block is needed. Results equal the reference's
except where a logit sits within float rounding of a cut the search tries.

Tiles are launched in bands by how many blocks their queries can see (causality), each band with the
smallest power-of-two block width ``NB_PAD``: early tiles of a long prefill do not pay for the whole row.
"""
from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from ..selection import BlockSelection, RowLayout, row_starts
from . import reference
from ._common import alibi_args, check_length, interpreting, next_power_of_2, ticket_counters

logger = logging.getLogger(__name__)

#: Widest block row the kernel holds in registers; longer rows fall back to the PyTorch reference.
MAX_BLOCKS = 2048
#: Register budget: logits held per program (``BLOCK_Q * NB_PAD``) and per warp, queries per summaries read;
#: bytes of one summaries chunk of the K loop.
TUNING = {"logits_per_program": 8192, "logits_per_warp": 1024, "min_block_q": 32, "max_block_q": 64,
          "max_warps": 8, "chunk_bytes": 32768}


@triton.jit
def _alibi_block_bias(SLOPES, head, real, q_slot, kv_start, blocks, BLOCK_SIZE: tl.constexpr):
    """``slope[head] * (min(block centre, query slot) - query slot)`` per (query row, block): the ALiBi bias
    of the reference's selection."""
    slope = tl.load(SLOPES + head, mask=real, other=0.0)
    centre = (kv_start + blocks * BLOCK_SIZE).to(tl.float32) + (BLOCK_SIZE - 1) * 0.5
    slot = q_slot.to(tl.float32)[:, None]
    return slope[:, None] * (tl.minimum(centre[None, :], slot) - slot)


@triton.jit
def _block_logits(q_rows, s_cols, stride_qd, stride_sd, real, readable, row_last, scale, SLOPES, head, q_slot,
                  kv_start, blocks, BLOCK_Q: tl.constexpr, NB: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, D_CHUNK: tl.constexpr, DOT_DTYPE: tl.constexpr,
                  PRECISION: tl.constexpr, ALIBI: tl.constexpr):
    """Scaled logits ``q . Kc`` ``[BLOCK_Q, NB]`` of query rows (``q_rows``: pointers to each row's query,
    ``real`` rows only) against the summaries of ``blocks`` (``s_cols``: pointers to each block's summary, read
    where ``readable``), K-looped over the head dim; with ALIBI plus the bias at each block's centre; -inf past
    each row's last visible block ``row_last``."""
    logits = tl.zeros([BLOCK_Q, NB], tl.float32)
    for d0 in range(0, D_PAD, D_CHUNK):
        offs_d = d0 + tl.arange(0, D_CHUNK)
        q = tl.load(q_rows[:, None] + offs_d[None, :] * stride_qd, mask=real[:, None] & (offs_d[None, :] < HEAD_DIM),
                    other=0.0)
        s = tl.load(s_cols[None, :] + offs_d[:, None] * stride_sd, mask=readable[None, :] & (offs_d[:, None] < HEAD_DIM),
                    other=0.0)
        logits = tl.dot(q.to(DOT_DTYPE), s.to(DOT_DTYPE), logits, input_precision=PRECISION)
    logits = logits * scale
    if ALIBI:  # before the row maximum: the threshold search runs on the biased logits
        logits += _alibi_block_bias(SLOPES, head, real, q_slot, kv_start, blocks, BLOCK_SIZE)
    return tl.where(blocks[None, :] <= row_last[:, None], logits, float("-inf"))


@triton.jit
def _count(logits, cut, FLOAT_COUNTS: tl.constexpr):
    """Per row, how many logits reach its cut (float sums with FLOAT_COUNTS: see :func:`_choose`)."""
    if FLOAT_COUNTS:
        count = tl.sum(tl.where(logits >= cut[:, None], 1.0, 0.0), 1)
    else:
        count = tl.sum((logits >= cut[:, None]).to(tl.int32), 1)
    return count


@triton.jit
def _choose(logits, row_last, own_block, blocks, top_left, top_right, search_steps, SINK_BLOCKS: tl.constexpr,
            FLOAT_COUNTS: tl.constexpr):
    """Blocks each row chooses ``[BLOCK_Q, NB_PAD]``: the threshold top-k of its masked logits, plus its own
    block and the sink blocks, within its causal range.

    The reference's search (:func:`hf_sparse.kernels.reference.threshold_topk`): bisection on f in [0, 1] (the
    cut's probability relative to the row's top block) or, for a row with fewer than ``top_left`` blocks above
    the deepest cut that halving f reaches, on the cut itself. Rows with at most ``top_right``
    available blocks take them all and do not search. The loop stops once every row has landed: later steps
    would not change a landed row. With FLOAT_COUNTS the counts are float sums, exact at any block count:
    faster for the many rows of a prefill (1.15x at 128K on the H100), slower for decode's few (docs/kernels.md).
    """
    n_available = row_last + 1
    visible = blocks[None, :] <= row_last[:, None]
    row_max = tl.max(logits, 1)
    searching = (n_available > top_right).to(tl.int32)
    found = 1 - searching
    # The deepest cut halving f reaches; a row with fewer than top_left blocks above it bisects the cut instead.
    deepest = row_max + tl.log(tl.exp2(-(tl.zeros_like(row_max) + search_steps)))
    deep = (searching > 0) & (_count(logits, deepest, FLOAT_COUNTS) < top_left)
    # Bounds of the bisection: f in [0, 1], or for a deep row the cut in [its lowest logit, deepest].
    low = tl.where(deep, tl.min(tl.where(visible, logits, float("inf")), 1), 0.0)
    high = tl.where(deep, deepest, 1.0)
    cut = tl.full(row_max.shape, float("-inf"), tl.float32)
    step = 0
    open_rows = tl.sum(1 - found, 0)
    while (step < search_steps) & (open_rows > 0):
        mid = (low + high) * 0.5
        mid_cut = tl.where(deep, mid, row_max + tl.log(tl.maximum(mid, 1e-30)))  # (a deep row's mid is a cut)
        count = _count(logits, mid_cut, FLOAT_COUNTS)
        landed = (count >= top_left) & (count <= top_right) & (found == 0)
        cut = tl.where(landed, mid_cut, cut)
        found = tl.where(landed, 1, found)
        low = tl.where((count > top_right) & (found == 0), mid, low)
        high = tl.where((count < top_left) & (found == 0), mid, high)
        step += 1
        open_rows = tl.sum(1 - found, 0)
    # A row that never landed: its last cut with too many blocks; rows that do not search: every available block.
    cut = tl.where(found > 0, cut, tl.where(deep, low, row_max + tl.log(tl.maximum(low, 1e-30))))
    cut = tl.where(searching > 0, cut, float("-inf"))
    forced = (blocks[None, :] == own_block[:, None]) | (blocks[None, :] < SINK_BLOCKS)
    return ((logits >= cut[:, None]) | forced) & visible


@triton.jit
def _store_selection(union, blocks, row_ptr, stride_ik, count_ptr, num_blocks, NB_PAD: tl.constexpr):
    """Compact a tile's 0/1 block mask ``union`` (int32 ``[NB_PAD]``): selected ids first in ascending order,
    then -1 up to the row's end; and its count."""
    count = tl.sum(union, 0)
    before = tl.cumsum(union, 0)
    position = tl.where(union > 0, before - 1, count + blocks - before)
    value = tl.where(union > 0, blocks, -1)
    tl.store(row_ptr + position * stride_ik, value, mask=position < num_blocks)
    for p0 in range(NB_PAD, num_blocks, NB_PAD):
        tl.store(row_ptr + (p0 + blocks) * stride_ik, tl.full([NB_PAD], -1, tl.int32), mask=p0 + blocks < num_blocks)
    tl.store(count_ptr, count)


@triton.jit
def _select_blocks_kernel(
    Q, S, INDICES, COUNTS, KV_START, UNION, SLOPES,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_sb, stride_sh, stride_sn, stride_sd,
    stride_ib, stride_ih, stride_it, stride_ik,
    stride_cb, stride_ch, stride_ct,
    num_queries, key_length, q_offset, num_blocks, scale,
    top_left, top_right, search_steps, first_tile, band_tiles,
    SEL_HEADS: tl.constexpr, HEADS_PER_ROW: tl.constexpr, GROUP: tl.constexpr, QUERY_TILE: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_Q: tl.constexpr, NB_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, D_CHUNK: tl.constexpr, SINK_BLOCKS: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, ALIBI: tl.constexpr, QUERY_STRIDE: tl.constexpr,
    TILE_ROWS: tl.constexpr, LOGITS_IN: tl.constexpr, COMPACT: tl.constexpr,
):
    row_id = tl.program_id(0)
    tile = first_tile + band_tiles - 1 - tl.program_id(1)  # the band's heaviest tiles first
    b = row_id // SEL_HEADS
    sel_head = row_id % SEL_HEADS
    first_q_head = sel_head * HEADS_PER_ROW
    kv_head = first_q_head // GROUP
    kv_start = tl.load(KV_START + b).to(tl.int32)
    pad_q = tl.minimum(tl.maximum(kv_start - q_offset, 0), num_queries)

    # Row blocks that exist: j < num_blocks and their first slot kv_start + j * BLOCK_SIZE < key_length.
    last_block = tl.minimum(num_blocks - 1, tl.where(key_length > kv_start, (key_length - 1 - kv_start) // BLOCK_SIZE, -1))
    blocks = tl.arange(0, NB_PAD)
    s_base = S + b.to(tl.int64) * stride_sb + kv_head * stride_sh
    q_base = Q + b.to(tl.int64) * stride_qb
    # The tile's union lives in a scratch row (registers hold only the logits): zeroed, OR-ed by stores of 1.
    union_row = UNION + ((b * SEL_HEADS + sel_head) * band_tiles + tile - first_tile).to(tl.int64) * NB_PAD
    tl.store(union_row + blocks, tl.zeros([NB_PAD], tl.int8))
    tl.debug_barrier()
    # The tile's searching queries: every QUERY_STRIDE-th (the last of each group) and its last (TILE_ROWS each).
    tile_first = pad_q + tile * QUERY_TILE
    tile_last = tl.minimum(tile_first + QUERY_TILE, num_queries) - 1
    for r0 in range(0, ROWS, BLOCK_Q):
        rows = r0 + tl.arange(0, BLOCK_Q)
        head = first_q_head + rows // TILE_ROWS
        query = tile_first + (rows % TILE_ROWS) * QUERY_STRIDE + QUERY_STRIDE - 1
        if QUERY_STRIDE > 1:  # the tile's last group ends at its last query
            query = tl.minimum(query, tile_last)
        real = (rows < ROWS) & (query < num_queries) & (query >= tile_first)
        q_slot = q_offset + query
        # A query sees blocks 0 .. its own (the rest start after it): one bound per row, -1 for no query.
        own_block = (q_slot - kv_start) // BLOCK_SIZE
        row_last = tl.where(real, tl.minimum(own_block, last_block), -1)

        if LOGITS_IN:  # S holds each query's block logits [B, Hq, Sq, num_blocks] (strides b, head, query, block)
            if COMPACT:  # only the searching queries' rows: TILE_ROWS per tile (reference.searching_queries)
                row_in = tile * TILE_ROWS + rows % TILE_ROWS
            else:
                row_in = query
            rows_in = S + b.to(tl.int64) * stride_sb + head.to(tl.int64) * stride_sh + row_in.to(tl.int64) * stride_sn
            logits = tl.load(rows_in[:, None] + blocks[None, :] * stride_sd,
                             mask=blocks[None, :] <= row_last[:, None], other=float("-inf")).to(tl.float32)
        else:
            # Summaries past the chunk's last visible block are not read (masked lanes fetch nothing).
            logits = _block_logits(
                q_base + head.to(tl.int64) * stride_qh + query.to(tl.int64) * stride_qs, s_base + blocks * stride_sn,
                stride_qd, stride_sd, real, blocks <= tl.max(row_last, 0), row_last, scale, SLOPES, head, q_slot,
                kv_start, blocks, BLOCK_Q, NB_PAD, BLOCK_SIZE, HEAD_DIM, D_PAD, D_CHUNK, DOT_DTYPE, PRECISION, ALIBI)
        chosen = _choose(logits, row_last, own_block, blocks, top_left, top_right, search_steps, SINK_BLOCKS, True)
        tile_chose = tl.max(chosen.to(tl.int32), 0)
        tl.store(union_row + blocks, tl.full([NB_PAD], 1, tl.int8), mask=tile_chose > 0)
    if QUERY_STRIDE > 1:  # the own blocks of the queries that did not search: those from the first's to the last's
        own_first = (q_offset + tile_first - kv_start) // BLOCK_SIZE
        own_last = tl.minimum((q_offset + tile_last - kv_start) // BLOCK_SIZE, last_block)
        own_last = tl.where(tile_first <= tile_last, own_last, -1)  # (a tile of padding queries only)
        tl.store(union_row + blocks, tl.full([NB_PAD], 1, tl.int8), mask=(blocks >= own_first) & (blocks <= own_last))
    tl.debug_barrier()

    union = tl.load(union_row + blocks, cache_modifier=".cg").to(tl.int32)
    _store_selection(union, blocks, INDICES + b.to(tl.int64) * stride_ib + sel_head * stride_ih + tile * stride_it,
                     stride_ik, COUNTS + b * stride_cb + sel_head * stride_ch + tile * stride_ct, num_blocks, NB_PAD)



@triton.jit
def _decode_select_kernel(
    Q, S, LOGITS, KV_START, INDICES, COUNTS, TICKETS, SLOPES, LENGTH,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_sb, stride_sh, stride_sn, stride_sd,
    stride_ib, stride_ih, stride_ik,
    stride_cb, stride_ch,
    num_queries, key_length, q_offset, num_blocks, scale, top_left, top_right, search_steps, chunks,
    SEL_HEADS: tl.constexpr, HEADS_PER_ROW: tl.constexpr, GROUP: tl.constexpr, QUERY_TILE: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_Q: tl.constexpr, NB_PAD: tl.constexpr, NB_CHUNK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, D_CHUNK: tl.constexpr,
    SINK_BLOCKS: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, ALIBI: tl.constexpr,
    DEVICE_LENGTH: tl.constexpr, SEARCH_ROWS: tl.constexpr,
):
    """Selection of a call with one query tile of few rows (decode), in one launch.

    One program per (selection row, chunk of NB_CHUNK blocks) writes the chunk's scaled, masked logits to
    LOGITS (one program per row would read the whole summary row through one SM); the last program of a
    row to finish (a ticket per row, reset by it) reads the row's logits back and selects, over its
    ``SEARCH_ROWS`` (the real rows, padded to a power of two; the logits need ``BLOCK_Q >= 16`` rows for the
    dot, the search does not). With DEVICE_LENGTH the key length (and so the query offset) is read from LENGTH.
    """
    row_id = tl.program_id(0)
    blocks = tl.program_id(1) * NB_CHUNK + tl.arange(0, NB_CHUNK)
    b = row_id // SEL_HEADS
    sel_head = row_id % SEL_HEADS
    first_q_head = sel_head * HEADS_PER_ROW
    kv_head = first_q_head // GROUP
    if DEVICE_LENGTH:
        key_length = tl.load(LENGTH).to(tl.int32)
        q_offset = key_length - num_queries
    kv_start = tl.load(KV_START + b).to(tl.int32)
    pad_q = tl.minimum(tl.maximum(kv_start - q_offset, 0), num_queries)
    last_block = tl.minimum(num_blocks - 1, tl.where(key_length > kv_start, (key_length - 1 - kv_start) // BLOCK_SIZE, -1))
    rows = tl.arange(0, BLOCK_Q)
    head = first_q_head + rows // QUERY_TILE
    query = pad_q + rows % QUERY_TILE
    real = (rows < ROWS) & (query < num_queries)
    q_slot = q_offset + query
    own_block = (q_slot - kv_start) // BLOCK_SIZE
    row_last = tl.where(real, tl.minimum(own_block, last_block), -1)
    logits = _block_logits(
        Q + b.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh + query * stride_qs,
        S + b.to(tl.int64) * stride_sb + kv_head * stride_sh + blocks * stride_sn, stride_qd, stride_sd, real,
        blocks <= last_block, row_last, scale, SLOPES, head, q_slot, kv_start, blocks, BLOCK_Q, NB_CHUNK, BLOCK_SIZE,
        HEAD_DIM, D_PAD, D_CHUNK, DOT_DTYPE, PRECISION, ALIBI)
    row_logits = LOGITS + (row_id * BLOCK_Q + rows[:, None]).to(tl.int64) * NB_PAD
    tl.store(row_logits + blocks[None, :], logits)

    tl.debug_barrier()
    ticket = tl.atomic_add(TICKETS + row_id, 1, sem="acq_rel")
    if ticket == chunks - 1:
        all_blocks = tl.arange(0, NB_PAD)
        s_rows = tl.arange(0, SEARCH_ROWS)  # new names: the rows above are BLOCK_Q long
        s_query = pad_q + s_rows % QUERY_TILE
        s_real = (s_rows < ROWS) & (s_query < num_queries)
        s_own = (q_offset + s_query - kv_start) // BLOCK_SIZE
        s_last = tl.where(s_real, tl.minimum(s_own, last_block), -1)
        row = tl.load(LOGITS + (row_id * BLOCK_Q + s_rows[:, None]).to(tl.int64) * NB_PAD + all_blocks[None, :],
                      cache_modifier=".cg")
        chosen = _choose(row, s_last, s_own, all_blocks, top_left, top_right, search_steps, SINK_BLOCKS, False)
        _store_selection(tl.max(chosen.to(tl.int32), 0), all_blocks,
                         INDICES + b.to(tl.int64) * stride_ib + sel_head * stride_ih, stride_ik,
                         COUNTS + b * stride_cb + sel_head * stride_ch, num_blocks, NB_PAD)
        tl.store(TICKETS + row_id, 0)


def _bands(num_tiles: int, query_tile: int, q_offset: int, block_size: int, num_blocks: int) -> list[tuple[int, int, int]]:
    """``(first_tile, tiles, nb_pad)``: consecutive tiles grouped by the power-of-two width covering the blocks
    their queries can see (at most ``(q_offset + (t + 1) * query_tile - 1) // block_size + 1``, any padding)."""
    widest = max(16, next_power_of_2(num_blocks))
    bands, start, width = [], 0, 16
    while start < num_tiles:
        if width >= widest:
            end = num_tiles
        else:
            # tile t fits when q_offset + (t + 1) * query_tile - 1 < width * block_size
            end = min(num_tiles, max(start, (width * block_size - q_offset) // query_tile))
        if end > start:
            bands.append((start, end - start, min(width, widest)))
            start = end
        width *= 2
    return bands


def select_blocks(
    query: torch.Tensor,
    summaries: torch.Tensor,
    *,
    scale: float,
    q_offset: int,
    kv_start: torch.Tensor | RowLayout,
    block_size: int,
    top_k: tuple[int, int],
    query_tile: int,
    head_union: bool,
    sink_blocks: int = 1,
    search_steps: int = 16,
    key_length: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    length: torch.Tensor | None = None,
    query_stride: int = 1,
) -> BlockSelection:
    """Triton version of :func:`hf_sparse.kernels.reference.select_blocks` (same arguments and result).

    ``query`` ``[B, Hq, Sq, D]`` and ``summaries`` ``[B, Hkv, num_blocks, D]`` take any strides. ``out``
    (int32 ``indices [B, H, T, num_blocks]`` and ``counts [B, H, T]``) is filled in place when given. With one
    query tile spanning the call (decode) nothing is read back to the host. ``alibi_slopes`` (``[Hq]``, on the
    query's device) adds each head's ALiBi bias to its block logits, as the reference does. ``length`` (a
    one-element integer tensor on the device; decode only) gives the key length, and ``q_offset = length - Sq``,
    on the device: ``summaries`` may then be a static cache's whole storage, and one launch serves every step
    of a CUDA graph.
    """
    if query.dim() != 4 or summaries.dim() != 4:
        raise ValueError(f"query [B,Hq,Sq,D] and summaries [B,Hkv,nb,D] expected, got {tuple(query.shape)}, "
                         f"{tuple(summaries.shape)}")
    batch, q_heads, num_queries, head_dim = query.shape
    kv_heads, num_blocks = summaries.shape[1], summaries.shape[2]
    if summaries.shape[0] != batch or summaries.shape[3] != head_dim or kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"summaries {tuple(summaries.shape)} do not match query {tuple(query.shape)}")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32) or not summaries.is_floating_point():
        raise TypeError(f"query must be float16/bfloat16/float32, got {query.dtype}")
    starts = row_starts(kv_start)
    if starts.shape != (batch,) or starts.is_floating_point():
        raise ValueError(f"kv_start must be an integer [batch={batch}] tensor, got {tuple(starts.shape)} {starts.dtype}")
    if query.device != summaries.device:
        raise ValueError("query and summaries must be on one device")
    left, right = top_k
    if not 1 <= left <= right:
        raise ValueError(f"top_k must satisfy 1 <= left <= right, got {top_k}")
    if query_tile < 1 or block_size < 1 or search_steps < 0 or query_stride < 1:
        raise ValueError("query_tile, block_size and query_stride must be >= 1, search_steps >= 0")
    if query_stride > 1 and length is not None:
        raise ValueError("select_blocks: query_stride is for prefill; a device-side length is for decode")
    query_stride = min(query_stride, query_tile)  # from the tile's length on, only its last query searches
    if max(16, next_power_of_2(max(num_blocks, 1))) > MAX_BLOCKS:
        logger.warning("select_blocks: %d blocks exceed the Triton kernel's %d; using the PyTorch reference",
                       num_blocks, MAX_BLOCKS)
        if length is not None:  # the reference takes host lengths (one device-to-host read)
            key_length = int(length)
            q_offset = key_length - num_queries
        return reference.select_blocks(query, summaries, scale=scale, q_offset=q_offset, kv_start=kv_start,
                                       block_size=block_size, top_k=top_k, query_tile=query_tile,
                                       head_union=head_union, sink_blocks=sink_blocks, search_steps=search_steps,
                                       key_length=key_length, alibi_slopes=alibi_slopes,
                                       query_stride=query_stride)
    slopes = alibi_args(alibi_slopes, query)
    length_arg = check_length(length, query.device)
    if length is not None:
        if query_tile < num_queries:
            raise ValueError("select_blocks: a device-side length is for decode (one query tile spanning the call)")
        q_offset = key_length = 0  # read from `length` in the kernel
    key_length = q_offset + num_queries if key_length is None else key_length
    num_tiles = reference.num_query_tiles(num_queries, q_offset, kv_start, query_tile)
    kv_start = starts.to(query.device)  # any integer dtype: read as int32 in the kernel (no cast launch)
    sel_heads = kv_heads if head_union else q_heads
    shape = (batch, sel_heads, num_tiles, num_blocks)
    if out is None:
        indices = torch.empty(shape, dtype=torch.int32, device=query.device)
        counts = torch.empty(shape[:3], dtype=torch.int32, device=query.device)
    else:
        indices, counts = out
        if tuple(indices.shape) != shape or tuple(counts.shape) != shape[:3] \
                or indices.dtype != torch.int32 or counts.dtype != torch.int32:
            raise ValueError(f"out must be int32 indices {shape} and counts {shape[:3]}")
    selection = BlockSelection(indices=indices, counts=counts, block_size=block_size, query_tile=query_tile)
    if batch * sel_heads * num_tiles == 0:
        return selection
    if num_blocks == 0:
        counts.zero_()
        return selection

    interpret = interpreting()
    if interpret:
        dot_dtype, precision, elem = tl.float32, "ieee", 4
    elif query.dtype == torch.float32:
        dot_dtype, precision, elem = tl.float32, "tf32", 4
    else:
        # fp16 operands keep tf32's 10-bit mantissa at half the bytes; summaries are converted once when
        # several tiles re-read them, in registers otherwise (decode).
        dot_dtype, precision, elem = tl.float16, "tf32", 2
        if num_tiles > 1 and summaries.dtype != torch.float16:
            summaries = summaries.to(torch.float16)
    elem = max(elem, summaries.element_size())  # the loaded tile, before any conversion, bounds the chunk too
    d_pad = max(16, next_power_of_2(head_dim))
    tile_rows = -(-query_tile // query_stride)  # searching queries per tile and head
    rows = (q_heads // kv_heads if head_union else 1) * tile_rows
    # With a device-side length any of the blocks may be visible: one band as wide as the summaries.
    band_offset = num_blocks * block_size if length is not None else q_offset
    for first_tile, tiles, nb_pad in _bands(num_tiles, query_tile, band_offset, block_size, num_blocks):
        # Each chunk of BLOCK_Q queries re-reads the summaries: at least min_block_q queries per read while
        # the row has at most 1024 blocks (32 x 1024 logits over 8 warps: measured fastest), 16 past that.
        block_q = TUNING["logits_per_program"] // nb_pad
        block_q = max(TUNING["min_block_q"] if nb_pad <= 1024 else 16, min(TUNING["max_block_q"], block_q))
        block_q = max(16, min(block_q, next_power_of_2(rows)))
        warps = max(4, min(TUNING["max_warps"], block_q * nb_pad // TUNING["logits_per_warp"]))
        d_chunk = 16  # the summaries chunk of one dot: bounded registers while loading, shared memory for the dot
        while d_chunk * 2 <= min(d_pad, TUNING["chunk_bytes"] // (nb_pad * elem)):
            d_chunk *= 2
        args = (num_queries, key_length, q_offset, num_blocks, float(scale))
        shape_args = dict(SEL_HEADS=sel_heads, HEADS_PER_ROW=q_heads // sel_heads, GROUP=q_heads // kv_heads,
                          QUERY_TILE=query_tile, ROWS=rows, BLOCK_Q=block_q, NB_PAD=nb_pad, BLOCK_SIZE=block_size,
                          HEAD_DIM=head_dim, D_PAD=d_pad, DOT_DTYPE=dot_dtype, PRECISION=precision,
                          SINK_BLOCKS=sink_blocks, ALIBI=alibi_slopes is not None)
        if num_tiles == 1 and rows <= block_q and query_stride == 1:  # decode
            nb_chunk = min(nb_pad, 64)
            logits = torch.empty(batch * sel_heads * block_q * nb_pad, dtype=torch.float32, device=query.device)
            _decode_select_kernel[(batch * sel_heads, nb_pad // nb_chunk)](
                query, summaries, logits, kv_start, indices, counts, ticket_counters(batch * sel_heads, query.device), slopes,
                length_arg,
                *query.stride(), *summaries.stride(), indices.stride(0), indices.stride(1), indices.stride(3),
                counts.stride(0), counts.stride(1), *args, left, right, search_steps, nb_pad // nb_chunk,
                NB_CHUNK=nb_chunk, D_CHUNK=min(d_pad, 64), DEVICE_LENGTH=length is not None, num_warps=warps,
                SEARCH_ROWS=next_power_of_2(rows), **shape_args,
            )
            continue
        if length is not None:
            raise ValueError(f"select_blocks: a device-side length needs the decode kernel ({rows} query rows per "
                             f"selection row exceed its {block_q})")
        union = torch.empty(batch * sel_heads * tiles * nb_pad, dtype=torch.int8, device=query.device)
        _select_blocks_kernel[(batch * sel_heads, tiles)](
            query, summaries, indices, counts, kv_start, union, slopes,
            *query.stride(), *summaries.stride(), *indices.stride(), *counts.stride(),
            *args, left, right, search_steps, first_tile, tiles,
            D_CHUNK=d_chunk, QUERY_STRIDE=query_stride, TILE_ROWS=tile_rows, LOGITS_IN=False, COMPACT=False,
            num_warps=warps,
            **shape_args,
        )
    return selection


def select_blocks_from_logits(
    logits: torch.Tensor,
    *,
    kv_heads: int,
    q_offset: int,
    kv_start: torch.Tensor | RowLayout,
    block_size: int,
    top_k: tuple[int, int],
    query_tile: int,
    head_union: bool,
    sink_blocks: int = 1,
    search_steps: int = 16,
    key_length: int | None = None,
    query_stride: int = 1,
    num_queries: int | None = None,
) -> BlockSelection:
    """Triton version of :func:`hf_sparse.kernels.reference.select_blocks_from_logits`: the prefill kernel of
    :func:`select_blocks` reading each query's block logits (``[B, Hq, Sq, num_blocks]``, any strides; or only the
    searching queries' rows, as the reference takes them) instead of computing them from summaries."""
    if logits.dim() != 4 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float [B, Hq, Sq, num_blocks] tensor, got {tuple(logits.shape)} "
                         f"{logits.dtype}")
    batch, q_heads, rows_given, num_blocks = logits.shape
    num_queries = rows_given if num_queries is None else num_queries
    compact = rows_given != num_queries
    if compact:
        reference.check_compact(rows_given, num_queries, kv_start, query_tile, min(query_stride, query_tile))
    if kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"kv_heads ({kv_heads}) must divide the query heads ({q_heads})")
    starts = row_starts(kv_start)
    if starts.shape != (batch,) or starts.is_floating_point():
        raise ValueError(f"kv_start must be an integer [batch={batch}] tensor, got {tuple(starts.shape)} {starts.dtype}")
    left, right = top_k
    if not 1 <= left <= right:
        raise ValueError(f"top_k must satisfy 1 <= left <= right, got {top_k}")
    if query_tile < 1 or block_size < 1 or search_steps < 0 or query_stride < 1:
        raise ValueError("query_tile, block_size and query_stride must be >= 1, search_steps >= 0")
    query_stride = min(query_stride, query_tile)
    arguments = dict(kv_heads=kv_heads, q_offset=q_offset, kv_start=kv_start, block_size=block_size, top_k=top_k,
                     query_tile=query_tile, head_union=head_union, sink_blocks=sink_blocks,
                     search_steps=search_steps, key_length=key_length, query_stride=query_stride,
                     num_queries=num_queries)
    if max(16, next_power_of_2(max(num_blocks, 1))) > MAX_BLOCKS:
        logger.warning("select_blocks_from_logits: %d blocks exceed the Triton kernel's %d; using the PyTorch "
                       "reference", num_blocks, MAX_BLOCKS)
        return reference.select_blocks_from_logits(logits, **arguments)
    key_length = q_offset + num_queries if key_length is None else key_length
    num_tiles = reference.num_query_tiles(num_queries, q_offset, kv_start, query_tile)
    kv_start = starts.to(logits.device)
    sel_heads = kv_heads if head_union else q_heads
    shape = (batch, sel_heads, num_tiles, num_blocks)
    indices = torch.empty(shape, dtype=torch.int32, device=logits.device)
    counts = torch.empty(shape[:3], dtype=torch.int32, device=logits.device)
    selection = BlockSelection(indices=indices, counts=counts, block_size=block_size, query_tile=query_tile)
    if batch * sel_heads * num_tiles == 0:
        return selection
    if num_blocks == 0:
        counts.zero_()
        return selection
    tile_rows = -(-query_tile // query_stride)
    rows = (q_heads // kv_heads if head_union else 1) * tile_rows
    slopes = alibi_args(None, logits)
    for first_tile, tiles, nb_pad in _bands(num_tiles, query_tile, q_offset, block_size, num_blocks):
        block_q = TUNING["logits_per_program"] // nb_pad
        block_q = max(TUNING["min_block_q"] if nb_pad <= 1024 else 16, min(TUNING["max_block_q"], block_q))
        block_q = max(16, min(block_q, next_power_of_2(rows)))
        warps = max(4, min(TUNING["max_warps"], block_q * nb_pad // TUNING["logits_per_warp"]))
        union = torch.empty(batch * sel_heads * tiles * nb_pad, dtype=torch.int8, device=logits.device)
        _select_blocks_kernel[(batch * sel_heads, tiles)](
            logits, logits, indices, counts, kv_start, union, slopes,
            0, 0, 0, 0, *logits.stride(), *indices.stride(), *counts.stride(),
            num_queries, key_length, q_offset, num_blocks, 1.0, left, right, search_steps, first_tile, tiles,
            SEL_HEADS=sel_heads, HEADS_PER_ROW=q_heads // sel_heads, GROUP=q_heads // kv_heads, QUERY_TILE=query_tile,
            ROWS=rows, BLOCK_Q=block_q, NB_PAD=nb_pad, BLOCK_SIZE=block_size, HEAD_DIM=16, D_PAD=16, D_CHUNK=16,
            DOT_DTYPE=tl.float32, PRECISION="ieee", SINK_BLOCKS=sink_blocks, ALIBI=False,
            QUERY_STRIDE=query_stride, TILE_ROWS=tile_rows, LOGITS_IN=True, COMPACT=compact, num_warps=warps,
        )
    return selection
