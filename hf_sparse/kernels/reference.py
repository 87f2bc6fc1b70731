"""Pure-PyTorch reference of every op: the readable spec, the CPU path and the tests' ground truth.

Conventions shared with the Triton ops:
  * tensors are BNSD: query ``[B, Hq, Sq, D]``, key ``[B, Hkv, Skv, D]``, value ``[B, Hkv, Skv, Dv]``
    (any strides); ``Hq`` is a multiple of ``Hkv`` (GQA group ``G = Hq // Hkv``);
  * left padding: row ``b`` holds its sequence in key slots ``kv_start[b] <= s < Skv``; query ``i`` sits
    at slot ``q_offset + i`` and sees valid slots ``<=`` it; queries before ``kv_start[b]`` are padding;
  * blocks and query tiles are counted per row from its first valid slot (varlen semantics), so a
    left-padded row is processed exactly as the same sequence alone: key block ``j`` of row ``b`` covers
    slots ``kv_start[b] + [j * block_size, (j + 1) * block_size)``; query tile ``t`` of row ``b`` holds
    queries ``pad_q[b] + [t * query_tile, (t + 1) * query_tile)`` where
    ``pad_q[b] = clamp(kv_start[b] - q_offset, 0, Sq)`` is the number of padding queries of the call;
  * ``kv_start`` is a :class:`~hf_sparse.selection.RowLayout` (the starts with their range known on the host,
    as the cache passes it down) or a plain ``[B]`` tensor, whose range is then read where it is needed;
  * scores, softmax and accumulation are float32; a query that sees no valid key (padding) outputs
    zeros and log-sum-exp ``-inf``;
  * ``softcap`` (Gemma 2's attention logit softcapping) maps each scaled score ``s`` to
    ``softcap * tanh(s / softcap)`` before masking and softmax (:func:`soft_cap`); ``sinks`` (GPT-OSS's ``s_aux``,
    one logit per query head) is an extra key of that logit and a zero value, counted in the softmax denominator
    only (:func:`attention_sinks`).
"""
from __future__ import annotations

import math

import torch

from ..selection import BlockSelection, RowLayout, row_starts

# Queries processed together in the reference loops: bounds peak memory at long lengths.
_QUERY_CHUNK = 1024


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def kv_start_range(kv_start: torch.Tensor | RowLayout) -> tuple[int, int]:
    """(min, max) of the row starts: a :class:`RowLayout`'s own, else read from the tensor (one host read)."""
    layout = RowLayout.of(kv_start)
    return layout.low, layout.high


def num_row_blocks(key_length: int, kv_start: torch.Tensor | RowLayout, block_size: int) -> int:
    """Blocks of the longest row (the width of summaries and block masks)."""
    return _ceil_div(key_length - kv_start_range(kv_start)[0], block_size)


def padding_queries(num_queries: int, q_offset: int, kv_start: torch.Tensor | RowLayout) -> torch.Tensor:
    """``pad_q[b]``: leading padding queries of each row in this call."""
    return (row_starts(kv_start) - q_offset).clamp(0, num_queries)


def num_query_tiles(num_queries: int, q_offset: int, kv_start: torch.Tensor | RowLayout, query_tile: int) -> int:
    """Tiles of the row with the most real queries (1, without reading kv_start, when one tile spans the call)."""
    if query_tile >= num_queries:
        return 1
    fewest_padding = min(max(kv_start_range(kv_start)[0] - q_offset, 0), num_queries)
    return max(1, _ceil_div(num_queries - fewest_padding, query_tile))


def tile_last_blocks(num_tiles: int, query_tile: int, num_queries: int, q_offset: int | torch.Tensor,
                     kv_start: torch.Tensor | RowLayout, block_size: int) -> torch.Tensor:
    """int64 ``[B, num_tiles]``: the row block of each query tile's last real query (its last causal block), -1 for
    a tile holding none. Tiles count from each row's first real query (as :func:`select_blocks`); ``q_offset`` may
    be a one-element device tensor (no host read)."""
    kv_start = row_starts(kv_start)
    pad_q = (kv_start - q_offset).clamp(0, num_queries)
    tiles = torch.arange(num_tiles, device=kv_start.device)
    last_query = torch.clamp_max(pad_q[:, None] + (tiles[None, :] + 1) * query_tile, num_queries) - 1
    has_query = last_query >= pad_q[:, None] + tiles[None, :] * query_tile
    last_block = torch.div(q_offset + last_query - kv_start[:, None], block_size, rounding_mode="floor")
    return torch.where(has_query, last_block, torch.full_like(last_block, -1)).clamp_min(-1)


def check_softcap_and_sinks(softcap: float | None, sinks: torch.Tensor | None, query: torch.Tensor) -> None:
    """Raise a clear error unless ``softcap`` is None or a positive finite number and ``sinks`` is None or a
    floating-point ``[Hq]`` tensor on the query's device."""
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not 0.0 < float(softcap) < math.inf):
        raise ValueError(f"softcap (attention logit softcapping) must be a positive finite number, got {softcap!r}")
    if sinks is not None:
        q_heads = query.shape[1]
        if (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (q_heads,) or not sinks.is_floating_point()
                or sinks.device != query.device):
            got = (f"{sinks.dtype} {tuple(sinks.shape)} on {sinks.device}" if isinstance(sinks, torch.Tensor)
                   else type(sinks).__name__)
            raise ValueError(f"sinks (attention sink logits, s_aux) must be a floating-point [q_heads={q_heads}] "
                             f"tensor on {query.device}, got {got}")


