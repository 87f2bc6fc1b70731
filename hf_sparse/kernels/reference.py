"""Pure-PyTorch reference of every op: the readable spec, the CPU path and the tests' ground truth.

Conventions shared with the Triton ops:
  * tensors are BNSD: query ``[B, Hq, Sq, D]``, key ``[B, Hkv, Skv, D]``, value ``[B, Hkv, Skv, Dv]``
    (any strides); ``Hq`` is a multiple of ``Hkv`` (GQA group ``G = Hq // Hkv``);
  * key slot ``s`` is valid for row ``b`` when ``kv_start[b] <= s < Skv`` (left padding occupies the
    first ``kv_start[b]`` slots); query ``i`` sits at slot ``q_offset + i`` and sees valid slots ``<=`` it;
  * key block ``j`` covers slots ``[j * block_size, (j + 1) * block_size)``;
  * scores, softmax and accumulation are float32; a query that sees no valid key outputs zeros and
    log-sum-exp ``-inf``.
"""
from __future__ import annotations

import math

import torch

from ..selection import BlockSelection

# Queries processed together in the reference loops: bounds peak memory at long lengths.
_QUERY_CHUNK = 1024


def _num_blocks(length: int, block_size: int) -> int:
    return (length + block_size - 1) // block_size


def block_summaries(
    keys: torch.Tensor,
    gate_weight: torch.Tensor | None,
    kv_start: torch.Tensor,
    block_size: int,
    first_block: int = 0,
    num_blocks: int | None = None,
) -> torch.Tensor:
    """Compressed key per block: ``sum_i valid_i * K_i * W[h, i, :]`` over the block's slots.

    Without a gate (``gate_weight=None``) the summary is the mean of the block's valid keys. Slots past
    ``Skv`` (a partial last block) and padding slots are skipped. Returns float32 ``[B, Hkv, n, D]``
    for blocks ``first_block .. first_block + n - 1``.
    """
    batch, heads, length, dim = keys.shape
    if num_blocks is None:
        num_blocks = _num_blocks(length, block_size) - first_block
    start = first_block * block_size
    stop = min(length, (first_block + num_blocks) * block_size)
    chunk = keys[:, :, start:stop].float()
    pad = num_blocks * block_size - chunk.shape[2]
    if pad:
        chunk = torch.nn.functional.pad(chunk, (0, 0, 0, pad))
    chunk = chunk.view(batch, heads, num_blocks, block_size, dim)
    slots = start + torch.arange(num_blocks * block_size, device=keys.device)
    valid = (slots[None, :] >= kv_start[:, None].to(keys.device)) & (slots[None, :] < length)
    valid = valid.view(batch, 1, num_blocks, block_size, 1).float()
    if gate_weight is None:
        total = (chunk * valid).sum(3)
        return total / valid.sum(3).clamp_min(1.0)
    weight = gate_weight.float().view(1, heads, 1, block_size, dim)
    return (chunk * valid * weight).sum(3)


