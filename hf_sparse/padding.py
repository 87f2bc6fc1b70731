"""The padding layout of a call: a :class:`~hf_sparse.selection.RowLayout` from transformers' 2D mask."""
from __future__ import annotations

import weakref

import torch

from .selection import RowLayout

#: The last 2D mask's layout, one tuple (mask weakref, key, row layout or None, left-padded or None, no padding):
#: every layer of a forward gets the same mask tensor, so its host read (the left-padding check and the starts'
#: range) happens once per forward, not once per layer (each read is a host sync, which on small models costs more
#: than the attention). A mask known only to hold padding has no layout yet (:func:`holds_no_padding`).
#: One tuple, replaced whole: threads running other models read either entry, never a mix.
_LAST_LAYOUT: list[tuple] = []


def _memo(attention_mask: torch.Tensor, key_length: int, device: torch.device) -> tuple | None:
    """The :data:`_LAST_LAYOUT` entry of this mask (the same tensor, unchanged since) and call, or None."""
    entry = _LAST_LAYOUT[0] if _LAST_LAYOUT else None
    if entry is None or entry[0]() is not attention_mask or entry[1] != (attention_mask._version, key_length, device):
        return None
    return entry


def _remember(attention_mask: torch.Tensor, key_length: int, device: torch.device, rows: RowLayout | None,
              left_padded: bool | None, unpadded: bool) -> None:
    """Make this mask's entry the :data:`_LAST_LAYOUT` one."""
    key = (attention_mask._version, key_length, device)
    _LAST_LAYOUT[:] = [(weakref.ref(attention_mask), key, rows, left_padded, unpadded)]


def mask_layout(attention_mask: torch.Tensor, key_length: int, device: torch.device) -> tuple[RowLayout, bool]:
    """(row layout, whether the mask is left padding only) of a 2D mask, memoised on the mask tensor (identity
    and version)."""
    entry = _memo(attention_mask, key_length, device)
    if entry is None or entry[2] is None:
        rows, left_padded = read_layout(attention_mask, key_length, device)
        _remember(attention_mask, key_length, device, rows, left_padded, left_padded and rows.high == 0)
        return rows, left_padded
    return entry[2], entry[3]


def holds_no_padding(attention_mask: torch.Tensor, key_length: int, device: torch.device) -> bool:
    """Whether a 2D mask masks no slot of the last ``key_length``, memoised as :func:`mask_layout`. Asked first, it
    reads one value (one launch, the host read): a mask without padding then has its layout too (every row from
    slot 0), without :func:`read_layout`'s launches (a prompt of a few thousand tokens is bound by the host's time)."""
    entry = _memo(attention_mask, key_length, device)
    if entry is not None:
        return entry[4]
    unpadded = read_unpadded(attention_mask, key_length)
    rows = RowLayout.uniform(attention_mask.shape[0], device) if unpadded else None
    _remember(attention_mask, key_length, device, rows, True if unpadded else None, unpadded)
    return unpadded


def read_unpadded(attention_mask: torch.Tensor, key_length: int) -> bool:
    """:func:`holds_no_padding` without the memo: one host read."""
    return bool(attention_mask[:, -key_length:].all())


def read_layout(attention_mask: torch.Tensor, key_length: int, device: torch.device) -> tuple[RowLayout, bool]:
    """:func:`mask_layout` without the memo: one host read."""
    mask = attention_mask[:, -key_length:].bool()
    kv_start = key_length - mask.sum(-1)
    left_only = (mask == (torch.arange(key_length, device=mask.device)[None, :] >= kv_start[:, None])).all()
    low, high, left_padded = torch.stack([kv_start.min(), kv_start.max(), left_only.long()]).tolist()
    return RowLayout(kv_start.to(device), int(low), int(high)), bool(left_padded)


def row_layout(attention_mask: torch.Tensor | None, batch: int, key_length: int,
               device: torch.device) -> RowLayout | None:
    """The rows' left-padding layout from the 2D mask (no padding when there is no mask), or None when the mask is
    not left padding (masked slots after unmasked ones: right padding), memoised as :func:`mask_layout`."""
    if attention_mask is None:
        return RowLayout.uniform(batch, device)
    rows, left_padded = mask_layout(attention_mask, key_length, device)
    return rows if left_padded else None


def padding_layout(attention_mask: torch.Tensor | None, batch: int, key_length: int, device: torch.device,
                   validate: bool) -> RowLayout:
    """The rows' left-padding layout from the 2D mask (no padding when there is no mask); shared by the layers
    of a forward, so its ``starts`` are not to be changed in place. ``validate`` raises unless the mask is left
    padding."""
    if attention_mask is None:
        return RowLayout.uniform(batch, device)
    if attention_mask.dim() != 2:
        raise NotImplementedError(
            f"hf_sparse sparse attention takes the 2D padding mask; got a {attention_mask.dim()}D mask "
            "(custom 4D masks are not supported on the sparse path)"
        )
    rows, left_padded = mask_layout(attention_mask, key_length, device)
    if validate and not left_padded:
        raise ValueError(
            "hf_sparse needs left padding (padding_side='left'): the attention mask has masked slots after "
            "unmasked ones"
        )
    return rows
