"""PLAS's key scorer: a prefill ranks each query's key blocks by the block's largest logit in a few key directions.

Mean pooling scores a block by ``q . mean(keys)``, which averages away the block's best key; the true attention mass
is what a selection should keep (docs/gates.md). Each block's largest logit comes close to that mass, and in the top
``R`` principal directions of a layer's post-RoPE keys (per KV head, centred: the mean key adds the same to every
block of a query) it keeps most of it. On the long-context default model, 16 directions fitted on training code
give 0.44-0.58x mean pooling's next-token KL at a matched density at 32K and 64K over the last 256 positions of a
window; inside PLAS's whole prefill, under the quality budget, the scan costs more than the blocks it saves and at
128K it needs more density than mean pooling (docs/gates.md, "The key scorer"), so no directions are attached by
default.

The directions ``{layer: [kv_heads, R, head_dim]}`` are fitted by :mod:`hf_sparse.tools.key_scorer_fit` and attached
to a model's attention modules by :func:`hf_sparse.gates.set_key_directions` (outside its state dict, as gates are).
A PLAS prefill in a layer with directions selects through :func:`select_prefill`; decode keeps the summaries.

* :func:`block_scores`: ``[B, Hq, Sq, num_blocks]`` float32, each block's largest logit of the projected query
  and keys (``kernels.pooled_block_logits``), blocks counted from each row's first real key.
* :func:`select_prefill`: those scores in chunks of whole query tiles (each chunk's scores at most
  :data:`CHUNK_BYTES`), each chunk selected by ``kernels.select_blocks_from_logits`` (PLAS's threshold top-k,
  forced blocks, tile union).
"""
from __future__ import annotations

import torch

from . import kernels
from .log import warn_once
from .selection import BlockSelection, RowLayout, row_starts

#: Largest float32 score tensor of one chunk of queries (all heads, every block).
CHUNK_BYTES = 256 * 2 ** 20


def _projected(query: torch.Tensor, key: torch.Tensor, directions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P q, P k)``: queries ``[B, Hq, Sq, R]`` and keys ``[B, Hkv, Sk, R]`` in their KV head's directions ``P``."""
    kv_heads, group = key.shape[1], query.shape[1] // key.shape[1]
    if directions.shape[0] != kv_heads or directions.shape[2] != query.shape[-1]:
        raise ValueError(f"key directions {tuple(directions.shape)} do not match [kv_heads={kv_heads}, R, "
                         f"head_dim={query.shape[-1]}]")
    basis = directions.to(device=query.device, dtype=query.dtype)
    return (torch.einsum("bhsd,hrd->bhsr", query, basis.repeat_interleave(group, 0)),
            torch.einsum("bhsd,hrd->bhsr", key, basis))


def block_scores(query: torch.Tensor, key: torch.Tensor, directions: torch.Tensor, block_size: int, scale: float,
                 q_offset: int, kv_start: torch.Tensor | RowLayout) -> torch.Tensor:
    """``[B, Hq, Sq, num_blocks]`` float32: each block's largest ``scale * (P q) . (P k)`` over its keys at or before
    the query's slot (``P``: the query's KV head's directions), blocks counted from each row's first real key
    (``kv_start``; a padded row's blocks past its keys are ``-inf``)."""
    return _scores(*_projected(query, key, directions), block_size, scale, q_offset, kv_start)


