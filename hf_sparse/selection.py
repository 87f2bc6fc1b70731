"""The block-index format passed from selection methods to attention kernels: BlockSelection (which blocks)
and RowLayout (where each row's blocks start)."""
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

    def with_full_rows(self, full_rows: torch.Tensor, last_block: torch.Tensor, num_blocks: int) -> "BlockSelection":
        """This selection with every causal block in the batch rows of ``full_rows`` (bool ``[B]``): tile ``t`` of
        row ``b`` gets blocks ``0..last_block[b, t]`` (``[B, T]``; -1: none), what dense attention reads. Device
        ops only (a CUDA graph can replay them); the result is ``num_blocks`` wide."""
        causal = torch.arange(num_blocks, device=last_block.device)[None, None, :] <= last_block[..., None]
        mask = torch.where(full_rows.to(causal.device)[:, None, None, None], causal[:, None],
                           self.to_mask(num_blocks))
        return BlockSelection.from_mask(mask, block_size=self.block_size, query_tile=self.query_tile)

    def to_mask(self, num_blocks: int) -> torch.Tensor:
        """Boolean ``[B, H, T, num_blocks]`` mask of the selected blocks."""
        mask = torch.zeros(*self.counts.shape, num_blocks + 1, dtype=torch.bool, device=self.counts.device)
        safe = torch.where(self.indices >= 0, self.indices, torch.full_like(self.indices, num_blocks))
        mask.scatter_(-1, safe.long(), True)
        return mask[..., :num_blocks]


@dataclass(frozen=True)
class RowLayout:
    """Where each row's sequence starts among its key slots (left padding), with the range known on the host.

    Attributes:
        starts: integer ``[batch]``: row ``b`` holds its sequence in key slots ``starts[b] <= s < Skv``
            (the count of left-padding slots); blocks and query tiles are counted from there.
        low, high: ``min`` / ``max`` of ``starts`` as host ints, so that launchers size their grids and pick
            their layouts without reading the device.

    Made once per sequence (from the padding mask, one host read: :meth:`read`) and passed down from the cache
    to the kernels. The kernels take a plain tensor too (then they read its range when they need it).
    """

    starts: torch.Tensor
    low: int
    high: int

    def __post_init__(self) -> None:
        if self.starts.dim() != 1 or self.starts.is_floating_point():
            raise ValueError(f"RowLayout.starts must be an integer [batch] tensor, got {tuple(self.starts.shape)} "
                             f"{self.starts.dtype}")
        if not 0 <= self.low <= self.high:
            raise ValueError(f"RowLayout range must satisfy 0 <= low <= high, got low={self.low}, high={self.high}")

    @classmethod
    def read(cls, starts: torch.Tensor) -> "RowLayout":
        """The layout of ``starts``, its range read from the device (one host read)."""
        if starts.numel() == 0:
            return cls(starts, 0, 0)
        low, high = torch.stack([starts.min(), starts.max()]).tolist()
        return cls(starts, int(low), int(high))

    @classmethod
    def uniform(cls, batch: int, device: torch.device | str | None = None, start: int = 0) -> "RowLayout":
        """Every row starting at slot ``start`` (no padding by default); nothing is read back. One object per
        (batch, device, start), made once: every layer of every call shares it, so its ``starts`` are never to be
        changed in place (as any layout passed down a forward)."""
        if not isinstance(device, torch.device):
            device = torch.device(device) if device is not None else torch.device("cpu")
        key = (batch, device, start)
        layout = _UNIFORM.get(key)
        if layout is None:
            layout = _UNIFORM[key] = cls(torch.full((batch,), start, dtype=torch.int64, device=key[1]), start, start)
        return layout

    @classmethod
    def of(cls, kv_start: "torch.Tensor | RowLayout") -> "RowLayout":
        """``kv_start`` itself when it is a layout, else the layout of the tensor (one host read)."""
        return kv_start if isinstance(kv_start, RowLayout) else cls.read(kv_start)

    @property
    def batch(self) -> int:
        return self.starts.shape[0]

    def to(self, device: torch.device | str) -> "RowLayout":
        """The same layout with ``starts`` on ``device``."""
        return self if self.starts.device == torch.device(device) else RowLayout(self.starts.to(device), self.low,
                                                                                   self.high)

    def aligned(self, multiple: int) -> bool:
        """Whether every row starts at one slot that is a multiple of ``multiple`` (no padding, or the same in
        every row): then tiles of ``multiple`` slots counted from each row's start lie on the storage grid."""
        return self.low == self.high and self.low % multiple == 0


#: RowLayout.uniform's layouts, by (batch, device, start).
_UNIFORM: dict[tuple[int, torch.device, int], RowLayout] = {}


def row_starts(kv_start: "torch.Tensor | RowLayout") -> torch.Tensor:
    """The per-row start tensor of a :class:`RowLayout` or of a plain tensor."""
    return kv_start.starts if isinstance(kv_start, RowLayout) else kv_start