def block_availability(
    num_queries: int, num_blocks: int, q_offset: int, kv_start: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Boolean ``[B, Sq, num_blocks]``: block holds a valid slot at or before the query's slot."""
    device = kv_start.device
    q_slot = q_offset + torch.arange(num_queries, device=device)
    block_first = torch.arange(num_blocks, device=device) * block_size
    causal = block_first[None, :] <= q_slot[:, None]
    has_valid = (block_first + block_size)[None, :] > kv_start[:, None]
    return causal[None] & has_valid[:, None, :]


def block_scores(
    query: torch.Tensor,
    summaries: torch.Tensor,
    scale: float,
    available: torch.Tensor,
) -> torch.Tensor:
    """``softmax_j(q . Kc_j * scale)`` over the available blocks: float32 ``[B, Hq, Sq, nb]`` (0 elsewhere)."""
    group = query.shape[1] // summaries.shape[1]
    summaries = summaries.repeat_interleave(group, dim=1)
    logits = torch.matmul(query.float(), summaries.transpose(-1, -2)) * scale
    logits = logits.masked_fill(~available[:, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.nan_to_num(probs, nan=0.0)


def threshold_topk(
    probs: torch.Tensor, available: torch.Tensor, top_k: tuple[int, int], search_steps: int
) -> torch.Tensor:
    """Approximate top-k per row by binary search on a probability threshold.

    Rows with at most ``top_k[1]`` available blocks select all of them. Otherwise the threshold ``t``
    starts in ``[0, max]`` and halves ``search_steps`` times, stopping per row once
    ``count(p >= t)`` lands in ``[top_k[0], top_k[1]]``; a row that never lands keeps the last lower bound
    (more blocks rather than fewer). Returns the boolean selection, same shape as ``probs``.
    """
    left, right = top_k
    n_available = available.sum(-1, keepdim=True)
    low = torch.zeros_like(probs[..., :1])
    high = probs.amax(-1, keepdim=True)
    threshold = torch.zeros_like(low)
    found = torch.zeros_like(low, dtype=torch.bool)
    for _ in range(search_steps):
        mid = (low + high) * 0.5
        count = (probs >= mid).sum(-1, keepdim=True)
        landed = (count >= left) & (count <= right) & ~found
        threshold = torch.where(landed, mid, threshold)
        found |= landed
        too_many = count > right
        low = torch.where(too_many & ~found, mid, low)
        high = torch.where(~too_many & ~found, mid, high)
    threshold = torch.where(found, threshold, low)
    selected = (probs >= threshold) & available
    return torch.where(n_available <= right, available, selected)


def select_blocks(
    query: torch.Tensor,
    summaries: torch.Tensor,
    *,
    scale: float,
    q_offset: int,
    kv_start: torch.Tensor,
    block_size: int,
    top_k: tuple[int, int],
    query_tile: int,
    head_union: bool,
    sink_blocks: int = 1,
    search_steps: int = 16,
) -> BlockSelection:
    """Per query and head: threshold top-k over block scores, plus forced blocks, united per row.

    Forced blocks: the query's own (diagonal) block and the first ``sink_blocks`` blocks holding valid
    slots. Rows unite ``query_tile`` consecutive queries, and with ``head_union`` also the query heads of
    each GQA group (one row per KV head).
    """
    batch, q_heads, num_queries, _ = query.shape
    kv_heads, num_blocks = summaries.shape[1], summaries.shape[2]
    num_tiles = _num_blocks(num_queries, query_tile)
    kv_start = kv_start.to(query.device)
    first_valid_block = torch.div(kv_start, block_size, rounding_mode="floor")
    block_ids = torch.arange(num_blocks, device=query.device)
    sink = (block_ids[None, :] >= first_valid_block[:, None]) & (
        block_ids[None, :] < first_valid_block[:, None] + sink_blocks
    )
    tile_masks = []
    tiles_per_chunk = max(1, _QUERY_CHUNK // query_tile)
    for tile0 in range(0, num_tiles, tiles_per_chunk):
        q0 = tile0 * query_tile
        q1 = min(num_queries, q0 + tiles_per_chunk * query_tile)
        available = block_availability(q1 - q0, num_blocks, q_offset + q0, kv_start, block_size)
        probs = block_scores(query[:, :, q0:q1], summaries, scale, available)
        chosen = threshold_topk(probs, available[:, None], top_k, search_steps)
        q_slot = q_offset + torch.arange(q0, q1, device=query.device)
        diagonal = block_ids[None, :] == torch.div(q_slot, block_size, rounding_mode="floor")[:, None]
        forced = (diagonal[None] | sink[:, None]) & available
        chosen |= forced[:, None]
        pad = (-(q1 - q0)) % query_tile
        if pad:
            chosen = torch.nn.functional.pad(chosen, (0, 0, 0, pad), value=False)
        tile_masks.append(chosen.view(batch, q_heads, -1, query_tile, num_blocks).any(3))
    mask = torch.cat(tile_masks, dim=2)
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
    kv_start: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query over the valid, causal slots of its row's selected blocks.

    Returns the output ``[B, Hq, Sq, Dv]`` in the query dtype and the float32 log-sum-exp ``[B, Hq, Sq]``
    of the scaled scores (``-inf`` where a query sees no slot).
    """
    batch, q_heads, num_queries, _ = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    block_size, query_tile = selection.block_size, selection.query_tile
    num_blocks = _num_blocks(length, block_size)
    group = q_heads // kv_heads
    rows_per_head = q_heads // selection.num_heads
    pad = num_blocks * block_size - length
    key_blocks = torch.nn.functional.pad(key.float(), (0, 0, 0, pad)).view(batch, kv_heads, num_blocks, block_size, -1)
    value_blocks = torch.nn.functional.pad(value.float(), (0, 0, 0, pad)).view(batch, kv_heads, num_blocks, block_size, -1)
    key_blocks = key_blocks.repeat_interleave(group, dim=1)
    value_blocks = value_blocks.repeat_interleave(group, dim=1)
    indices = selection.indices.repeat_interleave(rows_per_head, dim=1).long()
    counts = selection.counts.repeat_interleave(rows_per_head, dim=1)
    kv_start = kv_start.to(query.device)
    out = torch.zeros(batch, q_heads, num_queries, value.shape[-1], dtype=torch.float32, device=query.device)
    lse = torch.full((batch, q_heads, num_queries), float("-inf"), dtype=torch.float32, device=query.device)
    in_block = torch.arange(block_size, device=query.device)
    for tile in range(selection.num_query_tiles):
        q0, q1 = tile * query_tile, min(num_queries, (tile + 1) * query_tile)
        if q0 >= num_queries:
            break
        width = int(counts[:, :, tile].max())
        if width == 0:
            continue
        idx = indices[:, :, tile, :width]
        used = torch.arange(width, device=query.device) < counts[:, :, tile, None]
        safe = idx.clamp_min(0)
        gather = safe[..., None, None].expand(-1, -1, -1, block_size, key_blocks.shape[-1])
        keys_sel = torch.gather(key_blocks, 2, gather).flatten(2, 3)
        gather_v = safe[..., None, None].expand(-1, -1, -1, block_size, value_blocks.shape[-1])
        values_sel = torch.gather(value_blocks, 2, gather_v).flatten(2, 3)
        slot = (safe[..., None] * block_size + in_block).flatten(2)  # [B, Hq, width*bs]
        slot_ok = used[..., None].expand(-1, -1, -1, block_size).flatten(2)
        slot_ok &= (slot >= kv_start[:, None, None]) & (slot < length)
        q_slot = q_offset + torch.arange(q0, q1, device=query.device)
        visible = slot_ok[:, :, None, :] & (slot[:, :, None, :] <= q_slot[None, None, :, None])
        scores = torch.matmul(query[:, :, q0:q1].float(), keys_sel.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        tile_lse = torch.logsumexp(scores, dim=-1)
        weights = torch.exp(scores - tile_lse[..., None].clamp_min(torch.finfo(torch.float32).min))
        weights = torch.nan_to_num(weights, nan=0.0)
        out[:, :, q0:q1] = torch.matmul(weights, values_sel)
        lse[:, :, q0:q1] = tile_lse
    return out.to(query.dtype), lse


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
