"""BlockSelection: the one block-index format passed from selection methods to attention kernels."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BlockSelection:
    """Key blocks attended by each (batch, head, query tile), in FlexAttention's BlockMask style.

    Attributes:
        indices: int32 ``[batch, heads, query_tiles, max_blocks]``. Row ``(b, h, t)`` lists the selected
            key-block ids in ascending order in its first ``counts[b, h, t]`` entries; entries past the count
            are padding (value -1) and must not be read.
        counts: int32 ``[batch, heads, query_tiles]``, number of valid entries per row.
        block_size: tokens per key block (block ``j`` covers key slots ``[j*block_size, (j+1)*block_size)``).
        query_tile: consecutive queries sharing one row (query ``i`` uses tile ``i // query_tile``).

    ``heads`` is either the number of query heads (one selection per query head) or the number of KV
    heads (one selection shared by the query heads of a GQA group); kernels map query head ``h`` to row
    ``h // (num_query_heads // heads)``.
    """

    indices: torch.Tensor
    counts: torch.Tensor
    block_size: int
    query_tile: int

    def __post_init__(self) -> None:
        if self.indices.dim() != 4 or self.counts.dim() != 3:
            raise ValueError(
                f"BlockSelection needs indices [B,H,T,K] and counts [B,H,T]; got {tuple(self.indices.shape)} "
                f"and {tuple(self.counts.shape)}"
            )
        if self.indices.shape[:3] != self.counts.shape:
            raise ValueError(
                f"BlockSelection indices {tuple(self.indices.shape)} and counts {tuple(self.counts.shape)} disagree"
            )

    @property
    def num_heads(self) -> int:
        return self.indices.shape[1]

    @property
    def num_query_tiles(self) -> int:
        return self.indices.shape[2]

    @classmethod
    def from_mask(cls, block_mask: torch.Tensor, block_size: int, query_tile: int) -> "BlockSelection":
        """Build from a boolean ``[B, H, T, num_blocks]`` mask (True = attend)."""
        num_blocks = block_mask.shape[-1]
        # A permutation: selected block j goes to slot (selected blocks before it), the others after all of them.
        selected_before = torch.cumsum(block_mask, -1, dtype=torch.int32)  # including j
        counts = block_mask.sum(-1, dtype=torch.int32)
        ids = torch.arange(num_blocks, device=block_mask.device, dtype=torch.int32)
        target = torch.where(block_mask, selected_before - 1, counts.unsqueeze(-1) + ids - selected_before)
        indices = torch.empty_like(selected_before).scatter_(-1, target.long(), torch.where(block_mask, ids, -1))
        return cls(indices=indices, counts=counts, block_size=block_size, query_tile=query_tile)

    def to_mask(self, num_blocks: int) -> torch.Tensor:
        """Boolean ``[B, H, T, num_blocks]`` mask of the selected blocks."""
        mask = torch.zeros(*self.counts.shape, num_blocks + 1, dtype=torch.bool, device=self.counts.device)
        safe = torch.where(self.indices >= 0, self.indices, torch.full_like(self.indices, num_blocks))
        mask.scatter_(-1, safe.long(), True)
        return mask[..., :num_blocks]