def _scores(projected_query: torch.Tensor, projected_key: torch.Tensor, block_size: int, scale: float,
            q_offset: int, kv_start: torch.Tensor | RowLayout) -> torch.Tensor:
    starts = row_starts(kv_start)
    key_length = projected_key.shape[2]
    if not bool((starts != 0).any()):
        return kernels.pooled_block_logits(projected_query, projected_key, block_size, scale, q_offset, "max")
    num_blocks = kernels.reference.num_row_blocks(key_length, kv_start, block_size)
    out = torch.full((*projected_query.shape[:3], num_blocks), float("-inf"), device=projected_query.device)
    for row, start in enumerate(starts.tolist()):  # a padded row: its blocks start at its first real key
        first = max(0, start - q_offset)  # its queries before that are padding (no score)
        if first >= projected_query.shape[2] or start >= key_length:
            continue
        scores = kernels.pooled_block_logits(projected_query[row:row + 1, :, first:],
                                             projected_key[row:row + 1, :, start:], block_size, scale,
                                             q_offset + first - start, "max")
        out[row, :, first:, :scores.shape[-1]] = scores[0]
    return out


def select_prefill(query: torch.Tensor, key: torch.Tensor, directions: torch.Tensor, *, scale: float, q_offset: int,
                   kv_start: RowLayout, block_size: int, top_k: tuple[int, int], query_tile: int, sink_blocks: int,
                   search_steps: int, query_stride: int) -> BlockSelection:
    """PLAS's prefill selection (per query head, tiles of ``query_tile`` queries) with blocks ranked by
    :func:`block_scores`: chunks of whole tiles, each chunk's scores at most :data:`CHUNK_BYTES`; with
    ``query_stride`` > 1 only the searching queries are scored (rows without padding). A left-padded batch, whose
    tiles start at each row's first real query, is one chunk with every query scored: ``[B, Hq, Sq, blocks]``
    float32 scores at once (about 4.5 GiB per row at 128K tokens, 9 query heads, block 128; a warning says so past
    :data:`CHUNK_BYTES`). On the PyTorch path (the CPU) the scores of a chunk come from its whole logit matrix,
    ``block_size`` times larger, so its chunks are ``block_size`` times smaller."""
    batch, q_heads, num_queries, _ = query.shape
    key_length = key.shape[2]
    num_blocks = kernels.reference.num_row_blocks(key_length, kv_start, block_size)
    padded = bool((row_starts(kv_start) != 0).any())
    stride = 1 if padded else min(query_stride, query_tile)
    per_query = batch * q_heads * max(num_blocks, 1) * 4 * -(-query_tile // stride) / query_tile
    if kernels.backend_for(query) != "triton":  # the reference pools a [.., Sq, Sk] logit matrix
        per_query *= block_size
    if padded and per_query * num_queries > CHUNK_BYTES:

        warn_once("key scorer padded chunk", "hf_sparse's key scorer scores a left-padded batch in one chunk: %.1f GiB "
                  "of block scores at once; run long prompts one row at a time", per_query * num_queries / 2 ** 30)
    chunk = num_queries if padded else max(query_tile, int(CHUNK_BYTES // per_query) // query_tile * query_tile)
    arguments = dict(kv_heads=key.shape[1], kv_start=kv_start, block_size=block_size, top_k=top_k,
                     query_tile=query_tile, head_union=False, sink_blocks=sink_blocks, search_steps=search_steps,
                     key_length=key_length, query_stride=query_stride)
    projected_query, projected_key = _projected(query, key, directions)
    parts = []
    for first in range(0, num_queries, chunk):
        last = min(num_queries, first + chunk)
        if stride > 1:
            rows = kernels.reference.searching_queries(last - first, query_tile, stride).to(query.device) + first
            scores = kernels.pooled_block_logits(projected_query[:, :, rows], projected_key, block_size, scale,
                                                 rows + q_offset, "max")
        else:
            scores = _scores(projected_query[:, :, first:last], projected_key, block_size, scale, q_offset + first,
                             kv_start)
        parts.append(kernels.select_blocks_from_logits(scores, q_offset=q_offset + first, num_queries=last - first,
                                                       **arguments))
    if len(parts) == 1:
        return parts[0]
    return BlockSelection(indices=torch.cat([part.indices for part in parts], 2),
                          counts=torch.cat([part.counts for part in parts], 2), block_size=block_size,
                          query_tile=query_tile)