def soft_cap(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """``softcap * tanh(scores / softcap)``: Gemma 2's attention logit softcapping, applied to the scaled scores
    (natural-log units) before masking, as transformers' eager attention applies it."""
    return torch.tanh(scores / softcap) * softcap


def attention_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The output of attention with a sink per query head (GPT-OSS's ``s_aux``): an extra key whose logit is
    ``sinks[h]`` and whose value is zero, so only the softmax denominator grows. From the output ``[B, Hq, Sq, Dv]``
    without the sink and its log-sum-exp ``lse`` ``[B, Hq, Sq]`` (over every key of the query, after any merge of
    partial results): ``out * sigmoid(lse - sinks[h])``, in float32; a query that saw no key stays zero."""
    factor = torch.sigmoid(lse.float() - sinks.float().to(lse.device)[None, :, None])
    return (out.float() * factor[..., None]).to(out.dtype)


def block_summaries(
    keys: torch.Tensor,
    gate_weight: torch.Tensor | None,
    kv_start: torch.Tensor | RowLayout,
    block_size: int,
    first_block: int = 0,
    num_blocks: int | None = None,
) -> torch.Tensor:
    """Compressed key per block: ``sum_i valid_i * K_i * W[h, i, :]`` over the block's slots.

    Without a gate (``gate_weight=None``) the summary is the mean of the block's valid keys. Slots past
    ``Skv`` (a partial last block) are skipped; a block with no valid slot is zero. Returns float32
    ``[B, Hkv, n, D]`` for row blocks ``first_block .. first_block + n - 1``.
    """
    batch, heads, length, dim = keys.shape
    if num_blocks is None:
        num_blocks = num_row_blocks(length, kv_start, block_size) - first_block
    offsets = first_block * block_size + torch.arange(num_blocks * block_size, device=keys.device)
    slots = row_starts(kv_start).to(keys.device)[:, None] + offsets[None, :]  # [B, n * bs]
    valid = slots < length
    index = slots.clamp_max(length - 1)[:, None, :, None].expand(batch, heads, -1, dim)
    chunk = torch.gather(keys, 2, index).float().view(batch, heads, num_blocks, block_size, dim)
    valid = valid.view(batch, 1, num_blocks, block_size, 1).float()
    if gate_weight is None:
        return (chunk * valid).sum(3) / valid.sum(3).clamp_min(1.0)
    weight = gate_weight.float().view(1, heads, 1, block_size, dim)
    return (chunk * valid * weight).sum(3)


def block_availability(
    num_queries: int, num_blocks: int, q_offset: int | torch.Tensor, kv_start: torch.Tensor | RowLayout, block_size: int,
    key_length: int | torch.Tensor,
) -> torch.Tensor:
    """Boolean ``[B, Sq, num_blocks]``: the row block starts at or before the query's slot (and exists).
    ``q_offset`` / ``key_length`` may be one-element tensors on ``kv_start``'s device (no host read)."""
    kv_start = row_starts(kv_start)
    device = kv_start.device
    q_slot = q_offset + torch.arange(num_queries, device=device)
    block_first = kv_start[:, None] + torch.arange(num_blocks, device=device)[None, :] * block_size  # [B, nb]
    return (block_first[:, None, :] <= q_slot[None, :, None]) & (block_first[:, None, :] < key_length)


def block_logits(
    query: torch.Tensor,
    summaries: torch.Tensor,
    scale: float,
    available: torch.Tensor,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``q . Kc_j * scale + bias`` over the available blocks: float32 ``[B, Hq, Sq, nb]`` (``-inf`` elsewhere);
    ``bias`` (e.g. ALiBi) broadcasts to that shape. ``softcap`` caps the scaled logits (:func:`soft_cap`) before
    the bias, as the attention caps its scores."""
    batch, q_heads, num_queries, dim = query.shape
    kv_heads, num_blocks = summaries.shape[1], summaries.shape[2]
    # The query heads of a KV group as rows of one product with the group's summaries (no copy of them per head).
    grouped = query.float().reshape(batch, kv_heads, q_heads // kv_heads * num_queries, dim)
    logits = torch.matmul(grouped, summaries.float().transpose(-1, -2)).view(batch, q_heads, num_queries, num_blocks)
    logits = logits * scale
    if softcap is not None:
        logits = soft_cap(logits, softcap)
    if bias is not None:
        logits = logits + bias
    return logits.masked_fill(~available[:, None], float("-inf"))


def threshold_topk(
    logits: torch.Tensor, available: torch.Tensor, top_k: tuple[int, int], search_steps: int
) -> torch.Tensor:
    """Approximate top-k per row: the blocks whose score reaches a cut found by bisection.

    ``logits`` are any scores whose softmax is the block distribution (e.g. :func:`block_logits`), finite
    where ``available`` (the rest is ignored). Rows with at most ``top_k[1]`` available blocks select all of
    them. The others run a bisection on ``f`` in ``[0, 1]``, the cut's probability relative to the row's top
    block (cut = max + log f), for ``search_steps`` steps, stopping per row once ``count(logit >= cut)`` lands
    in ``[top_k[0], top_k[1]]``.
    Halving f from 1 reaches no deeper than ``search_steps * log 2`` under the row's best: a row with fewer
    than ``top_k[0]`` blocks above that (a sharp head, where the search would find nothing) bisects the cut
    itself instead, between its lowest available logit and that depth, in the same number of steps.

    A row that never lands keeps its last cut with too many blocks (more blocks rather than fewer).
    Returns the boolean selection, same shape as ``logits``.
    """
    left, right = top_k
    n_available = available.sum(-1, keepdim=True)
    logits = logits.masked_fill(~available, float("-inf"))
    row_max = logits.amax(-1, keepdim=True)
    found = (n_available <= right).expand_as(row_max).clone()
    # The deepest cut halving f reaches; a row with fewer than `left` blocks above it bisects the cut instead.
    deepest = row_max + torch.log(torch.full_like(row_max, 0.5 ** search_steps))
    deep = ~found & ((logits >= deepest).sum(-1, keepdim=True) < left)
    # Bounds of the bisection: f in [0, 1], or for a deep row the cut in [its lowest logit, deepest].
    lowest = logits.masked_fill(~available, float("inf")).amin(-1, keepdim=True)
    low = torch.where(deep, lowest, torch.zeros_like(row_max))
    high = torch.where(deep, deepest, torch.ones_like(row_max))
    cut = torch.full_like(row_max, float("-inf"))
    for _ in range(search_steps):
        mid = (low + high) * 0.5
        mid_cut = torch.where(deep, mid, row_max + torch.log(mid.clamp_min(1e-30)))  # (a deep row's mid is a cut)
        count = (logits >= mid_cut).sum(-1, keepdim=True)
        landed = (count >= left) & (count <= right) & ~found
        cut = torch.where(landed, mid_cut, cut)
        found |= landed
        low = torch.where((count > right) & ~found, mid, low)
        high = torch.where((count < left) & ~found, mid, high)
    # A row that never landed: its last cut with too many blocks.
    cut = torch.where(found, cut, torch.where(deep, low, row_max + torch.log(low.clamp_min(1e-30))))
    selected = (logits >= cut) & available
    return torch.where(n_available <= right, available, selected)


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
    query_stride: int = 1,
) -> BlockSelection:
    """Per query and head: threshold top-k over block scores, plus forced blocks, united per row tile.

    Forced blocks: the query's own (diagonal) block and the row's first ``sink_blocks`` blocks. Each
    selection row unites the ``query_tile`` queries of a tile, and with ``head_union`` also the query heads
    of each GQA group (one row per KV head). ``key_length`` defaults to ``q_offset + Sq``. ``alibi_slopes``
    (``[Hq]``) adds head ``h``'s ALiBi bias at the block's centre (at most the query's own slot) to its score.
    With ``query_stride`` S > 1 only the tile's queries ``S - 1, 2S - 1, ...`` and its last query run the
    threshold top-k; the others add only their forced blocks.
    """
    kv_heads, num_blocks = summaries.shape[1], summaries.shape[2]

    def logits_of(q0: int, q1: int, available: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return block_logits(query[:, :, q0:q1], summaries, scale, available, bias)

    return _select(logits_of, query.shape, kv_heads, num_blocks, q_offset=q_offset, kv_start=kv_start,
                   block_size=block_size, top_k=top_k, query_tile=query_tile, head_union=head_union,
                   sink_blocks=sink_blocks, search_steps=search_steps, key_length=key_length,
                   alibi_slopes=alibi_slopes, query_stride=query_stride, device=query.device)


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
    """:func:`select_blocks` with each query's block scores given: ``logits`` ``[B, Hq, Sq, num_blocks]`` (float32,
    any finite value where a block is visible; what lies past a query's causal blocks is ignored), e.g. each block's
    largest logit in a few key directions (:func:`pooled_block_logits` of projected queries and keys). With
    ``num_queries`` other than ``logits.shape[2]`` (rows without padding only), ``logits`` holds only the rows of
    the queries that search, in the order of :func:`searching_queries`."""
    if logits.dim() != 4:
        raise ValueError(f"logits must be [B, Hq, Sq, num_blocks], got {tuple(logits.shape)}")
    batch, q_heads, rows_given, num_blocks = logits.shape
    num_queries = rows_given if num_queries is None else num_queries
    if kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"kv_heads ({kv_heads}) must divide the query heads ({q_heads})")
    if rows_given != num_queries:
        stride = min(query_stride, query_tile)
        check_compact(rows_given, num_queries, kv_start, query_tile, stride)
        full = logits.new_full((batch, q_heads, num_queries, num_blocks), float("-inf"))
        full[:, :, searching_queries(num_queries, query_tile, stride).to(logits.device)] = logits
        logits = full

    def logits_of(q0: int, q1: int, available: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return logits[:, :, q0:q1].float().masked_fill(~available[:, None], float("-inf"))

    return _select(logits_of, (batch, q_heads, num_queries, 0), kv_heads, num_blocks, q_offset=q_offset,
                   kv_start=kv_start, block_size=block_size, top_k=top_k, query_tile=query_tile,
                   head_union=head_union, sink_blocks=sink_blocks, search_steps=search_steps, key_length=key_length,
                   alibi_slopes=None, query_stride=query_stride, device=logits.device)


def searching_queries(num_queries: int, query_tile: int, query_stride: int) -> torch.Tensor:
    """The queries that run the threshold search with ``query_stride`` (rows without padding), ``ceil(query_tile /
    query_stride)`` per tile in the selection kernel's order: every ``query_stride``-th of a tile (the last of each
    group) and its last query (a tile's final group ends at it, so the tile's last entries may repeat it)."""
    tile_rows = -(-query_tile // query_stride)
    tiles = -(-num_queries // query_tile)
    tile = torch.arange(tiles)[:, None]
    last = torch.clamp((tile + 1) * query_tile, max=num_queries) - 1
    return torch.minimum(tile * query_tile + torch.arange(tile_rows)[None, :] * query_stride + query_stride - 1,
                         last).flatten()


def check_compact(rows: int, num_queries: int, kv_start: torch.Tensor | RowLayout, query_tile: int,
                  query_stride: int) -> None:
    """Raise ``ValueError`` unless ``rows`` logit rows are the searching queries' (:func:`searching_queries`) of
    ``num_queries`` unpadded queries."""
    expected = -(-num_queries // query_tile) * -(-query_tile // query_stride)
    if rows != expected:
        raise ValueError(f"logits of {rows} rows for {num_queries} queries: expected {num_queries} (every query) or "
                         f"{expected} (the searching queries' rows)")
    if bool((row_starts(kv_start) != 0).any()):
        raise ValueError("logits of the searching queries only: for rows without padding")


def _select(logits_of, query_shape, kv_heads: int, num_blocks: int, *, q_offset: int,
            kv_start: torch.Tensor | RowLayout, block_size: int, top_k: tuple[int, int], query_tile: int,
            head_union: bool, sink_blocks: int, search_steps: int, key_length: int | None,
            alibi_slopes: torch.Tensor | None, query_stride: int, device: torch.device) -> BlockSelection:
    """The selection of :func:`select_blocks` with the block logits of queries ``q0:q1`` from
    ``logits_of(q0, q1, available, bias)``."""
    if query_stride < 1:
        raise ValueError(f"query_stride must be >= 1, got {query_stride}")
    batch, q_heads, num_queries, _ = query_shape
    key_length = q_offset + num_queries if key_length is None else key_length
    num_tiles = num_query_tiles(num_queries, q_offset, kv_start, query_tile)
    kv_start = row_starts(kv_start).to(device)
    pad_q = padding_queries(num_queries, q_offset, kv_start)
    block_ids = torch.arange(num_blocks, device=device)
    tile_mask = torch.zeros(batch, q_heads, num_tiles + 1, num_blocks, dtype=torch.uint8, device=device)
    for q0 in range(0, num_queries, _QUERY_CHUNK):
        q1 = min(num_queries, q0 + _QUERY_CHUNK)
        query_ids = torch.arange(q0, q1, device=device)
        available = block_availability(q1 - q0, num_blocks, q_offset + q0, kv_start, block_size, key_length)
        bias = None
        if alibi_slopes is not None:
            q_slot = q_offset + query_ids  # [q]
            centre = kv_start[:, None] + block_ids[None, :] * block_size + (block_size - 1) / 2  # [B, nb]
            distance = torch.minimum(centre[:, None, :], q_slot[None, :, None].float()) - q_slot[None, :, None]
            bias = alibi_slopes.float().to(device)[None, :, None, None] * distance[:, None]  # [B, Hq, q, nb]
        logits = logits_of(q0, q1, available, bias)
        chosen = threshold_topk(logits, available[:, None], top_k, search_steps)
        own_block = torch.div(q_offset + query_ids[None, :] - kv_start[:, None], block_size, rounding_mode="floor")
        forced = (block_ids[None, None, :] == own_block[..., None]) | (block_ids < sink_blocks)[None, None, :]
        forced &= available
        real = query_ids[None, :] >= pad_q[:, None]
        tile = torch.div(query_ids[None, :] - pad_q[:, None], query_tile, rounding_mode="floor")
        if query_stride > 1:  # [B, q]: a query that searches (the last of its group of S, or of its tile)
            within = query_ids[None, :] - pad_q[:, None] - tile * query_tile
            searching = (within % query_stride == query_stride - 1) | (within == query_tile - 1) \
                | (query_ids == num_queries - 1)[None, :]
            chosen &= searching[:, None, :, None]
        chosen |= forced[:, None]
        tile = torch.where(real, tile, torch.full_like(tile, num_tiles))  # padding queries -> dummy tile
        index = tile[:, None, :, None].expand(batch, q_heads, q1 - q0, num_blocks)
        tile_mask.scatter_reduce_(2, index, chosen.to(torch.uint8), reduce="amax")
    mask = tile_mask[:, :, :num_tiles].bool()
    if head_union:
        mask = mask.view(batch, kv_heads, q_heads // kv_heads, num_tiles, num_blocks).any(2)
    return BlockSelection.from_mask(mask, block_size=block_size, query_tile=query_tile)


def sparse_attention(
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
    """Attention of each query over the valid, causal slots of its tile's selected row blocks.

    Returns the output ``[B, Hq, Sq, Dv]`` in the query dtype and the float32 log-sum-exp ``[B, Hq, Sq]``
    of the scaled scores (``-inf`` where a query sees no slot; its output is zero).

    ``logn_base`` (training length ``m``) turns on logN scaling: the scores of the query at row position
    ``n`` (1-based, counted from the row's first valid slot) are multiplied by :func:`logn_factors`, i.e.
    ``max(1, log(n) / log(m))`` as Qwen scales its queries. ``skip`` (``[B]`` bool) marks rows that get no
    work: their elements of ``out`` / ``lse`` are left as they are (given buffers keep their contents; fresh
    ones hold zeros and ``-inf`` in the reference, unspecified values in the kernels).

    int8 K/V (:func:`quantize_per_token`) come with float32 ``key_scale`` / ``value_scale`` ``[B, Hkv, Skv]``:
    the attention is that of the dequantised ``key * key_scale``, ``value * value_scale``; the output is in
    the query's dtype. int8 values may also come blocked (:func:`blocked_values`, at least ``Skv`` slots).

    ``alibi_slopes`` (float32 ``[Hq]``) adds the ALiBi bias ``slope[h] * (key slot - query slot)`` (<= 0 on
    visible keys) to the scaled scores of head ``h``.

    ``softcap`` (Gemma 2) caps the scaled (and logN-scaled) scores, ``softcap * tanh(score / softcap)``, before
    the bias and the mask, as transformers' eager attention does. ``sinks`` (``[Hq]``, GPT-OSS's ``s_aux``) adds
    one zero-valued key of logit ``sinks[h]`` to each query's softmax (:func:`attention_sinks`); the returned lse
    stays that of the real keys, without the sink.
    """
    check_softcap_and_sinks(softcap, sinks, query)
    if skip is not None:
        return _sparse_attention_rows(query, key, value, selection, scale=scale, q_offset=q_offset,
                                      kv_start=kv_start, logn_base=logn_base, skip=skip, out=out, lse=lse,
                                      key_scale=key_scale, value_scale=value_scale, alibi_slopes=alibi_slopes,
                                      softcap=softcap, sinks=sinks)
    if (key.dtype == torch.int8) != (key_scale is not None) or (value.dtype == torch.int8) != (value_scale is not None):
        raise ValueError("int8 key/value need key_scale/value_scale (and scales only go with int8 key/value)")
    value = token_values(value, key.shape[2])
    if key_scale is not None:
        key, value = dequantize_per_token(key, key_scale), dequantize_per_token(value, value_scale)
    batch, q_heads, num_queries, _ = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    block_size, query_tile = selection.block_size, selection.query_tile
    group = q_heads // kv_heads
    rows_per_head = q_heads // selection.num_heads
    kv_start = row_starts(kv_start).to(query.device)
    pad_q = padding_queries(num_queries, q_offset, kv_start)
    keys = key.float().repeat_interleave(group, dim=1)
    values = value.float().repeat_interleave(group, dim=1)
    indices = selection.indices.repeat_interleave(rows_per_head, dim=1).long()
    counts = selection.counts.repeat_interleave(rows_per_head, dim=1)
    out_given, lse_given = out, lse
    out = torch.zeros(batch, q_heads, num_queries, value.shape[-1], dtype=torch.float32, device=query.device)
    lse = torch.full((batch, q_heads, num_queries), float("-inf"), dtype=torch.float32, device=query.device)
    in_block = torch.arange(block_size, device=query.device)
    in_tile = torch.arange(query_tile, device=query.device)
    for tile in range(selection.num_query_tiles):
        width = int(counts[:, :, tile].max())
        query_ids = pad_q[:, None] + tile * query_tile + in_tile[None, :]  # [B, QT]
        query_ok = query_ids < num_queries
        if width == 0 or not bool(query_ok.any()):
            continue
        query_ids = query_ids.clamp_max(num_queries - 1)
        q_tile = torch.gather(query.float(), 2, query_ids[:, None, :, None].expand(batch, q_heads, -1, query.shape[-1]))
        used = torch.arange(width, device=query.device) < counts[:, :, tile, None]  # [B, Hq, W]
        block_first = kv_start[:, None, None] + indices[:, :, tile, :width].clamp_min(0) * block_size
        slot = (block_first[..., None] + in_block).flatten(2)  # [B, Hq, W * bs]
        slot_ok = used[..., None].expand(-1, -1, -1, block_size).flatten(2) & (slot < length)
        slot = slot.clamp_max(length - 1)
        keys_sel = torch.gather(keys, 2, slot[..., None].expand(-1, -1, -1, keys.shape[-1]))
        values_sel = torch.gather(values, 2, slot[..., None].expand(-1, -1, -1, values.shape[-1]))
        q_slot = q_offset + query_ids  # [B, QT]
        visible = slot_ok[:, :, None, :] & (slot[:, :, None, :] <= q_slot[:, None, :, None])
        scores = torch.matmul(q_tile, keys_sel.transpose(-1, -2)) * scale
        if logn_base is not None:
            scores = scores * logn_factors(q_slot - kv_start[:, None], logn_base)[:, None, :, None]
        if softcap is not None:
            scores = soft_cap(scores, softcap)
        if alibi_slopes is not None:
            distance = (slot[:, :, None, :] - q_slot[:, None, :, None]).float()  # [B, Hq, QT, W * bs]
            scores = scores + alibi_slopes.float().to(query.device)[None, :, None, None] * distance
        scores = scores.masked_fill(~visible, float("-inf"))
        tile_lse = torch.logsumexp(scores, dim=-1)
        weights = torch.exp(scores - tile_lse[..., None].clamp_min(torch.finfo(torch.float32).min))
        tile_out = torch.matmul(weights, values_sel)
        # Write back only the tile's real queries (clamped duplicates past the end are dropped).
        for b in range(batch):
            ok = query_ok[b]
            out[b, :, query_ids[b, ok]] = tile_out[b, :, ok]
            lse[b, :, query_ids[b, ok]] = tile_lse[b, :, ok]
    if sinks is not None:
        out = attention_sinks(out, lse, sinks)
    if out_given is not None:
        out_given.copy_(out)
        out = out_given
    else:
        out = out.to(query.dtype)
    if lse_given is not None:
        lse = lse_given.copy_(lse)
    return out, lse


def logn_factors(row_slot: torch.Tensor, logn_base: int) -> torch.Tensor:
    """Qwen's logN query scale ``max(1, log(n) / log(m))`` (float32) for 0-based row slots ``n - 1``."""
    if logn_base < 2:
        raise ValueError(f"logn_base (the training length) must be >= 2, got {logn_base}")
    position = (row_slot + 1).clamp_min(1).float()
    return (torch.log(position) / math.log(logn_base)).clamp_min(1.0)


def quantize_per_token(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantisation of ``[..., S, D]`` states with one float32 scale per (..., token):
    ``states ~ q * scale[..., None]``, ``scale = max|states| / 127`` over the head dim."""
    amax = states.detach().float().abs().amax(-1)
    # a true division (a tensor divisor: torch on CUDA multiplies by the reciprocal of a scalar one)
    scale = (amax / torch.full_like(amax, 127.0)).clamp_min(torch.finfo(torch.float32).tiny)
    quantized = torch.round(states.float() / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return quantized, scale


def dequantize_per_token(quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``quantized * scale[..., None]`` (the inverse of :func:`quantize_per_token`)."""
    return quantized.float() * scale.float()[..., None]


def append_kv(key_states: torch.Tensor, value_states: torch.Tensor, key_storage: torch.Tensor,
              value_storage: torch.Tensor, length: torch.Tensor, starts: torch.Tensor | None = None,
              counts: torch.Tensor | None = None, block_size: int = 0) -> None:
    """Write ``[B, H, n, D]`` key and value states at slots ``length + [0, n)`` of token-major storage
    (``[B, H, S, D]`` / ``[B, H, S, Dv]``) and advance ``length`` (a one-element integer tensor on the states'
    device: a static cache's valid-slot count) by ``n``; nothing is read back to the host. With ``counts``
    (integer ``[B]``), also write each row's number of valid key blocks, ``ceil((length - starts[b]) /
    block_size)`` of the new length (``starts``: the rows' left-padding slots)."""
    tokens = key_states.shape[2]
    positions = length.reshape(1).long() + torch.arange(tokens, device=length.device)
    key_storage.index_copy_(2, positions, key_states)
    value_storage.index_copy_(2, positions, value_states)
    length.add_(tokens)
    if counts is not None:
        counts.copy_(valid_blocks(length, starts, block_size))


def decode_linear(x: torch.Tensor, weights: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor | None, ...],
                  norm_weight: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
                  gated: bool = False, rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The linear layers of a decode step that read one input ``x`` ``[M, K]``, as transformers' eager modules
    compute them: ``x`` first through an RMSNorm with ``norm_weight`` (``[K]``; normalised in float32, rounded,
    times the weight) when given; then each of ``weights`` (``[N_i, K]``, with ``biases``) applied, the products
    side by side ``[M, sum N_i]``; or, ``gated``, ``silu(gate) * up`` of the two weights (``[M, N]``); then
    ``residual`` (``[M, N]``) added when given. ``rotary``: ``(cos, sin)`` of a rotary embedding, ``[B or 1, S,
    D]`` for the ``M = B * S`` rows, applied to the first two products (queries and keys) per head of ``D``
    columns as transformers' ``apply_rotary_pos_emb`` does (``x * cos + rotate_half(x) * sin``)."""
    if norm_weight is not None:
        normalised = x.float()
        normalised = normalised * torch.rsqrt(normalised.pow(2).mean(-1, keepdim=True) + eps)
        x = norm_weight * normalised.to(x.dtype)
    products = [torch.nn.functional.linear(x, weight, bias) for weight, bias in zip(weights, biases)]
    if rotary is not None:
        cos, sin = rotary
        head_dim = cos.shape[-1]
        cos, sin = (t.expand(x.shape[0] // t.shape[1], -1, -1).reshape(x.shape[0], 1, head_dim) for t in (cos, sin))
        for i in (0, 1):
            heads = products[i].view(x.shape[0], -1, head_dim)
            rotated = torch.cat((-heads[..., head_dim // 2:], heads[..., :head_dim // 2]), dim=-1)
            products[i] = ((heads * cos) + (rotated * sin)).view(x.shape[0], -1)
    out = torch.nn.functional.silu(products[0]) * products[1] if gated else torch.cat(products, dim=-1)
    return out if residual is None else residual + out


def valid_blocks(length: torch.Tensor | int, starts: torch.Tensor, block_size: int) -> torch.Tensor:
    """Each row's number of key blocks holding valid slots, ``ceil((length - starts[b]) / block_size)`` (``[B]``,
    int64; ``length`` an int or a one-element tensor)."""
    return torch.div((length - starts.long()).clamp_min(0) + block_size - 1, block_size, rounding_mode="floor")


def quantize_append(key_states: torch.Tensor, value_states: torch.Tensor, key_storage: torch.Tensor,
                    value_storage: torch.Tensor, key_scales: torch.Tensor, value_scales: torch.Tensor,
                    start: int | torch.Tensor, clear_to: int = 0) -> None:
    """Quantise ``[B, H, n, D]`` key and value states per token (:func:`quantize_per_token`) and write them at
    slots ``start + [0, n)`` of int8 storage (keys ``[B, H, S, D]``, values token-major ``[B, H, S, Dv]`` or
    blocked: :func:`blocked_values`) and their float32 scales ``[B, H, S]``. ``start`` is an int, or a
    one-element integer tensor on the states' device (a static cache's valid-slot count: nothing is read back to
    the host). ``clear_to`` (0, or from ``start + n`` to ``S``; with an int start) also sets the scales of slots
    ``[start + n, clear_to)`` to zero: a fresh storage's slots past the write."""
    tokens = key_states.shape[2]
    if isinstance(start, torch.Tensor):
        positions = start.reshape(1).long() + torch.arange(tokens, device=start.device)
    else:
        positions = torch.arange(start, start + tokens, device=key_states.device)
    for states, storage, scales in ((key_states, key_storage, key_scales), (value_states, value_storage, value_scales)):
        quantized, scale = quantize_per_token(states)
        scales.index_copy_(2, positions, scale)
        if storage.dim() == 5:
            block = storage.shape[-1]
            storage.transpose(-1, -2)[:, :, positions // block, positions % block] = quantized
        else:
            storage.index_copy_(2, positions, quantized)
        if clear_to:
            scales[:, :, start + tokens: clear_to] = 0


def blocked_values(value: torch.Tensor, block: int) -> torch.Tensor:
    """``[B, H, S, Dv]`` values stored block by block, each block transposed: ``[B, H, ceil(S / block), Dv,
    block]``, slot ``s`` of channel ``d`` at ``[..., s // block, d, s % block]`` (the last block's tail zero).

    The int8 SparseCache keeps its values so: the kernels' probability-times-value product reads a tile's
    slots for each channel, which this layout holds contiguously (token-major int8 values are read byte by
    byte there). Every attention op takes values in either layout.
    """
    batch, heads, length, dim = value.shape
    blocks = _ceil_div(length, block)
    padded = value.new_zeros(batch, heads, blocks * block, dim)
    padded[:, :, :length] = value
    return padded.view(batch, heads, blocks, block, dim).transpose(-1, -2).contiguous()


def token_values(value: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` slots of ``value`` token-major, ``[B, H, length, Dv]``: a view of token-major
    values, a copy of blocked ones (:func:`blocked_values`)."""
    if value.dim() == 4:
        return value[:, :, :length]
    batch, heads, blocks, dim, block = value.shape
    return value.transpose(-1, -2).reshape(batch, heads, blocks * block, dim)[:, :, :length]


def leading_values(value: torch.Tensor, length: int) -> torch.Tensor:
    """A view of the values of the first ``length`` slots in their own layout: token-major ones cut to
    ``length`` slots, blocked ones (:func:`blocked_values`) to the blocks that hold them."""
    if value.dim() == 4:
        return value.narrow(2, 0, length)
    return value.narrow(2, 0, _ceil_div(length, value.shape[-1]))


def _sparse_attention_rows(query, key, value, selection, *, kv_start, skip, out, lse, key_scale, value_scale,
                           **kwargs):
    """:func:`sparse_attention` on the rows not in ``skip`` only, written into ``out`` / ``lse``."""
    batch, q_heads, num_queries = query.shape[:3]
    if skip.shape != (batch,) or skip.dtype != torch.bool:
        raise ValueError(f"skip must be a [batch={batch}] bool tensor, got {tuple(skip.shape)} {skip.dtype}")
    if out is None:
        out = torch.zeros(batch, q_heads, num_queries, value.shape[3], dtype=query.dtype, device=query.device)
    if lse is None:
        lse = torch.full((batch, q_heads, num_queries), float("-inf"), dtype=torch.float32, device=query.device)
    rows = (~skip).nonzero().flatten().to(query.device)
    if rows.numel() == 0:
        return out, lse
    part = BlockSelection(selection.indices[rows], selection.counts[rows], selection.block_size, selection.query_tile)
    scales = {} if key_scale is None else {"key_scale": key_scale[rows], "value_scale": value_scale[rows]}
    part_out, part_lse = sparse_attention(query[rows], key[rows], value[rows], part,
                                          kv_start=row_starts(kv_start).to(query.device)[rows], **scales, **kwargs)
    out[rows] = part_out.to(out.dtype)
    lse[rows] = part_lse
    return out, lse


def merge_lse(outputs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial attention results over disjoint key sets.

    ``outputs`` is ``[N, ..., D]`` and ``lses`` ``[N, ...]`` (float32); returns the merged output in the
    outputs' dtype and the merged log-sum-exp. Parts with ``-inf`` lse contribute nothing.
    """
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - lse.clamp_min(torch.finfo(torch.float32).min)[None])
    weights = torch.nan_to_num(weights, nan=0.0)
    merged = (weights[..., None] * outputs.float()).sum(0)
    return merged.to(outputs.dtype), lse


def default_scale(head_dim: int) -> float:
    """The usual ``1 / sqrt(head_dim)`` softmax scale."""
    return 1.0 / math.sqrt(head_dim)


# -- XAttention: antidiagonal block scoring and cumulative-threshold selection -----------------------------
def causal_logits(query: torch.Tensor, key: torch.Tensor, scale: float,
                  q_offset: int | torch.Tensor = 0) -> torch.Tensor:
    """Scaled attention logits ``[B, Hq, Sq, Sk]`` (float32) of unpadded rows, ``-inf`` where the key slot is past
    the query's position (query ``i`` sits at slot ``q_offset + i``, or at ``q_offset[i]`` when ``q_offset`` is a
    ``[Sq]`` tensor of slots); GQA by query head ``h -> h // group``."""
    group = query.shape[1] // key.shape[1]
    keys = key.float().repeat_interleave(group, dim=1)
    scores = torch.matmul(query.float() * scale, keys.transpose(-1, -2))
    slots = torch.arange(key.shape[2], device=query.device)
    if not isinstance(q_offset, torch.Tensor):
        q_offset = q_offset + torch.arange(query.shape[2], device=query.device)
    return scores.masked_fill_(slots[None, :] > q_offset.to(query.device)[:, None], float("-inf"))


def pooled_block_logits(query: torch.Tensor, key: torch.Tensor, block_size: int, scale: float,
                        q_offset: int | torch.Tensor = 0, pool: str = "max") -> torch.Tensor:
    """Each query's logits pooled over each key block: ``[B, Hq, Sq, ceil(Sk / block_size)]`` float32.
    ``pool="max"``: the block's largest logit; ``pool="sum"``: ``log(sum(exp(logits)))`` over the block, so that a
    softmax over blocks gives each block's attention mass. ``-inf`` for blocks with no key at or before the
    query's slot (``q_offset``: as :func:`causal_logits` takes it). :func:`causal_logits` pooled; the targets of PLAS
    gate distillation (:mod:`hf_sparse.tools.gate_objective`)."""
    if pool not in ("max", "sum"):
        raise ValueError(f"pool must be 'max' or 'sum', got {pool!r}")
    scores = causal_logits(query, key, scale, q_offset)
    num_blocks = _ceil_div(key.shape[2], block_size)
    missing = num_blocks * block_size - key.shape[2]
    if missing:
        scores = torch.nn.functional.pad(scores, (0, missing), value=float("-inf"))
    blocks = scores.unflatten(-1, (num_blocks, block_size))
    return blocks.amax(-1) if pool == "max" else torch.logsumexp(blocks, -1)


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
    """XAttention's estimate of the attention mass of each (query tile, key block): float32 ``[B, Hq, n, nb]``.

    Tokens are grouped ``stride`` at a time: key group ``r`` of row ``b`` holds slots
    ``kv_start[b] + [r * S, (r + 1) * S)``; query group ``g`` of tile ``t`` (query tiles of ``block_size``
    queries, counted per row as in the module docstring) holds its queries ``t * block_size + [g * S, (g + 1) * S)``.
    The score of ``(g, r)`` pools the antidiagonal's products ``q[g*S + S-1-m] . k[r*S + m] * scale`` over
    ``m``: their mean with ``pool="mean"`` (one GEMM on the strided reshape of Q and K), their maximum with
    ``pool="max"`` (``S`` GEMMs of head_dim depth); missing tokens count as zero. A query group sees the key groups
    whose first slot is at or before the slot of its last query. Scores are softmaxed over the visible key
    groups and the probabilities summed over the query groups of a tile and the key groups of a block, so a
    tile's masses add up to its number of real query groups.

    Returns tiles ``first_tile .. first_tile + n - 1`` (``n = num_tiles``, default: the rest) against all row
    blocks. ``key_chunk`` (a multiple of ``block_size``) bounds the keys scored at once; when the keys are longer
    the softmax takes two passes (log-sum-exp over the chunks, then masses). An int8 ``key`` comes with its
    float32 ``key_scale`` ``[B, Hkv, Skv]`` (:func:`quantize_per_token`): the scores are those of the
    dequantised keys. ``softcap`` caps each scaled score (:func:`soft_cap`) before the softmax, as the attention
    caps its own: the masses then estimate the capped attention's.
    """
    check_softcap_and_sinks(softcap, None, query)
    if (key.dtype == torch.int8) != (key_scale is not None):
        raise ValueError("an int8 key needs key_scale (and key_scale only goes with an int8 key)")
    batch, q_heads, num_queries, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    device = query.device
    if block_size % stride:
        raise ValueError(f"stride {stride} must divide block_size {block_size}")
    if pool not in ("mean", "max"):
        raise ValueError(f"pool must be 'mean' or 'max', got {pool!r}")
    groups_per_block = block_size // stride
    num_blocks = num_row_blocks(length, kv_start, block_size)
    if num_tiles is None:
        num_tiles = num_query_tiles(num_queries, q_offset, kv_start, block_size) - first_tile
    kv_start = row_starts(kv_start).to(device)
    key_chunk = num_blocks * block_size if key_chunk is None else key_chunk
    blocks_per_chunk = max(1, key_chunk // block_size)
    num_q_groups = num_tiles * groups_per_block

    # Queries of the tiles, strided and reversed within each group so that element m meets key element m.
    pad_q = padding_queries(num_queries, q_offset, kv_start)
    query_ids = pad_q[:, None] + first_tile * block_size + torch.arange(num_tiles * block_size, device=device)[None]
    query_ok = query_ids < num_queries
    gathered = torch.gather(query, 2, query_ids.clamp_max(num_queries - 1)[:, None, :, None].expand(-1, q_heads, -1, dim))
    gathered = gathered.float() * query_ok[:, None, :, None]
    strided_q = gathered.view(batch, q_heads, num_q_groups, stride, dim).flip(3)
    strided_q = strided_q.reshape(batch, kv_heads, group * num_q_groups, stride * dim)
    group_real = query_ok[:, ::stride]  # [B, Gq]: the group's first query exists
    group_last = q_offset + query_ids[:, stride - 1 :: stride] - kv_start[:, None]  # row-relative slot

    def chunk_logits(first_block: int, last_block: int) -> torch.Tensor:
        offsets = torch.arange(first_block * block_size, last_block * block_size, device=device)
        slots = kv_start[:, None] + offsets[None, :]
        slot_ok = slots < length
        gather_slots = slots.clamp_max(length - 1)[:, None, :]
        keys = torch.gather(key, 2, gather_slots[..., None].expand(-1, kv_heads, -1, dim)).float()
        if key_scale is not None:  # dequantised per chunk
            keys = keys * torch.gather(key_scale.float(), 2, gather_slots.expand(-1, kv_heads, -1))[..., None]
        keys = (keys * slot_ok[:, None, :, None]).view(batch, kv_heads, -1, stride * dim)
        if pool == "mean":
            logits = torch.matmul(strided_q, keys.transpose(-1, -2)) * (scale / stride)
        else:  # element m of every query group against element m of every key group, the largest kept
            q_parts = strided_q.unflatten(-1, (stride, dim))
            k_parts = keys.unflatten(-1, (stride, dim))
            logits = torch.matmul(q_parts[..., 0, :], k_parts[..., 0, :].transpose(-1, -2))
            for m in range(1, stride):
                logits = torch.maximum(logits, torch.matmul(q_parts[..., m, :], k_parts[..., m, :].transpose(-1, -2)))
            logits = logits * scale
        if softcap is not None:
            logits = soft_cap(logits, softcap)
        logits = logits.view(batch, q_heads, num_q_groups, -1)
        key_first = offsets[::stride]  # row-relative first slot of each key group
        visible = slot_ok[:, None, ::stride] & (key_first[None, None, :] <= group_last[:, :, None])
        return logits.masked_fill(~visible[:, None], float("-inf"))

    chunks = [(j, min(num_blocks, j + blocks_per_chunk)) for j in range(0, num_blocks, blocks_per_chunk)]
    first_logits = chunk_logits(*chunks[0])
    lse = torch.logsumexp(first_logits, dim=-1)
    for first_block, last_block in chunks[1:]:
        lse = torch.logaddexp(lse, torch.logsumexp(chunk_logits(first_block, last_block), dim=-1))
    lse = lse.clamp_min(torch.finfo(torch.float32).min)[..., None]  # rows that see nothing stay at zero mass
    real = group_real[:, None, :, None]
    masses = []
    for index, (first_block, last_block) in enumerate(chunks):
        logits = first_logits if index == 0 else chunk_logits(first_block, last_block)
        probs = torch.exp(logits - lse) * real
        probs = probs.view(batch, q_heads, num_tiles, groups_per_block, last_block - first_block, groups_per_block)
        masses.append(probs.sum(5).sum(3))
    return torch.cat(masses, dim=-1)


# Masses are compared as integers in units of 2**-MASS_BITS of the row's largest available mass (see below).
MASS_BITS = 32


def cumulative_threshold_select(
    mass: torch.Tensor, available: torch.Tensor, forced: torch.Tensor, threshold: float
) -> torch.Tensor:
    """Per row, the smallest set of blocks whose mass reaches ``threshold`` of the row's available mass.

    ``mass`` is ``[..., nb]`` (non-negative, taken as float32); ``available`` and ``forced`` are boolean and
    broadcast to it. The forced blocks (those available) are kept first and their mass counted; the other
    available blocks follow in descending mass, each kept while the mass kept before it is below
    ``threshold * total`` (ties: lower block id first). ``threshold >= 1`` keeps every available block.
    Returns a boolean mask.

    Masses are first rounded down to fixed point, ``floor(mass * 2**(MASS_BITS - e))`` with ``2**e`` the
    smallest power of two above the row's largest available mass (``e >= -126``): integers below
    ``2**MASS_BITS`` whose sums are exact in any order, so the Triton kernel, which sums in another order,
    selects exactly these blocks. Masses that round down to the same unit (``2**-32`` to ``2**-31`` of the
    row maximum) tie, so the lower block id goes first; masses below one unit count as zero.
    """
    available = available.expand(mass.shape)
    if threshold >= 1.0:
        return available.clone()
    forced = forced.expand(mass.shape) & available
    mass = torch.where(available, mass.float().clamp_min(0.0), 0.0)
    exponent = torch.frexp(mass.amax(-1, keepdim=True)).exponent.clamp_min(-126)  # row max < 2**exponent
    # 2**(MASS_BITS - exponent) built from its bits: exact on every backend (pow need not be).
    scale = ((MASS_BITS - exponent.long() + 1023) << 52).view(torch.float64)
    units = (mass.double() * scale).long()  # exact product, truncated: 0 <= units < 2**MASS_BITS
    required = threshold * units.sum(-1, keepdim=True).double()  # sums < 2**53: exact as float64
    kept = torch.where(forced, units, 0).sum(-1, keepdim=True)
    candidates = torch.where(available & ~forced, units, -1)  # non-candidates sort last
    ordered, order = torch.sort(candidates, dim=-1, descending=True, stable=True)
    cumulative = ordered.clamp_min(0).cumsum(-1)
    before = kept + cumulative - ordered.clamp_min(0)  # mass kept before each candidate
    take = (before.double() < required) & (ordered >= 0)
    chosen = torch.zeros_like(take).scatter_(-1, order, take)
    return chosen | forced
