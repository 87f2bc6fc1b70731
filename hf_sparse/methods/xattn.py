"""XAttention block selection: antidiagonal block scores, cumulative-mass threshold, GQA reduction."""
from __future__ import annotations

import torch

from ..config import XAttnConfig
from .. import kernels
from ..kernels import reference
from ..selection import BlockSelection, RowLayout, row_starts


class XAttnMethod:
    """Selects key blocks by XAttention's rule: per query tile (prefill) or query (decode), the smallest set of
    key blocks whose estimated attention mass reaches ``threshold``, plus the sink and diagonal blocks.

    Prefill estimates the mass with antidiagonal strided scores (:func:`reference.antidiagonal_block_scores`)
    per query head, in chunks of ``prefill_chunk`` queries, then reduces the heads of each GQA group by
    ``gqa_reduce``; int8 keys (an int8 SparseCache) are scored dequantised by ``key_scale``. Decode scores the
    block summaries kept in the SparseCache (as PLAS does) and unites the heads of each GQA group. Both return
    one selection row per KV head.

    With an attention logit ``softcap`` (Gemma 2) both score softmaxes cap their scaled logits first, as the
    attention does: the cap keeps each query's ranking of blocks but flattens the masses, and the threshold is
    on cumulative mass, so without it the estimate would credit the top blocks with more of the capped
    attention than they get, and keep too few.
    """

    name = "xattn"
    #: Prefill scoring + selection time over dense causal attention time (cuDNN), ``A / d + B / (N d^2)`` for head
    #: dim ``d`` and ``N`` queries: the strided scores are quadratic in the queries like attention itself (the
    #: ``A / d`` part), the per-tile selection and the call's launches about linear (the ``B`` part). Fitted on
    #: the H100 (bf16) to the kernels' shares at 128K (`benchmarks/bench_attention.py --crossover`: head dim 64
    #: 0.40, head dim 128 0.17) and to SmolLM2's real-model prefill at 32K (head dim 64), where XAttention at
    #: density 0.17 took 1.7x sdpa's time: its launches and reads weigh more than the kernels alone show. Both at
    #: ``stride`` 8; the scores' part scales with ``8 / stride`` (a stride of 16 reads half the products).
    SHARE_SCORES = 17.8
    SHARE_SELECTION = 1.2e8

    def __init__(self, config: XAttnConfig) -> None:
        self.config = config

    def selection_share(self, num_queries: int, head_dim: int) -> float:
        """Estimated prefill selection time for ``num_queries`` queries, as a share of dense attention's."""
        scores = self.SHARE_SCORES * 8 / (self.config.stride * head_dim)
        return scores + self.SHARE_SELECTION / (max(1, num_queries) * head_dim ** 2)

    def density_floor(self, num_queries: int, key_length: int) -> float:
        """The least prefill density XAttention's threshold may leave: a mass threshold has no minimum block
        count beyond the forced sink and diagonal blocks, so 0 here."""
        return 0.0

    def select_prefill(
        self, query: torch.Tensor, summaries: torch.Tensor, key: torch.Tensor, *, scale: float, q_offset: int,
        kv_start: RowLayout, key_scale: torch.Tensor | None = None, softcap: float | None = None,
        probe: bool = False, call_length: int | None = None,
    ) -> BlockSelection:
        """``probe``: the queries are a sample of a longer prefill's (the density probe), not its end, so the
        ``dense_last`` tail does not apply. ``call_length``: the key length of the prefill call these queries
        belong to, which sets the threshold (``XAttnConfig.mass_threshold``); None = these keys' length."""
        config = self.config
        block_size = config.block_size
        batch, _, num_queries, _ = query.shape
        kv_heads, key_length = key.shape[1], key.shape[2]
        kv_start = RowLayout.of(kv_start).to(query.device)
        num_blocks = reference.num_row_blocks(key_length, kv_start, block_size)
        num_tiles = reference.num_query_tiles(num_queries, q_offset, kv_start, block_size)
        tiles_per_chunk = num_tiles if config.prefill_chunk is None else config.prefill_chunk // block_size
        threshold = config.mass_threshold("prefill", key_length if call_length is None else call_length)
        mask = torch.zeros(batch, kv_heads, num_tiles, num_blocks, dtype=torch.bool, device=query.device)
        # Every tile's (available, forced) at once: a few launches per call, not per chunk (1/Hkv of the mask).
        available, forced = self._tile_blocks(num_queries, q_offset, kv_start.starts, 0, num_tiles, num_blocks,
                                              0 if probe else config.dense_last)
        for first_tile in range(0, num_tiles, tiles_per_chunk):
            count = min(tiles_per_chunk, num_tiles - first_tile)
            mass = kernels.antidiagonal_block_scores(
                query, key, scale=scale, q_offset=q_offset, kv_start=kv_start, block_size=block_size,
                stride=config.stride, first_tile=first_tile, num_tiles=count, key_chunk=config.chunk_size,
                key_scale=key_scale, softcap=softcap, pool=config.pool,
            )
            chunk = slice(first_tile, first_tile + count)
            chosen = kernels.cumulative_threshold_select(
                mass, available[:, None, chunk], forced[:, None, chunk], threshold
            )
            mask[:, :, chunk] = self._reduce_group(chosen, kv_heads)
        return BlockSelection.from_mask(mask, block_size=block_size, query_tile=block_size)

    def select_decode(
        self, query: torch.Tensor, summaries: torch.Tensor, key: torch.Tensor, *, scale: float, q_offset: int,
        kv_start: RowLayout, key_scale: torch.Tensor | None = None, length: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> BlockSelection:
        """``length``: the key length as a one-element device tensor (``key`` and ``summaries`` a static cache's
        whole storage); every step then has the same shapes and reads nothing back to the host."""
        config = self.config
        batch, q_heads, num_queries, _ = query.shape
        kv_heads, num_blocks = summaries.shape[1], summaries.shape[2]
        kv_start = row_starts(kv_start).to(query.device)
        key_length = key.shape[2] if length is None else length
        if length is not None:
            q_offset = length - num_queries  # a device tensor: the slots below broadcast over it
        available = reference.block_availability(
            num_queries, num_blocks, q_offset, kv_start, config.block_size, key_length
        )  # [B, Sq, nb]
        logits = reference.block_logits(query, summaries, scale, available, softcap=softcap)
        probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)  # rows with no available block: 0
        block_ids = torch.arange(num_blocks, device=query.device)
        query_slots = q_offset + torch.arange(num_queries, device=query.device)
        own_block = torch.div(query_slots[None, :] - kv_start[:, None], config.block_size, rounding_mode="floor")
        forced = torch.zeros_like(available)
        if config.keep_diagonal:
            forced |= block_ids[None, None, :] == own_block[..., None]
        if config.keep_sink:
            forced |= (block_ids == 0)[None, None, :]
        chosen = kernels.cumulative_threshold_select(
            probs, available[:, None], forced[:, None], config.mass_threshold("decode")
        )
        # One row per KV head shared by every query of the call: union over queries and the group's heads.
        mask = chosen.any(2, keepdim=True).view(batch, kv_heads, q_heads // kv_heads, 1, num_blocks).any(2)
        return BlockSelection.from_mask(mask, block_size=config.block_size, query_tile=num_queries)

    def _tile_blocks(
        self, num_queries: int, q_offset: int, kv_start: torch.Tensor, first_tile: int, num_tiles: int,
        num_blocks: int, dense_last: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Boolean ``[B, n, nb]`` (available, forced) per query tile: available = row blocks starting at or
        before the tile's last real query; forced = the sink block and the blocks holding the tile's queries, and
        every available block of the tiles holding the call's last ``dense_last`` queries."""
        block_size = self.config.block_size
        device = kv_start.device
        pad_q = reference.padding_queries(num_queries, q_offset, kv_start)
        tiles = first_tile + torch.arange(num_tiles, device=device)
        first_query = pad_q[:, None] + tiles[None, :] * block_size
        last_query = torch.clamp_max(first_query + block_size, num_queries) - 1
        has_query = last_query >= first_query
        first_own = torch.div(q_offset + first_query - kv_start[:, None], block_size, rounding_mode="floor")
        last_own = torch.div(q_offset + last_query - kv_start[:, None], block_size, rounding_mode="floor")
        block_ids = torch.arange(num_blocks, device=device)[None, None, :]
        available = has_query[..., None] & (block_ids <= last_own[..., None])
        forced = torch.zeros_like(available)
        if self.config.keep_diagonal:
            forced |= (block_ids >= first_own[..., None]) & (block_ids <= last_own[..., None])
        if self.config.keep_sink:
            forced |= block_ids == 0
        if dense_last:  # tri-shape: the tiles holding the last queries keep every causal block
            forced |= (last_query >= num_queries - dense_last)[..., None]
        return available, forced & available

    def _reduce_group(self, chosen: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """``[B, Hq, n, nb]`` per-head masks -> ``[B, Hkv, n, nb]``: any head of the group, or more than
        ``vote_ratio`` of them (forced blocks are chosen by every head, so they survive both)."""
        batch, q_heads = chosen.shape[:2]
        grouped = chosen.view(batch, kv_heads, q_heads // kv_heads, *chosen.shape[2:])
        if self.config.gqa_reduce == "any":
            return grouped.any(2)
        return grouped.float().mean(2) > self.config.vote_ratio
