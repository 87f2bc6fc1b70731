"""Each query's attention logits pooled per key block: the targets of PLAS gate distillation.

Semantics: ``reference.pooled_block_logits`` (``pool="max"``: the block's largest logit; ``pool="sum"``: the log of
its summed exponentials, i.e. the block's attention mass up to the row's normaliser). One program per (query tile,
batch x query head): the tile's queries stay in registers while it walks the key blocks up to the tile's last
causal one, ``BLOCK_N`` keys at a time (one GEMM on the tensor cores: half-precision operands are exact in the
float32 accumulator), masks the keys past each query's slot and keeps the running maximum (and, for "sum", the
running sum of exponentials relative to it); each block's column is written once. No logit matrix is written: the
output is ``block_size`` times smaller than the logits. The launcher fills the output with ``-inf`` first, so the
blocks past a tile's last causal block need no program work.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import SUPPORTED_DTYPES, dot_settings

# Launch setting: 64 queries x 64 keys per GEMM (32 keys for float32 operands, whose tf32x3 products take more
# shared memory), 4 warps, 2 stages; head dims up to 256.
_BLOCK_M = 64
_BLOCK_N = 64
_BLOCK_N_FP32 = 32
_WARPS = 4
_STAGES = 2
POOLS = ("max", "sum")


@triton.jit
def _pooled_kernel(Q, K, OUT, SLOTS, stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_ks,
                   stride_kd, stride_ob, stride_oh, stride_os, stride_on, num_queries, key_length, q_offset, scale,
                   Q_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUM: tl.constexpr,
                   DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, HAS_SLOTS: tl.constexpr):
    tile = tl.program_id(0)
    batch_head = tl.program_id(1)
    b = (batch_head // Q_HEADS).to(tl.int64)  # 64-bit offsets: batch x heads x queries x blocks may pass 2^31
    h = (batch_head % Q_HEADS).to(tl.int64)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row_ok = offs_m < num_queries
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    if HAS_SLOTS:  # each query's own slot (any order)
        slot_of_row = tl.load(SLOTS + offs_m, mask=row_ok, other=0)
        last_slot = tl.minimum(tl.max(tl.where(row_ok, slot_of_row, 0), 0), key_length - 1)
    else:
        slot_of_row = q_offset + offs_m
        last_slot = tl.minimum(q_offset + tl.minimum(tile * BLOCK_M + BLOCK_M, num_queries) - 1, key_length - 1)
    end_block = last_slot // BLOCK_SIZE + 1
    k_base = K + b * stride_kb + (h // GROUP) * stride_kh
    out_base = OUT + b * stride_ob + h * stride_oh + offs_m * stride_os
    for block in range(0, end_block):
        best = tl.full([BLOCK_M], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        for part in tl.static_range(BLOCK_SIZE // BLOCK_N):
            slots = block * BLOCK_SIZE + part * BLOCK_N + offs_n
            k = tl.load(k_base + slots[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                        mask=(slots < key_length)[:, None] & d_ok[None, :], other=0.0)
            if DOT_FP32:
                scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION)
            else:
                scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            visible = (slots[None, :] <= slot_of_row[:, None]) & (slots < key_length)[None, :]
            scores = tl.where(visible, scores * scale, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, 1))
            if SUM:
                safe = tl.where(new_best == float("-inf"), 0.0, new_best)
                total = total * tl.exp(best - safe) + tl.sum(tl.exp(scores - safe[:, None]), 1)
            best = new_best
        if SUM:
            best = tl.where(best == float("-inf"), best, best + tl.log(tl.where(total > 0, total, 1.0)))
        tl.store(out_base + block * stride_on, best, mask=row_ok)


def pooled_block_logits(query: torch.Tensor, key: torch.Tensor, block_size: int, scale: float,
                        q_offset: int | torch.Tensor = 0, pool: str = "max") -> torch.Tensor:
    """Triton version of :func:`hf_sparse.kernels.reference.pooled_block_logits` (float32 output); ``q_offset`` a
    ``[Sq]`` integer tensor gives each query's slot (range-checked on the CPU only: on the GPU that would read it
    back to the host; a negative slot there sees no key)."""
    if query.dim() != 4 or key.dim() != 4 or query.shape[0] != key.shape[0] or key.shape[1] == 0 \
            or query.shape[1] % key.shape[1]:
        raise ValueError(f"need BNSD query [B,Hq,Sq,D] and key [B,Hkv,Skv,D] with Hq a multiple of Hkv; got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}")
    if query.shape[-1] != key.shape[-1] or query.dtype != key.dtype or query.device != key.device:
        raise ValueError("query and key must share head dim, dtype and device")
    if query.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype {query.dtype} unsupported: use float16, bfloat16 or float32")
    if query.shape[-1] > 256:
        raise ValueError("head dims above 256 are not supported by the Triton kernels; set HF_SPARSE_BACKEND=torch")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    slots = None
    if isinstance(q_offset, torch.Tensor):
        if q_offset.shape != (query.shape[2],) or q_offset.is_floating_point():
            raise ValueError(f"q_offset as a tensor must be [Sq={query.shape[2]}] integer slots, got "
                             f"{tuple(q_offset.shape)} {q_offset.dtype}")
        if q_offset.device.type == "cpu" and q_offset.numel() and int(q_offset.min()) < 0:  # (on the GPU: no sync)
            raise ValueError("q_offset slots must be >= 0")
        slots = q_offset.to(device=query.device, dtype=torch.int32).contiguous()
        q_offset = 0
    elif q_offset < 0:
        raise ValueError(f"q_offset must be >= 0, got {q_offset}")
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
    batch, q_heads, num_queries, dim = query.shape
    key_length = key.shape[2]
    num_blocks = -(-key_length // block_size)
    out = torch.full((batch, q_heads, num_queries, num_blocks), float("-inf"), dtype=torch.float32,
                     device=query.device)
    if num_queries == 0 or key_length == 0:
        return out
    dot_fp32, precision = dot_settings(query.dtype)
    block_n = min(_BLOCK_N_FP32 if query.dtype == torch.float32 else _BLOCK_N, block_size)
    grid = (triton.cdiv(num_queries, _BLOCK_M), batch * q_heads)
    _pooled_kernel[grid](
        query, key, out, slots if slots is not None else out, *query.stride(), *key.stride(), *out.stride(),
        num_queries, key_length, q_offset,
        float(scale), Q_HEADS=q_heads, GROUP=q_heads // key.shape[1], HEAD_DIM=dim,
        BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_SIZE=block_size, BLOCK_M=_BLOCK_M, BLOCK_N=block_n,
        SUM=pool == "sum", DOT_FP32=dot_fp32, PRECISION=precision, HAS_SLOTS=slots is not None, num_warps=_WARPS,
        num_stages=_STAGES)
    return out
