"""PLAS block selection: threshold top-k over gate-compressed key blocks, united per query tile or GQA group."""
from __future__ import annotations

import functools

import torch

from .. import kernels, key_scorer
from ..config import PLASConfig
from ..selection import BlockSelection, RowLayout


@functools.lru_cache(maxsize=256)
def top_k_density_floor(num_queries: int, key_length: int, query_tile: int, block_size: int, top_k: int) -> float:
    """The least density a selection of at least ``top_k`` blocks per query can have (no padding): each tile of
    ``query_tile`` queries keeps at least ``min(causal blocks, top_k)`` blocks, the causal blocks counted up to its
    last query (as :func:`hf_sparse.density.block_counts` counts them)."""
    q_offset = key_length - num_queries
    attended = causal = 0
    for first in range(0, num_queries, query_tile):
        blocks = (q_offset + min(first + query_tile, num_queries) - 1) // block_size + 1
        attended += min(blocks, top_k)
        causal += blocks
    return attended / max(causal, 1)


class PLASMethod:
    """Selects key blocks for prefill (union over ``query_union`` queries, per query head) and decode
    (union over the query heads of each GQA group).

    The method protocol (shared by every file in ``methods/``): ``config`` with ``block_size``,
    ``dense_threshold(phase)`` and ``is_dense_layer(idx, n)``; ``select_prefill`` / ``select_decode`` taking
    the query, the block summaries and the keys (int8 with their per-token ``key_scale`` when the cache is
    int8) and, for PLAS and XAttention (the methods of ``attention.sparse_attention_forward``), the model's
    attention logit ``softcap`` (None without), and in prefill ``probe`` (True when the queries are the density
    probe's sample of a longer prefill rather than its end) and ``call_length`` (that prefill's key length),
    returning a :class:`BlockSelection`; methods whose config has ``dense_above_density`` also give
    ``selection_share(num_queries, head_dim)`` and ``density_floor(num_queries, key_length)`` for the density
    decision.

    PLAS ignores ``softcap``: it ranks each query's blocks by ``q . Kc`` and keeps the top ``m`` for an ``m`` in
    the configured range, and a softcap, being increasing, keeps that ranking, so every selection it could make
    is one PLAS could make without it (the cap would only move the cut inside the range, through the
    bisection's relative-probability points). The fused selection kernel stays as it is.
    """

    name = "plas"
    #: Prefill selection time over dense causal attention time, times queries x head dim: the selection grows
    #: about with the queries, dense attention with queries^2 x head dim (H100, bf16, 32K-128K, head dims 64 and
    #: 128: 6.2e5-1.1e6 against cuDNN; `benchmarks/bench_attention.py --crossover`, docs/benchmarks.md).
    SELECTION_COST = 9.0e5

    def __init__(self, config: PLASConfig) -> None:
        self.config = config

    def selection_share(self, num_queries: int, head_dim: int) -> float:
        """Estimated prefill selection time for ``num_queries`` queries, as a share of dense attention's."""
        return self.SELECTION_COST / max(1, num_queries * head_dim)

    def density_floor(self, num_queries: int, key_length: int) -> float:
        """The least prefill density any selection can have here: every query keeps at least the prefill range's
        left end of blocks (``PLASConfig.top_k``), so a tile keeps at least that many of its causal blocks."""
        config = self.config
        return top_k_density_floor(num_queries, key_length, config.query_union, config.block_size,
                                   config.top_k("prefill", key_length)[0])

    def select_prefill(
        self, query: torch.Tensor, summaries: torch.Tensor, key: torch.Tensor, *, scale: float, q_offset: int,
        kv_start: RowLayout, key_scale: torch.Tensor | None = None, softcap: float | None = None,
        probe: bool = False, call_length: int | None = None, key_directions: torch.Tensor | None = None,
    ) -> BlockSelection:
        """``call_length``: the key length of the prefill call these queries belong to, which sets the top-k range
        (``PLASConfig.top_k``); None = this selection's own (``q_offset`` + queries). The density probe selects
        for runs of a call's queries and passes the call's, so that it estimates the call's selection.
        ``key_directions`` (the layer's, :mod:`hf_sparse.key_scorer`): blocks ranked by their largest logit in
        those directions instead of by the summaries (float keys; an int8 cache's keep the summaries)."""
        length = q_offset + query.shape[2] if call_length is None else call_length
        if key_directions is not None and key.is_floating_point():
            return key_scorer.select_prefill(
                query, key, key_directions, scale=scale, q_offset=q_offset, kv_start=kv_start,
                block_size=self.config.block_size, top_k=self.config.top_k("prefill", length),
                query_tile=self.config.query_union, sink_blocks=self.config.sink_blocks,
                search_steps=self.config.search_steps, query_stride=self.config.query_stride)
        return kernels.select_blocks(
            query, summaries, scale=scale, q_offset=q_offset, kv_start=kv_start,
            block_size=self.config.block_size, top_k=self.config.top_k("prefill", length),
            query_tile=self.config.query_union, head_union=False,
            sink_blocks=self.config.sink_blocks, search_steps=self.config.search_steps,
            query_stride=self.config.query_stride,
        )

    def select_decode(
        self, query: torch.Tensor, summaries: torch.Tensor, key: torch.Tensor, *, scale: float, q_offset: int,
        kv_start: RowLayout, key_scale: torch.Tensor | None = None, length: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> BlockSelection:
        """``length``: the key length as a device tensor (static cache storage passed as ``summaries``)."""
        return kernels.select_blocks(
            query, summaries, scale=scale, q_offset=q_offset, kv_start=kv_start,
            block_size=self.config.block_size, top_k=self.config.decode_top_k,
            query_tile=query.shape[2], head_union=True,
            sink_blocks=self.config.sink_blocks, search_steps=self.config.search_steps, length=length,
        )
