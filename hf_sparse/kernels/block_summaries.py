"""Block summaries (PLAS compressed keys): gate-weighted sum, or mean, of each row block's valid keys.

Semantics: :func:`hf_sparse.kernels.reference.block_summaries`. One program per (batch, KV head, block) walks
the block's slots ``ROWS`` at a time, so any block size and head dim fit in registers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_length, check_token_scale, next_power_of_2
from ..selection import RowLayout, row_starts
from .reference import kv_start_range


@triton.jit
def _round_to(x, ROUND: tl.constexpr):
    """float32 ``x`` rounded to float16 (ROUND 1) or bfloat16 (ROUND 2, round-to-nearest-even on the bits: the
    interpreter's bfloat16 conversion does not round so), as float32; unchanged for ROUND 0."""
    if ROUND == 1:
        return x.to(tl.float16).to(tl.float32)
    if ROUND == 2:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)
    return x


@triton.jit
def _block_summaries_kernel(
    K, W, OUT, KV_START, LENGTH, K_SCALE,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_wh, stride_wi, stride_wd,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_ksb, stride_ksh, stride_kss,
    key_length, first_block, recent, out_blocks,
    KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, HAS_GATE: tl.constexpr, RECENT: tl.constexpr,
    QUANT: tl.constexpr, ROUND: tl.constexpr,
):
    batch_head = tl.program_id(0)
    b = batch_head // KV_HEADS
    h = batch_head % KV_HEADS
    kv_start = tl.load(KV_START + b).to(tl.int32)
    if RECENT:  # the row blocks holding the last `recent` of LENGTH slots, stored at their own index
        key_length = tl.load(LENGTH).to(tl.int32)
        block = tl.maximum(key_length - recent - kv_start, 0) // BLOCK_SIZE + tl.program_id(1)
        row_block = block
    else:
        block = tl.program_id(1)
        row_block = first_block + block
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    block_first = kv_start + row_block * BLOCK_SIZE
    total = tl.zeros([D_PAD], tl.float32)
    valid_slots = tl.zeros([ROWS], tl.float32)
    for r0 in tl.static_range(0, BLOCK_SIZE, ROWS):
        in_block = r0 + tl.arange(0, ROWS)
        slots = block_first + in_block
        valid = slots < key_length
        keys = tl.load(K + b * stride_kb + h * stride_kh + slots[:, None].to(tl.int64) * stride_ks
                       + offs_d[None, :] * stride_kd, mask=valid[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        if QUANT:  # int8 keys times their per-token scale, rounded to the model's dtype as the cache's keys are
            token_scale = tl.load(K_SCALE + b * stride_ksb + h * stride_ksh + slots.to(tl.int64) * stride_kss,
                                  mask=valid, other=0.0)
            keys = _round_to(keys * token_scale[:, None], ROUND)
        if HAS_GATE:
            weight = tl.load(W + h * stride_wh + in_block[:, None] * stride_wi + offs_d[None, :] * stride_wd,
                             mask=d_ok[None, :], other=0.0).to(tl.float32)
            keys = keys * weight
        total += tl.sum(keys, 0)
        valid_slots += valid.to(tl.float32)
    if not HAS_GATE:
        total = total / tl.maximum(tl.sum(valid_slots, 0), 1.0)
    store_ok = d_ok
    if RECENT:
        store_ok = d_ok & (offs_d * 0 + block_first < key_length) & (offs_d * 0 + block < out_blocks)
    tl.store(OUT + b * stride_ob + h * stride_oh + block * stride_on + offs_d * stride_od, total, mask=store_ok)



def block_summaries(
    keys: torch.Tensor,
    gate_weight: torch.Tensor | None,
    kv_start: torch.Tensor | RowLayout,
    block_size: int,
    first_block: int = 0,
    num_blocks: int | None = None,
    *,
    out: torch.Tensor | None = None,
    key_scale: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Triton version of :func:`hf_sparse.kernels.reference.block_summaries`: float32 ``[B, Hkv, n, D]``.

    ``keys`` is ``[B, Hkv, Skv, D]`` with any strides; ``out`` (float32, that shape, any strides) is written in
    place when given. Without ``num_blocks`` the count is read from ``kv_start`` (one device-to-host copy).
    int8 ``keys`` come with their float32 per-token ``key_scale`` ``[B, Hkv, Skv]`` and the ``dtype`` the
    dequantised keys are rounded to (dequantised in registers: no copy).
    """
    if keys.dim() != 4 or not (keys.is_floating_point() or keys.dtype == torch.int8):
        raise ValueError(f"keys must be a floating or int8 [B, Hkv, Skv, D] tensor, got {tuple(keys.shape)} {keys.dtype}")
    batch, heads, length, dim = keys.shape
    if num_blocks is None:
        num_blocks = -(-(length - kv_start_range(kv_start)[0]) // block_size) - first_block
    kv_start = row_starts(kv_start)
    if kv_start.shape != (batch,) or kv_start.is_floating_point():
        raise ValueError(f"kv_start must be an integer [batch={batch}] tensor, got {tuple(kv_start.shape)} {kv_start.dtype}")
    _check_gate(gate_weight, keys, block_size)
    _check_scale(keys, key_scale, dtype)
    if block_size < 1 or first_block < 0:
        raise ValueError(f"block_size must be >= 1 and first_block >= 0, got {block_size}, {first_block}")
    kv_start = kv_start.to(keys.device)  # any integer dtype: read as int32 in the kernel (no cast launch)
    num_blocks = max(0, num_blocks)
    if out is None:
        out = torch.empty(batch, heads, num_blocks, dim, dtype=torch.float32, device=keys.device)
    elif tuple(out.shape) != (batch, heads, num_blocks, dim) or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 {(batch, heads, num_blocks, dim)}, got {tuple(out.shape)} {out.dtype}")
    if num_blocks == 0 or batch * heads == 0:
        return out
    _launch(keys, gate_weight, kv_start, block_size, out, (batch * heads, num_blocks), length, first_block,
            key_scale=key_scale, dtype=dtype)
    return out


def recent_block_summaries(
    keys: torch.Tensor,
    gate_weight: torch.Tensor | None,
    kv_start: torch.Tensor | RowLayout,
    block_size: int,
    length: torch.Tensor,
    recent: int,
    out: torch.Tensor,
    key_scale: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Rewrite in ``out`` (float32 ``[B, Hkv, n, D]``, all row blocks) the summaries of the row blocks holding
    the last ``recent`` of ``length`` valid slots (``length``: a one-element integer tensor on the device;
    ``keys``: a static cache's whole storage). Nothing is read back to the host: one launch serves every
    decode step of a CUDA graph. Blocks before them must already be summarised. int8 ``keys`` come with their
    float32 per-token ``key_scale`` ``[B, Hkv, S]`` and the ``dtype`` the dequantised keys are rounded to.
    """
    batch, heads, _, dim = keys.shape
    if not 1 <= recent <= block_size:
        raise ValueError(f"recent must be in [1, block_size={block_size}], got {recent}")
    if out.dtype != torch.float32 or tuple(out.shape[:2]) != (batch, heads) or out.shape[3] != dim:
        raise ValueError(f"out must be float32 [{batch}, {heads}, n, {dim}], got {tuple(out.shape)} {out.dtype}")
    _check_gate(gate_weight, keys, block_size)
    _check_scale(keys, key_scale, dtype)
    # `recent` <= block_size slots span at most two blocks of a row.
    _launch(keys, gate_weight, row_starts(kv_start).to(keys.device), block_size, out, (batch * heads, 2), 0, 0,
            check_length(length, keys.device), recent, key_scale, dtype)
    return out


_ROUNDING = {torch.float16: 1, torch.bfloat16: 2}


def _check_gate(gate_weight: torch.Tensor | None, keys: torch.Tensor, block_size: int) -> None:
    """Raise unless the gate weight (if any) is [kv_heads, block_size, head_dim] for these keys."""
    heads, dim = keys.shape[1], keys.shape[3]
    if gate_weight is not None and tuple(gate_weight.shape) != (heads, block_size, dim):
        raise ValueError(
            f"gate weight shape {tuple(gate_weight.shape)} != [kv_heads={heads}, block_size={block_size}, head_dim={dim}]"
        )


def _check_scale(keys: torch.Tensor, key_scale: torch.Tensor | None, dtype: torch.dtype | None) -> None:
    """Raise unless int8 keys come with their per-token scale and a dequantisation dtype (and only they do)."""
    if (keys.dtype == torch.int8) != (key_scale is not None):
        raise ValueError("int8 keys need their key_scale (and only int8 keys take one)")
    if key_scale is not None:
        check_token_scale("key_scale", key_scale, keys)
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"int8 keys need the dtype they dequantise to (float16/bfloat16/float32), got {dtype}")


def _launch(keys, gate_weight, kv_start, block_size, out, grid, key_length, first_block, length=None, recent=0,
            key_scale=None, dtype=None):
    dim = keys.shape[3]
    weight = gate_weight if gate_weight is not None else keys.new_empty(1, 1, 1)
    scale = key_scale if key_scale is not None else out.new_empty(1, 1, 1)
    d_pad = max(16, next_power_of_2(dim))
    rows = max(1, min(next_power_of_2(block_size), 8192 // d_pad))
    if block_size % rows:
        rows = 1  # block sizes that are not powers of two: one slot at a time
    _block_summaries_kernel[grid](
        keys, weight, out, kv_start, length if length is not None else kv_start, scale,
        *keys.stride(), *weight.stride(), *out.stride(), *scale.stride(),
        key_length, first_block, recent, out.shape[2],
        KV_HEADS=keys.shape[1], BLOCK_SIZE=block_size, ROWS=rows, HEAD_DIM=dim, D_PAD=d_pad,
        HAS_GATE=gate_weight is not None, RECENT=length is not None, QUANT=key_scale is not None,
        ROUND=_ROUNDING.get(dtype, 0), num_warps=4,
    )
