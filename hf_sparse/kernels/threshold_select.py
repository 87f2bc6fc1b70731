"""XAttention's cumulative-mass threshold selection: one bisection on the mass cut per row, no sort.

Semantics: ``reference.cumulative_threshold_select``, bit for bit. Each program takes ``ROWS`` rows whole
(``BLOCK_N`` >= the row's blocks, in registers), turns the masses into the reference's fixed-point integers
and finds the cut without sorting. With ``F(v) = kept + sum of the candidates' units above v`` (candidates:
available, not forced), ``F`` falls as ``v`` grows, and the reference keeps a candidate exactly when the mass
kept before it, ``F(units) + units x (equal candidates of lower id)``, is below ``required``. So with
``v* = min{v >= 0 : F(v) < required}``, found by ``MASS_BITS + 1`` bisection steps (one masked row sum each),
every candidate above ``v*`` is kept, every one below it is not, and of those equal to ``v*`` the first by
block id while ``F(v*) + rank x v* < required``. Integer sums are exact in any order, so the reduction order
of the sums does not matter.
"""
from __future__ import annotations

import struct
import sys

import torch
import triton
import triton.language as tl

from .reference import MASS_BITS

# Widest row the kernel holds in registers (1M tokens at block 128); wider rows go to the reference.
MAX_BLOCKS = 8192
# Row elements per program: short rows share a program, so small problems do not launch one per row.
_ELEMENTS = 2048


