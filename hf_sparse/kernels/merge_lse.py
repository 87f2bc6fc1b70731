"""Merge of partial attention results computed over disjoint key sets, by log-sum-exp.

Semantics: :func:`hf_sparse.kernels.reference.merge_lse`. Used by the split decode and by Star Attention.
Rows are the output's leading dims (up to three, e.g. batch, head, query) addressed through strides, so
BNSD and BSND views merge without copies; ``BLOCK_R`` rows per program.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_power_of_2


#: Parts loaded per step of the ``merge_lse`` kernel's merge: their loads are issued together (one L2 round trip
#: per step, not one per part).
PARTS_PER_STEP = tl.constexpr(4)


def parts_per_step(rows: int, d_pad: int) -> int:
    """Parts a merge of ``rows`` x ``d_pad`` float32 partials loads per step: as many as keep the step's loads
    within 8192 values (64 registers a thread at 4 warps), 4 to 16. The split decode merges up to 64 parts on
    its critical path, a few rows each: 16 a step is 4 dependent L2 round trips instead of 16."""
    return max(4, min(16, 8192 // max(1, rows * d_pad)))


@triton.jit
def _merge_parts(lse_ptrs, part_ptrs, stride_lse_n, stride_part_n, num_parts, row_ok, d_ok,
                 ROWS: tl.constexpr, D_PAD: tl.constexpr, PARTS_PER_STEP: tl.constexpr):
    """Merge ``num_parts`` partial results of ``ROWS`` rows: ``lse_ptrs`` ``[ROWS]`` and ``part_ptrs``
    ``[ROWS, D_PAD]`` point at part 0 (part n is ``stride_*_n`` further). Returns the float32 merged output
    ``[ROWS, D_PAD]`` and lse ``[ROWS]``; a row with no part seen is zero with lse -inf. One pass with a
    running maximum, ``PARTS_PER_STEP`` parts per step (their loads issued together). Loads bypass L1
    (``.cg``), so parts other programs of the same launch wrote are read correctly."""
    top = tl.full([ROWS], float("-inf"), tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_PAD], tl.float32)
    for n0 in range(0, num_parts, PARTS_PER_STEP):
        for j in tl.static_range(PARTS_PER_STEP):
            # a [ROWS] vector: the interpreter rejects a mask and-ed with a scalar condition
            ok = row_ok & (tl.zeros([ROWS], tl.int32) + (n0 + j) < num_parts)
            lse = tl.load(lse_ptrs + (n0 + j) * stride_lse_n, mask=ok, other=float("-inf"), cache_modifier=".cg")
            part = tl.load(part_ptrs + (n0 + j) * stride_part_n, mask=ok[:, None] & d_ok[None, :], other=0.0,
                           cache_modifier=".cg")
            new_top = tl.maximum(top, lse)
            new_safe = tl.where(new_top == float("-inf"), 0.0, new_top)
            keep = tl.exp(top - new_safe)  # 0 while nothing was seen
            weight = tl.exp(lse - new_safe)
            acc = acc * keep[:, None] + weight[:, None] * part.to(tl.float32)
            total = total * keep + weight
            top = new_top
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    seen = total > 0.0
    out = acc / tl.where(seen, total, 1.0)[:, None]
    merged = tl.where(seen, top_safe + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    return out, merged


@triton.jit
def _merge_lse_kernel(
    PARTS, PART_LSE, OUT, OUT_LSE, SKIP,
    stride_pn, stride_p0, stride_p1, stride_p2, stride_pd,
    stride_ln, stride_l0, stride_l1, stride_l2,
    stride_o0, stride_o1, stride_o2, stride_od,
    stride_m0, stride_m1, stride_m2,
    size1, size2, num_rows, num_parts,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_R: tl.constexpr, HAS_SKIP: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    i0 = (rows // (size1 * size2)).to(tl.int64)
    if HAS_SKIP:  # rows whose first index is skipped are neither read nor written
        row_ok = row_ok & (tl.load(SKIP + i0, mask=row_ok, other=1).to(tl.int32) == 0)
    i1 = (rows // size2) % size1
    i2 = rows % size2
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    lse_rows = PART_LSE + i0 * stride_l0 + i1 * stride_l1 + i2 * stride_l2
    part_rows = PARTS + i0 * stride_p0 + i1 * stride_p1 + i2 * stride_p2
    out, merged = _merge_parts(lse_rows, part_rows[:, None] + offs_d[None, :] * stride_pd, stride_ln, stride_pn,
                               num_parts, row_ok, d_ok, BLOCK_R, D_PAD, PARTS_PER_STEP)
    tl.store(OUT + i0[:, None] * stride_o0 + i1[:, None] * stride_o1 + i2[:, None] * stride_o2 + offs_d[None, :] * stride_od,
             out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(OUT_LSE + i0 * stride_m0 + i1 * stride_m1 + i2 * stride_m2, merged, mask=row_ok)


def _row_view(tensor: torch.Tensor, keep_front: int, keep_back: int, writable: bool = False) -> torch.Tensor:
    """The middle (row) dims of ``tensor`` as exactly three: a view whenever strides allow (else a copy, which
    an output, ``writable``, must not be)."""
    front = tensor.shape[:keep_front]
    back = tensor.shape[tensor.dim() - keep_back:]
    middle = tensor.shape[keep_front:tensor.dim() - keep_back]
    while len(middle) < 3:
        middle = (1,) + tuple(middle)
    if len(middle) > 3:
        lead = 1
        for size in middle[:len(middle) - 2]:
            lead *= size
        middle = (lead,) + tuple(middle[len(middle) - 2:])
    if writable:
        return tensor.view(*front, *middle, *back)
    return tensor.reshape(*front, *middle, *back)


def merge_lse(
    outputs: torch.Tensor,
    lses: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
    skip: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`hf_sparse.kernels.reference.merge_lse`.

    ``outputs`` ``[N, ..., D]`` (float16/bfloat16/float32), ``lses`` ``[N, ...]`` float32; returns the merged
    output ``[..., D]`` (in ``out``'s dtype when given, else the outputs') and the merged float32 lse ``[...]``.
    Parts whose lse is ``-inf`` contribute nothing; a row with no part seen is zero with lse ``-inf``.
    ``skip`` (bool ``[R0]``, for outputs ``[N, R0, R1, R2, D]``) leaves the rows ``[i, ...]`` with
    ``skip[i]`` untouched.
    """
    if outputs.dim() < 2 or outputs.shape[:-1] != lses.shape:
        raise ValueError(f"outputs {tuple(outputs.shape)} must be [N, ..., D] with lses {tuple(lses.shape)} = [N, ...]")
    if lses.dtype != torch.float32:
        raise TypeError(f"lses must be float32, got {lses.dtype}")
    if outputs.device != lses.device:
        raise ValueError("outputs and lses must be on one device")
    num_parts, head_dim = outputs.shape[0], outputs.shape[-1]
    rows_shape = outputs.shape[1:-1]
    if out is None:
        out = torch.empty(*rows_shape, head_dim, dtype=outputs.dtype, device=outputs.device)
    if out_lse is None:
        out_lse = torch.empty(rows_shape, dtype=torch.float32, device=outputs.device)
    if out.shape != outputs.shape[1:] or out_lse.shape != rows_shape or out_lse.dtype != torch.float32:
        raise ValueError(f"out {tuple(out.shape)} / out_lse {tuple(out_lse.shape)} do not match {tuple(outputs.shape[1:])}")
    num_rows = 1
    for size in rows_shape:
        num_rows *= size
    if num_rows == 0 or head_dim == 0:
        return out, out_lse
    if num_parts == 0:
        out.zero_()
        out_lse.fill_(float("-inf"))
        return out, out_lse
    if skip is not None:
        if outputs.dim() != 5 or skip.shape != (outputs.shape[1],) or skip.dtype != torch.bool:
            raise ValueError(f"skip must be a bool [{outputs.shape[1]}] tensor over the first row dim of [N, R0, R1, R2, D] "
                             f"outputs; got {tuple(skip.shape)} {skip.dtype} for {tuple(outputs.shape)}")
        skip_flags = skip.contiguous().view(torch.uint8)
    else:
        skip_flags = lses  # never read
    parts = _row_view(outputs, 1, 1)
    part_lse = _row_view(lses, 1, 0)
    out_rows = _row_view(out, 0, 1, writable=True)
    lse_rows = _row_view(out_lse, 0, 0, writable=True)
    d_pad = max(16, next_power_of_2(head_dim))
    block_r = max(1, min(64, 4096 // d_pad))
    _merge_lse_kernel[(-(-num_rows // block_r),)](
        parts, part_lse, out_rows, lse_rows, skip_flags,
        *parts.stride(), *part_lse.stride(), *out_rows.stride(), *lse_rows.stride(),
        parts.shape[2], parts.shape[3], num_rows, num_parts,
        HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_R=block_r, HAS_SKIP=skip is not None, num_warps=4,
    )
    return out, out_lse
