"""int8 cache append: new key and value states quantised per token and written into the int8 storage, one launch.

Semantics: :func:`hf_sparse.kernels.reference.quantize_append`. One program per (token, batch x head) loads the
token's key and value, takes ``max|x| / 127`` as its scale, rounds ``x / scale`` to the nearest integer (ties to
even, as ``torch.round``; divisions rounded as IEEE float32, so the result is bit-equal to the reference) and
stores the int8 values (the values token-major or blocked) and both scales. With a device-side start (a static
cache's valid-slot count) the launch reads no host state: a decode step's append captures into a CUDA graph.
With ``clear_to`` the same launch zeroes the scales of the slots from the write's end to it (a fresh storage's,
which the cache allocates uninitialised: one launch per layer instead of three on a prefill bound by the host).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_power_of_2
from ._launch import Launcher

#: 1.5 * 2**23: adding and subtracting it rounds a float32 of magnitude < 2**22 to an integer, ties to even.
_ROUNDER = tl.constexpr(12582912.0)
#: Smallest normal float32: the scale of an all-zero token (as the reference clamps it).
_TINY = tl.constexpr(1.1754943508222875e-38)


@triton.jit
def _quantize_token(x, ok):
    """int8 values and float32 scale of one token's ``x`` (float32, ``ok`` marks the real channels)."""
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.where(ok, tl.abs(x), 0.0), 0), 127.0), _TINY)
    rounded = (tl.math.div_rn(x, scale) + _ROUNDER) - _ROUNDER
    return tl.minimum(tl.maximum(rounded, -127.0), 127.0).to(tl.int8), scale


@triton.jit
def _quantize_append_kernel(
    KEYS, VALUES, K_OUT, V_OUT, K_SCALES, V_SCALES, START,
    stride_xb, stride_xh, stride_xs, stride_xd,
    stride_yb, stride_yh, stride_ys, stride_yd,
    slots, value_slots, start, clear_to,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, D_PAD: tl.constexpr,
    DV_PAD: tl.constexpr, V_BLOCK: tl.constexpr, DEVICE_START: tl.constexpr, CLEAR_RUN: tl.constexpr,
):
    token = tl.program_id(0)  # the long axis: a prefill appends up to the whole prompt
    pid = tl.program_id(1)
    b = (pid // HEADS).to(tl.int64)
    h = (pid % HEADS).to(tl.int64)
    row = pid.to(tl.int64) * slots  # the (batch, head) row's first slot in the contiguous keys and scales
    v_row = pid.to(tl.int64) * value_slots  # and in the values (equal through kernels.quantize_append's checks)
    if DEVICE_START:
        start = tl.load(START).to(tl.int32)
    slot = (start + token).to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < HEAD_DIM_V

    k = tl.load(KEYS + b * stride_xb + h * stride_xh + token * stride_xs + offs_d * stride_xd, mask=d_ok, other=0.0)
    k8, k_scale = _quantize_token(k.to(tl.float32), d_ok)
    tl.store(K_OUT + (row + slot) * HEAD_DIM + offs_d, k8, mask=d_ok)
    tl.store(K_SCALES + row + slot, k_scale)

    v = tl.load(VALUES + b * stride_yb + h * stride_yh + token * stride_ys + offs_dv * stride_yd, mask=dv_ok, other=0.0)
    v8, v_scale = _quantize_token(v.to(tl.float32), dv_ok)
    if V_BLOCK == 0:
        v_out = V_OUT + (v_row + slot) * HEAD_DIM_V + offs_dv
    else:  # blocked values: [.., slot // V_BLOCK, d, slot % V_BLOCK]
        v_out = V_OUT + (v_row + (slot // V_BLOCK) * V_BLOCK) * HEAD_DIM_V + offs_dv * V_BLOCK + slot % V_BLOCK
    tl.store(v_out, v8, mask=dv_ok)
    tl.store(V_SCALES + row + slot, v_scale)

    # Slots [end, clear_to) get zero scales: this program clears every (tokens)-th run of CLEAR_RUN from its own.
    programs = tl.num_programs(0).to(tl.int64)
    offs_c = tl.arange(0, CLEAR_RUN)
    zeros = tl.zeros([CLEAR_RUN], tl.float32)
    for first in range(start + programs + token.to(tl.int64) * CLEAR_RUN, clear_to, programs * CLEAR_RUN):
        at = first + offs_c
        tl.store(K_SCALES + row + at, zeros, mask=at < clear_to)
        tl.store(V_SCALES + row + at, zeros, mask=at < clear_to)


#: The kernel's launches (:class:`hf_sparse.kernels._launch.Launcher`).
_LAUNCH = Launcher(_quantize_append_kernel)


def quantize_append(key_states: torch.Tensor, value_states: torch.Tensor, key_storage: torch.Tensor,
                    value_storage: torch.Tensor, key_scales: torch.Tensor, value_scales: torch.Tensor,
                    start: int | torch.Tensor, clear_to: int = 0) -> None:
    """Triton version of :func:`hf_sparse.kernels.reference.quantize_append` (same arguments, same bits)."""
    batch, heads, tokens, head_dim = key_states.shape
    head_dim_v = value_states.shape[-1]
    if batch * heads * tokens == 0:  # nothing to write; the tail to clear starts at start
        if clear_to:
            key_scales[:, :, start:clear_to] = 0
            value_scales[:, :, start:clear_to] = 0
        return
    if batch * heads > 65535:  # the grid's second axis
        raise ValueError(f"quantize_append takes at most 65535 (batch x heads) rows, got {batch} x {heads}")
    value_block = value_storage.shape[4] if value_storage.dim() == 5 else 0
    device_start = isinstance(start, torch.Tensor)
    # The storages are contiguous (check_append_inputs): offsets from their shapes, fewer arguments to launch with;
    # and a repeated specialisation launches its compiled kernel directly (a short prefill is bound by the host).
    _LAUNCH(
        (tokens, batch * heads),
        (key_states, value_states, key_storage, value_storage, key_scales, value_scales,
         start if device_start else key_scales, *key_states.stride(), *value_states.stride(), key_storage.shape[2],
         value_storage.shape[2] * value_block if value_block else value_storage.shape[2],
         0 if device_start else int(start), int(clear_to)),
        dict(HEADS=heads, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, D_PAD=max(16, next_power_of_2(head_dim)),
             DV_PAD=max(16, next_power_of_2(head_dim_v)), V_BLOCK=value_block, DEVICE_START=device_start,
             CLEAR_RUN=128),
        num_warps=1,
    )
