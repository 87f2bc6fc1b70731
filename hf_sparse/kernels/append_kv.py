"""Static cache append at a device-side length: new key and value states written at slots ``length + [0, n)``
and ``length`` advanced by ``n``, in one launch; optionally each row's count of valid key blocks from the new
length (what a decode over every block of the row attends).

Semantics: :func:`hf_sparse.kernels.reference.append_kv`. A CUDA-graph decode step writes each layer's new states
at the cache's valid-slot count, which lives on the device; in PyTorch ops that is five launches per layer (the
positions' ``arange`` and add, two ``index_copy_``, the count's ``add_``), a tenth of a small model's decode step.
Here one program reads the count, copies every (batch, head, token) row of both states in tiles of ``ROWS`` rows,
and, after a barrier (every thread has read the count), stores the advanced count: no other program can read a
half-advanced count, because there is no other program. With ``counts`` it also writes ``ceil((length - start)
/ block_size)`` per row: an all-blocks decode step (a dense layer under a CUDA graph) then counts its blocks with
no launch of its own (six small PyTorch ops per layer otherwise).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import dependent_launch_args, next_power_of_2


@triton.jit
def _append_kv_kernel(
    KEYS, VALUES, K_OUT, V_OUT, LENGTH, STARTS, COUNTS,
    stride_xb, stride_xh, stride_xs, stride_xd,
    stride_yb, stride_yh, stride_ys, stride_yd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    rows, tokens, batch,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, D_PAD: tl.constexpr,
    DV_PAD: tl.constexpr, ROWS: tl.constexpr, HAS_COUNTS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    B_PAD: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # programmatic dependent launch: the kernel before is done first, the one after may launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    start = tl.load(LENGTH)
    offs_r = tl.arange(0, ROWS)
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < HEAD_DIM_V
    for first in range(0, rows, ROWS):
        row = first + offs_r  # row = (b * HEADS + h) * tokens + token
        ok = row < rows
        token = (row % tokens).to(tl.int64)
        b = (row // tokens // HEADS).to(tl.int64)
        h = (row // tokens % HEADS).to(tl.int64)
        slot = start + token
        k_ok = ok[:, None] & d_ok[None, :]
        k = tl.load(KEYS + (b * stride_xb + h * stride_xh + token * stride_xs)[:, None] + offs_d[None, :] * stride_xd,
                    mask=k_ok)
        tl.store(K_OUT + (b * stride_kb + h * stride_kh + slot * stride_ks)[:, None] + offs_d[None, :] * stride_kd,
                 k, mask=k_ok)
        v_ok = ok[:, None] & dv_ok[None, :]
        v = tl.load(VALUES + (b * stride_yb + h * stride_yh + token * stride_ys)[:, None]
                    + offs_dv[None, :] * stride_yd, mask=v_ok)
        tl.store(V_OUT + (b * stride_vb + h * stride_vh + slot * stride_vs)[:, None] + offs_dv[None, :] * stride_vd,
                 v, mask=v_ok)
    tl.debug_barrier()  # every thread has read the count before any stores the new one
    tl.store(LENGTH, start + tokens)
    if HAS_COUNTS:
        offs_b = tl.arange(0, B_PAD)
        b_ok = offs_b < batch
        first = tl.load(STARTS + offs_b, mask=b_ok, other=0)
        valid = tl.maximum(start + tokens - first, 0)
        tl.store(COUNTS + offs_b, ((valid + BLOCK_SIZE - 1) // BLOCK_SIZE).to(COUNTS.dtype.element_ty), mask=b_ok)


def append_kv(key_states: torch.Tensor, value_states: torch.Tensor, key_storage: torch.Tensor,
              value_storage: torch.Tensor, length: torch.Tensor, starts: torch.Tensor | None = None,
              counts: torch.Tensor | None = None, block_size: int = 0) -> None:
    """Triton version of :func:`hf_sparse.kernels.reference.append_kv` (same arguments, same result)."""
    batch, heads, tokens, head_dim = key_states.shape
    head_dim_v = value_states.shape[-1]
    rows = batch * heads * tokens
    if rows == 0:
        return
    d_pad, dv_pad = max(16, next_power_of_2(head_dim)), max(16, next_power_of_2(head_dim_v))
    has_counts = counts is not None
    _append_kv_kernel[(1,)](
        key_states, value_states, key_storage, value_storage, length,
        starts if has_counts else length, counts if has_counts else length,
        *key_states.stride(), *value_states.stride(), *key_storage.stride(), *value_storage.stride(),
        rows, tokens, batch,
        HEADS=heads, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, D_PAD=d_pad, DV_PAD=dv_pad,
        ROWS=max(1, min(next_power_of_2(rows), 8192 // max(d_pad, dv_pad))), HAS_COUNTS=has_counts,
        BLOCK_SIZE=max(1, block_size), B_PAD=next_power_of_2(batch), num_warps=4,
        **dependent_launch_args(key_states.device),
    )
