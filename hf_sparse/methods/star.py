"""Star Attention block selection: a fixed pattern, {anchor, own context block} in phase 1, everything in phase 2.

Blocks are counted in kernel blocks of ``config.kernel_block_size`` tokens (a power of two dividing the anchor and
the context block), so the anchor and every context block are whole kernel blocks. Phase-1 query tiles are one
kernel block long: a tile lists only the blocks up to its own (no work above the causal diagonal).
"""
from __future__ import annotations

import functools

import torch

from ..config import StarConfig
from ..selection import BlockSelection, RowLayout


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


@functools.lru_cache(maxsize=256)
def _pattern_density(num_tiles: int, anchor_blocks: int, blocks_per_context_block: int) -> float:
    """Attended / causal blocks of the phase-1 pattern over ``num_tiles`` one-block query tiles (no prefix)."""
    attended = causal = 0
    for tile in range(num_tiles):
        first_own = tile - tile % blocks_per_context_block
        # The first context block holds the anchor: its tiles attend causally; later tiles attend the anchor too.
        attended += tile + 1 if first_own == 0 else anchor_blocks + tile - first_own + 1
        causal += tile + 1
    return attended / causal if causal else 1.0


class StarMethod:
    """Phase-1 (context encoding) and phase-2 (query / generation) selections; see the module docstring.

    Follows the method protocol of :class:`hf_sparse.methods.plas.PLASMethod` (``select_prefill`` /
    ``select_decode``); block summaries are not used.
    """

    name = "star"

    def __init__(self, config: StarConfig) -> None:
        self.config = config

    def context_selection(
        self, batch: int, kv_heads: int, num_queries: int, device: torch.device, prefix_tokens: int = 0
    ) -> BlockSelection:
        """Selection for ``num_queries`` context queries whose keys are the same slots (``q_offset=0``).

        Slots are counted per row from its first valid slot (left padding, see ``kernels.reference``). With
        ``prefix_tokens=0`` context block ``i`` starts at slot ``i * block_size`` and the anchor is the head of
        block 0. With ``prefix_tokens=anchor_size`` (a rank whose shard does not start at block 0) the anchor is
        prepended: its queries attend causally to the anchor only, and the shard's blocks follow it.
        """
        config = self.config
        granule = config.kernel_block_size
        if prefix_tokens not in (0, config.anchor_size):
            raise ValueError(f"prefix_tokens must be 0 or anchor_size ({config.anchor_size}), got {prefix_tokens}")
        anchor_blocks = config.anchor_size // granule
        blocks_per_context_block = config.block_size // granule
        prefix_blocks = prefix_tokens // granule
        # Tiles past a short row's real queries are skipped by the kernels, so no host read of kv_start is needed.
        num_tiles = _ceil_div(num_queries, granule)
        tile = torch.arange(num_tiles, device=device)
        block = torch.arange(num_tiles, device=device)
        in_context = tile >= prefix_blocks
        context_block = torch.div(tile - prefix_blocks, blocks_per_context_block, rounding_mode="floor")
        first_own = torch.where(in_context, prefix_blocks + context_block * blocks_per_context_block,
                                torch.zeros_like(tile))
        causal = block[None, :] <= tile[:, None]
        own = block[None, :] >= first_own[:, None]
        anchor = block[None, :] < anchor_blocks
        mask = causal & (own | anchor)
        width = min(num_tiles, anchor_blocks + blocks_per_context_block)
        return self._broadcast(mask, batch, kv_heads, granule, granule, width)

    def context_density(self, num_queries: int) -> float:
        """Attended / causal key blocks of :meth:`context_selection` (one process, no prefix) over ``num_queries``
        context queries: the share of dense causal attention phase 1 computes, from the pattern alone (host
        arithmetic, no device work)."""
        config = self.config
        granule = config.kernel_block_size
        return _pattern_density(_ceil_div(num_queries, granule), config.anchor_size // granule,
                                config.block_size // granule)

    def full_selection(self, batch: int, kv_heads: int, num_queries: int, key_length: int,
                       device: torch.device) -> BlockSelection:
        """One tile of ``num_queries`` queries over every key block (phase 2: causality is the kernel's)."""
        granule = self.config.kernel_block_size
        num_blocks = max(1, _ceil_div(key_length, granule))
        mask = torch.ones(1, num_blocks, dtype=torch.bool, device=device)
        return self._broadcast(mask, batch, kv_heads, granule, max(1, num_queries), num_blocks)

    @staticmethod
    def _broadcast(mask: torch.Tensor, batch: int, kv_heads: int, block_size: int, query_tile: int,
                   width: int) -> BlockSelection:
        # The pattern is the same for every row and head: build it once, expand (no copy).
        one = BlockSelection.from_mask(mask[None, None], block_size=block_size, query_tile=query_tile)
        indices = one.indices[..., :width].expand(batch, kv_heads, -1, -1)
        counts = one.counts.expand(batch, kv_heads, -1)
        return BlockSelection(indices=indices, counts=counts, block_size=block_size, query_tile=query_tile)

    # -- method protocol ---------------------------------------------------------------------------------------
    def select_prefill(
        self, query: torch.Tensor, summaries: torch.Tensor | None, key: torch.Tensor, *, scale: float,
        q_offset: int, kv_start: RowLayout, key_scale: torch.Tensor | None = None,
    ) -> BlockSelection:
        """Every query of the call is a context query of one process (phase 1)."""
        if q_offset != 0:
            raise ValueError(f"Star context encoding starts from an empty cache (q_offset 0), got q_offset={q_offset}")
        return self.context_selection(query.shape[0], key.shape[1], query.shape[2], query.device)

    def select_decode(
        self, query: torch.Tensor, summaries: torch.Tensor | None, key: torch.Tensor, *, scale: float,
        q_offset: int, kv_start: RowLayout, key_scale: torch.Tensor | None = None,
    ) -> BlockSelection:
        """Query and generated tokens attend to every key (phase 2)."""
        return self.full_selection(query.shape[0], key.shape[1], query.shape[2], key.shape[2], query.device)