@triton.jit
def _threshold_select_kernel(
    MASS, AVAILABLE, FORCED, OUT,
    stride_m0, stride_m1, stride_m2, stride_mn,
    stride_a0, stride_a1, stride_a2, stride_an,
    stride_f0, stride_f1, stride_f2, stride_fn,
    num_rows, dim1, dim2, num_blocks, threshold_bits,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, MASS_BITS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    rows = rows.to(tl.int64)
    i0 = rows // (dim1 * dim2)
    i1 = (rows // dim2) % dim1
    i2 = rows % dim2
    cols = tl.arange(0, BLOCK_N).to(tl.int64)
    in_row = row_ok[:, None] & (cols < num_blocks)[None, :]
    a_ptr = AVAILABLE + (i0 * stride_a0 + i1 * stride_a1 + i2 * stride_a2)[:, None] + cols[None, :] * stride_an
    f_ptr = FORCED + (i0 * stride_f0 + i1 * stride_f1 + i2 * stride_f2)[:, None] + cols[None, :] * stride_fn
    m_ptr = MASS + (i0 * stride_m0 + i1 * stride_m1 + i2 * stride_m2)[:, None] + cols[None, :] * stride_mn
    available = tl.load(a_ptr, mask=in_row, other=0) != 0
    forced = (tl.load(f_ptr, mask=in_row, other=0) != 0) & available
    candidate = available & ~forced
    mass = tl.maximum(tl.load(m_ptr, mask=available, other=0.0).to(tl.float32), 0.0)

    # Fixed point as the reference: units = floor(mass * 2**(MASS_BITS - e)), row max < 2**e, e >= -126
    # (the biased exponent of the max, at least 1, minus 126); the power of two is built from its bits.
    row_max = tl.max(mass, 1)
    exponent = tl.maximum((row_max.to(tl.int32, bitcast=True) >> 23) & 0xFF, 1) - 126
    scale = ((MASS_BITS - exponent + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True)
    units = (mass.to(tl.float64) * scale[:, None]).to(tl.int64)
    required = threshold_bits.to(tl.float64, bitcast=True) * tl.sum(units, 1).to(tl.float64)
    kept = tl.sum(tl.where(forced, units, 0), 1)
    candidate_units = tl.where(candidate, units, -1)

    # Bisection for v*: F(v) < required for v = high (else no v qualifies: F(2**MASS_BITS) = kept, and high
    # stays above every unit), F(v) >= required for every v <= low.
    low = tl.full([ROWS], -1, tl.int64)
    high = tl.full([ROWS], 1 << MASS_BITS, tl.int64)
    for _ in range(MASS_BITS + 1):
        mid = (low + high) >> 1
        above = kept + tl.sum(tl.where(candidate_units > mid[:, None], candidate_units, 0), 1)
        active = high - low > 1
        below = above.to(tl.float64) < required
        high = tl.where(active & below, mid, high)
        low = tl.where(active & ~below, mid, low)

    cut = high
    kept_above = kept + tl.sum(tl.where(candidate_units > cut[:, None], candidate_units, 0), 1)
    at_cut = candidate_units == cut[:, None]
    rank = (tl.cumsum(at_cut.to(tl.int32), 1) - at_cut.to(tl.int32)).to(tl.int64)  # equal ones of lower id
    before = kept_above[:, None] + rank * cut[:, None]
    take = (candidate_units > cut[:, None]) | (at_cut & (before.to(tl.float64) < required[:, None]))
    chosen = forced | take
    tl.store(OUT + rows[:, None] * num_blocks + cols[None, :], chosen.to(tl.uint8), mask=in_row)


def _as_rank4(tensor: torch.Tensor) -> torch.Tensor:
    """``[D0, D1, D2, nb]`` view (leading unit dims added; beyond three leading dims, merged, which may copy)."""
    if tensor.dim() > 4:
        return tensor.reshape(-1, *tensor.shape[-3:])
    return tensor.view((1,) * (4 - tensor.dim()) + tuple(tensor.shape))


def cumulative_threshold_select(
    mass: torch.Tensor, available: torch.Tensor, forced: torch.Tensor, threshold: float
) -> torch.Tensor:
    """Triton version of :func:`hf_sparse.kernels.reference.cumulative_threshold_select` (same result)."""
    if mass.dim() < 1 or mass.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"mass must be a float32/float16/bfloat16 [..., nb] tensor, got {mass.dtype} "
                        f"{tuple(mass.shape)}")
    if available.dtype != torch.bool or forced.dtype != torch.bool:
        raise TypeError(f"available and forced must be boolean, got {available.dtype} and {forced.dtype}")
    if not (mass.device == available.device == forced.device):
        raise ValueError("mass, available and forced must be on one device")
    if not threshold >= sys.float_info.min:  # a normal positive float (its bits then pass as an int64)
        raise ValueError(f"threshold must be > 0, got {threshold}")
    num_blocks = mass.shape[-1]
    if num_blocks > MAX_BLOCKS:
        raise ValueError(f"{num_blocks} blocks exceed the kernel's {MAX_BLOCKS}; use the reference")
    available = available.expand(mass.shape)  # raises if not broadcastable
    forced = forced.expand(mass.shape)
    if threshold >= 1.0:  # every available block, zero-mass ones included (as the reference)
        return available.clone()
    out = torch.empty(mass.shape, dtype=torch.bool, device=mass.device)
    if out.numel() == 0:
        return out
    mass4, available4, forced4 = (_as_rank4(t) for t in (mass, available, forced))
    dim0, dim1, dim2 = mass4.shape[:3]
    num_rows = dim0 * dim1 * dim2
    threshold_bits = struct.unpack("<q", struct.pack("<d", float(threshold)))[0]  # exact float64, as an int64
    block_n = max(16, triton.next_power_of_2(num_blocks))
    rows = max(1, _ELEMENTS // block_n)
    _threshold_select_kernel[(triton.cdiv(num_rows, rows),)](
        mass4, available4.view(torch.uint8), forced4.view(torch.uint8), out.view(torch.uint8),
        *mass4.stride(), *available4.stride(), *forced4.stride(),
        num_rows, dim1, dim2, num_blocks, threshold_bits,
        ROWS=rows, BLOCK_N=block_n, MASS_BITS=MASS_BITS, num_warps=max(4, rows * block_n // 512),
    )
    return out
