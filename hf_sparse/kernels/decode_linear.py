"""The weight products of one decode step of a Llama-style layer, one launch each: up to three linear layers that
read one input (queries, keys and values), optionally after an RMSNorm of that input, and in the epilogue the
rotary embedding of the first two (queries and keys), a gated product (``silu(gate) * up``) or a residual add.

Semantics: :func:`hf_sparse.kernels.reference.decode_linear` (transformers' eager ops, rounding for rounding). A
CUDA-graph decode step of a small model is bound by its kernel count, not its bytes: at batch 1 each of a layer's
seven weight products is a cuBLAS launch of a few microseconds whatever its size, and the norms, the residual adds
and the activation are launches of their own. Here a program computes ``BLOCK_N`` output columns of one of the
weights for every input row (rows padded to ``BLOCK_M``): the norm's statistics are recomputed by each program
from the input (a few KiB), the weight tile is streamed over ``K`` in ``BLOCK_K`` steps, and the epilogue rounds to
the output dtype exactly where the eager ops do (the product, the activation, the gated product, the residual sum,
the rotary embedding's two products and their sum). The rotary embedding needs each column's partner in the
other half of its head (``rotate_half``): a rotating program also accumulates the partner columns' products
(twice the weight reads of the queries and keys, which are a few hundred KiB).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import dependent_launch_args, dot_settings, next_power_of_2


@triton.jit
def _decode_linear_kernel(
    X, NORM_W, W0, W1, W2, B0, B1, B2, RES, OUT, COS, SIN,
    rows, K, N0, N1, N2, T0, T1,
    stride_xm, stride_rm, stride_om, eps,
    steps, rot_dim, stride_cb, stride_cs, stride_sb, stride_ss,
    HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, GATED: tl.constexpr,
    ROTARY: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # programmatic dependent launch: the kernel before is done first, the one after may launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    # Which weight this program's columns belong to (a gated call reads W0 and W1 on the same columns).
    if pid < T0:
        w_ptr, b_ptr, n_size, col0, tile = W0, B0, N0, N0 * 0, pid
    elif pid < T0 + T1:
        w_ptr, b_ptr, n_size, col0, tile = W1, B1, N1, N0, pid - T0
    else:
        w_ptr, b_ptr, n_size, col0, tile = W2, B2, N2, N0 + N1, pid - T0 - T1
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < rows
    n_ok = offs_n < n_size
    dtype = OUT.dtype.element_ty
    if HAS_NORM:
        squares = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + offs_k) < K
            x = tl.load(X + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            squares += tl.sum(x * x, axis=1)
        rstd = 1.0 / tl.sqrt(squares / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if ROTARY:
        # rotate_half's partner of each column within its head: the other half, negated for the first half
        half = rot_dim // 2
        in_head = offs_n % rot_dim
        partner = tl.where(in_head < half, offs_n + half, offs_n - half)
        acc_partner = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        x = tl.load(X + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        if HAS_NORM:
            # RMSNorm as transformers computes it: normalised in float32, rounded, times the weight, rounded
            scale = tl.load(NORM_W + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)
            x = (scale[None, :] * x).to(dtype)
        w_mask = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_ptr + offs_n[:, None] * K + (k0 + offs_k)[None, :], mask=w_mask, other=0.0)
        if DOT_FP32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        if GATED:
            w_up = tl.load(W1 + offs_n[:, None] * K + (k0 + offs_k)[None, :], mask=w_mask, other=0.0)
            if DOT_FP32:
                w_up = w_up.to(tl.float32)
            acc_up = tl.dot(x, tl.trans(w_up), acc_up, input_precision=PRECISION)
        if ROTARY:
            w_partner = tl.load(w_ptr + partner[:, None] * K + (k0 + offs_k)[None, :], mask=w_mask, other=0.0)
            if DOT_FP32:
                w_partner = w_partner.to(tl.float32)
            acc_partner = tl.dot(x, tl.trans(w_partner), acc_partner, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(B1 + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if ROTARY:
            acc_partner += tl.load(b_ptr + partner, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = acc.to(dtype)
    if ROTARY:
        if pid < T0 + T1:  # the queries' and keys' columns: apply_rotary_pos_emb, rounded as its bf16 ops
            b = (offs_m // steps).to(tl.int64)
            s = (offs_m % steps).to(tl.int64)
            cs_mask = m_ok[:, None] & n_ok[None, :]
            cos = tl.load(COS + (b * stride_cb + s * stride_cs)[:, None] + in_head[None, :], mask=cs_mask, other=0.0)
            sin = tl.load(SIN + (b * stride_sb + s * stride_ss)[:, None] + in_head[None, :], mask=cs_mask, other=0.0)
            sign = tl.where(in_head < half, -1.0, 1.0)
            rotated = (acc_partner.to(dtype).to(tl.float32) * sign[None, :] * sin.to(tl.float32)).to(dtype)
            y = ((y.to(tl.float32) * cos.to(tl.float32)).to(dtype).to(tl.float32) + rotated.to(tl.float32)).to(dtype)
    if GATED:
        gate = y.to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype)  # silu, rounded as torch's
        y = (act.to(tl.float32) * acc_up.to(dtype).to(tl.float32)).to(dtype)
    out_mask = m_ok[:, None] & n_ok[None, :]
    if HAS_RES:
        residual = tl.load(RES + offs_m[:, None] * stride_rm + offs_n[None, :], mask=out_mask, other=0.0)
        y = (residual.to(tl.float32) + y.to(tl.float32)).to(dtype)
    tl.store(OUT + offs_m[:, None] * stride_om + (col0 + offs_n)[None, :], y, mask=out_mask)


#: Launch settings (output columns per program, reduction step, warps, stages): the fastest of a sweep on the H100
#: in CUDA graphs (SmolLM2's shapes: 576 -> 576 + 192 + 192 with the norm, 576 -> 576 and 1536 -> 576 with the
#: residual, batch 1 and 8; docs/kernels.md); the gated product reads two weight tiles per step.
TUNING = {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}
TUNING_GATED = {"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}


def decode_linear(x: torch.Tensor, weights: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor | None, ...],
                  norm_weight: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
                  gated: bool = False, rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Triton version of :func:`hf_sparse.kernels.reference.decode_linear` (same arguments, same result up to the
    products' summation order)."""
    rows, k = x.shape
    sizes = [w.shape[0] for w in weights]
    tuning = TUNING_GATED if gated else TUNING
    block_n, block_k = tuning["BLOCK_N"], min(tuning["BLOCK_K"], max(16, next_power_of_2(k)))
    block_m = max(16, next_power_of_2(rows))
    # Shared memory per pipeline stage: the input tile and one weight tile per accumulator (two for a gated or
    # rotating call); a float32 call of many rows halves the step until the stages fit (H100: 227 KiB)
    tiles = 2 if gated or rotary is not None else 1
    while tuning["num_stages"] * (block_m + tiles * block_n) * block_k * x.element_size() > 160 * 1024 and block_k > 32:
        block_k //= 2
    dot_fp32, precision = dot_settings(x.dtype)
    out = torch.empty(rows, sizes[0] if gated else sum(sizes), device=x.device, dtype=x.dtype)
    tiles = [triton.cdiv(n, block_n) for n in sizes]
    padded = list(weights) + [weights[0]] * (3 - len(weights))
    padded_sizes = sizes + [0] * (3 - len(sizes))
    has_bias = biases[0] is not None
    padded_biases = [b if b is not None else x for b in biases] + [x] * (3 - len(biases))
    grid = (tiles[0],) if gated else (sum(tiles),)
    t0 = tiles[0]
    t1 = 0 if gated else (tiles[1] if len(tiles) > 1 else 0)
    cos, sin = rotary if rotary is not None else (x, x)
    steps = cos.shape[1] if rotary is not None else 1
    _decode_linear_kernel[grid](
        x, norm_weight if norm_weight is not None else x, *padded, *padded_biases,
        residual if residual is not None else x, out, cos, sin,
        rows, k, *padded_sizes, t0, t1,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), float(eps),
        steps, cos.shape[-1], cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1) if rotary is not None else 0,
        sin.stride(0) if sin.shape[0] > 1 else 0, sin.stride(1) if rotary is not None else 0,
        HAS_NORM=norm_weight is not None, HAS_BIAS=has_bias, HAS_RES=residual is not None, GATED=gated,
        ROTARY=rotary is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_FP32=dot_fp32, PRECISION=precision,
        num_warps=tuning["num_warps"], num_stages=tuning["num_stages"], **dependent_launch_args(x.device),
    )
    return out
