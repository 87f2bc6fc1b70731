"""Op dispatch: Triton kernels on CUDA tensors (or on CPU under ``TRITON_INTERPRET=1``), else the PyTorch reference.

``HF_SPARSE_BACKEND=torch|triton`` overrides the choice.
"""
from __future__ import annotations

import importlib.util
import logging
import os

import torch

from ..selection import row_starts
from . import reference
from ._common import check_append_inputs, check_append_kv_inputs, check_decode_linear_inputs

__all__ = [
    "antidiagonal_block_scores", "append_kv", "backend_for", "block_summaries", "cumulative_threshold_select",
    "decode_linear", "merge_lse", "pooled_block_logits", "quantize_append", "recent_block_summaries", "reference", "select_blocks",
    "sparse_attention",
]

_TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None
_TRITON_OPS = None
if _TRITON_AVAILABLE:
    # Imported here, before the public functions below are defined: the op modules share their names, and the
    # definitions below must be what `kernels.<name>` means. Triton decides at import whether it interprets
    # (TRITON_INTERPRET=1), as it does for its own library. Without triton, or with a broken one, the PyTorch
    # reference serves every op.
    try:
        from . import append_kv as _append_kv_op
        from . import block_logits as _block_logits_op
        from . import block_summaries as _summaries_op
        from . import decode_linear as _decode_linear_op
        from . import merge_lse as _merge_op
        from . import quantize_append as _append_op
        from . import select_blocks as _select_op
        from . import sparse_decode as _decode_op
        from . import sparse_prefill as _prefill_op
        from . import threshold_select as _threshold_op
        from . import xattn_scores as _xattn_op

        _TRITON_OPS = (_summaries_op, _select_op, _prefill_op, _decode_op, _merge_op, _xattn_op, _threshold_op,
                       _append_op, _block_logits_op, _append_kv_op, _decode_linear_op)
    except Exception as error:  # noqa: BLE001 - any failure to import means "use the reference"
        logging.getLogger(__name__).warning("hf_sparse Triton kernels unavailable (%s); using the PyTorch reference", error)


def _environment_value(name: str) -> str:
    """``os.environ.get(name, "")`` in one dict lookup where CPython's mapping allows it: its own lookup encodes the
    key in Python (microseconds), and the backend is asked by every layer of every forward."""
    key = _ENCODED_NAMES.get(name)
    data = getattr(os.environ, "_data", None)
    if key is None or not isinstance(data, dict):
        return os.environ.get(name, "")
    raw = data.get(key)
    return "" if raw is None else os.environ.decodevalue(raw)


#: The variables backend_for reads, in os.environ's key encoding (where it has one).
_ENCODED_NAMES = ({name: os.environ.encodekey(name) for name in ("HF_SPARSE_BACKEND", "TRITON_INTERPRET")}
                  if hasattr(os.environ, "encodekey") and hasattr(os.environ, "decodevalue") else {})


def backend_for(tensor: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"``: the implementation used for ops on ``tensor``."""
    choice = _environment_value("HF_SPARSE_BACKEND")
    if choice:
        choice = choice.strip().lower()
    if choice not in ("", "torch", "triton"):
        raise ValueError(f"HF_SPARSE_BACKEND must be 'torch' or 'triton', got {choice!r}")
    if choice == "torch":
        return "torch"
    interpret = _environment_value("TRITON_INTERPRET") == "1"
    usable = _TRITON_AVAILABLE and (tensor.is_cuda or interpret) and _triton_ops_present()
    if choice == "triton" and not usable:
        raise RuntimeError(
            "HF_SPARSE_BACKEND=triton needs triton installed and CUDA tensors (or TRITON_INTERPRET=1 on CPU)"
        )
    return "triton" if usable else "torch"


def _triton_ops_present() -> bool:
    """Whether the Triton op modules imported (triton installed and usable)."""
    return _TRITON_OPS is not None


#: Whether this process sees more than one CUDA device (asked once, at the first launch).
_SEVERAL_DEVICES: list[bool] = []


def _on_device(op, tensor: torch.Tensor, *args, **kwargs):
    """``op(tensor, *args, **kwargs)`` with ``tensor``'s CUDA device current: Triton launches on the current device,
    and a model whose layers sit on several GPUs (``device_map``) calls the ops of a layer on cuda:1 while cuda:0
    is current. One process-wide check on a single-GPU machine."""
    if not _SEVERAL_DEVICES:
        _SEVERAL_DEVICES.append(torch.cuda.is_available() and torch.cuda.device_count() > 1)
    if _SEVERAL_DEVICES[0] and tensor.is_cuda and tensor.device.index != torch.cuda.current_device():
        with torch.cuda.device(tensor.device):
            return op(tensor, *args, **kwargs)
    return op(tensor, *args, **kwargs)


def block_summaries(keys, gate_weight, kv_start, block_size, first_block=0, num_blocks=None, *, out=None,
                    key_scale=None, dtype=None):
    """See :func:`reference.block_summaries`; ``out`` (float32, the result's shape, any strides) receives the
    result in place when given. int8 ``keys`` come with their per-token ``key_scale`` and are dequantised to
    ``dtype`` (in registers on Triton; the PyTorch path dequantises only the slots the blocks cover)."""
    if backend_for(keys) == "triton":
        return _on_device(_TRITON_OPS[0].block_summaries, keys, gate_weight, kv_start, block_size, first_block,
                          num_blocks, out=out, key_scale=key_scale, dtype=dtype)
    result = _reference_summaries(keys, gate_weight, kv_start, block_size, first_block, num_blocks, key_scale, dtype)
    return result if out is None else out.copy_(result)


def recent_block_summaries(keys, gate_weight, kv_start, block_size, length, recent, out, key_scale=None, dtype=None):
    """Rewrite in ``out`` the summaries of the row blocks holding the last ``recent`` of ``length`` (a
    one-element device tensor) valid slots of ``keys`` (a static cache's storage; int8 with ``key_scale``,
    dequantised to ``dtype``); see :func:`reference.block_summaries`. The Triton op reads ``length`` on the
    device (CUDA-graph safe)."""
    if backend_for(keys) == "triton":
        return _on_device(_TRITON_OPS[0].recent_block_summaries, keys, gate_weight, kv_start, block_size, length,
                          recent, out, key_scale=key_scale, dtype=dtype)
    valid = int(length)
    keys = keys[:, :, :valid]
    key_scale = key_scale[:, :, :valid] if key_scale is not None else None
    first = max(0, valid - recent - reference.kv_start_range(kv_start)[1]) // block_size
    blocks = _reference_summaries(keys, gate_weight, kv_start, block_size, first, None, key_scale, dtype)
    out[:, :, first:first + blocks.shape[2]] = blocks
    return out


def _reference_summaries(keys, gate_weight, kv_start, block_size, first_block, num_blocks, key_scale, dtype):
    """:func:`reference.block_summaries`, int8 keys dequantised over the slots of the blocks only (from the least
    padded row's first one to the most padded row's last)."""
    if key_scale is None:
        return reference.block_summaries(keys, gate_weight, kv_start, block_size, first_block, num_blocks)
    length = keys.shape[2]
    if num_blocks is None:
        num_blocks = reference.num_row_blocks(length, kv_start, block_size) - first_block
    fewest, most = reference.kv_start_range(kv_start)
    kv_start = row_starts(kv_start).to(keys.device)
    low = min(length, fewest + first_block * block_size)
    high = min(length, most + (first_block + num_blocks) * block_size)
    window = reference.dequantize_per_token(keys[:, :, low:high], key_scale[:, :, low:high]).to(dtype)
    # Row b's block first_block + j starts at window slot kv_start[b] - low + (first_block + j) * block_size.
    return reference.block_summaries(window, gate_weight, kv_start - low + first_block * block_size, block_size, 0,
                                     num_blocks)


def _host_length(kwargs: dict, num_queries: int) -> dict:
    """The reference's form of a call given a device-side ``length``: host ``key_length`` and ``q_offset``."""
    length = kwargs.pop("length", None)
    if length is not None:
        kwargs["key_length"] = int(length)
        kwargs["q_offset"] = kwargs["key_length"] - num_queries
    return kwargs


def select_blocks(query, summaries, **kwargs):
    """See :func:`reference.select_blocks`; ``length`` (decode, Triton) as in the Triton op."""
    if backend_for(query) == "triton":
        return _on_device(_TRITON_OPS[1].select_blocks, query, summaries, **kwargs)
    return reference.select_blocks(query, summaries, **_host_length(kwargs, query.shape[2]))


def select_blocks_from_logits(logits, **kwargs):
    """See :func:`reference.select_blocks_from_logits`."""
    if backend_for(logits) == "triton":
        return _on_device(_TRITON_OPS[1].select_blocks_from_logits, logits, **kwargs)
    return reference.select_blocks_from_logits(logits, **kwargs)


def sparse_attention(query, key, value, selection, **kwargs):
    """See :func:`reference.sparse_attention`. On Triton, a selection with one query tile over at most 16
    queries (decode, assisted/speculative decoding) runs the split decode kernel, anything else the prefill
    kernel. ``length`` (a one-element device tensor: valid key slots, ``key`` / ``value`` being a static
    cache's storage) is taken by the decode kernel."""
    if backend_for(query) == "triton":
        prefill_op, decode_op = _TRITON_OPS[2], _TRITON_OPS[3]
        if selection.num_query_tiles == 1 and query.shape[2] <= decode_op.MAX_DECODE_QUERIES:
            return _on_device(decode_op.sparse_decode, query, key, value, selection, **kwargs)
        if kwargs.get("length") is not None:
            raise ValueError("a device-side length is for decode calls (one query tile, at most "
                             f"{decode_op.MAX_DECODE_QUERIES} queries)")
        return _on_device(prefill_op.sparse_prefill, query, key, value, selection, **kwargs)
    kwargs = _host_length(kwargs, query.shape[2])
    if "key_length" in kwargs:
        valid = kwargs.pop("key_length")
        key, value = key[:, :, :valid], reference.leading_values(value, valid)
        for name in ("key_scale", "value_scale"):
            if kwargs.get(name) is not None:
                kwargs[name] = kwargs[name][:, :, :valid]
    return reference.sparse_attention(query, key, value, selection, **kwargs)


def merge_lse(outputs, lses):
    """See :func:`reference.merge_lse`."""
    if backend_for(outputs) == "triton":
        return _on_device(_TRITON_OPS[4].merge_lse, outputs, lses)
    return reference.merge_lse(outputs, lses)


def antidiagonal_block_scores(query, key, **kwargs):
    """See :func:`reference.antidiagonal_block_scores`."""
    if backend_for(query) == "triton":
        return _on_device(_TRITON_OPS[5].antidiagonal_block_scores, query, key, **kwargs)
    return reference.antidiagonal_block_scores(query, key, **kwargs)


def cumulative_threshold_select(mass, available, forced, threshold):
    """See :func:`reference.cumulative_threshold_select`. Rows wider than the kernel's ``MAX_BLOCKS`` run the
    reference (same result)."""
    if backend_for(mass) == "triton" and mass.shape[-1] <= _TRITON_OPS[6].MAX_BLOCKS:
        return _on_device(_TRITON_OPS[6].cumulative_threshold_select, mass, available, forced, threshold)
    return reference.cumulative_threshold_select(mass, available, forced, threshold)


def append_kv(key_states, value_states, key_storage, value_storage, length, starts=None, counts=None, block_size=0):
    """See :func:`reference.append_kv` (a static cache's writes at its device-side length, and optionally each
    row's valid block count; one launch on Triton)."""
    args = (key_states, value_states, key_storage, value_storage, length, starts, counts, block_size)
    check_append_kv_inputs(*args)
    if backend_for(key_states) == "triton":
        return _on_device(_TRITON_OPS[9].append_kv, *args)
    return reference.append_kv(*args)


def decode_linear(x, weights, biases, norm_weight=None, eps=0.0, residual=None, gated=False, rotary=None):
    """See :func:`reference.decode_linear` (a decode step's linear layers of one input, with the norm before and
    the rotary embedding, gated product or residual add after; one launch on Triton)."""
    weights, biases = tuple(weights), tuple(biases)
    check_decode_linear_inputs(x, weights, biases, norm_weight, residual, gated, rotary)
    if backend_for(x) == "triton":
        return _on_device(_TRITON_OPS[10].decode_linear, x, weights, biases, norm_weight, eps, residual, gated, rotary)
    return reference.decode_linear(x, weights, biases, norm_weight, eps, residual, gated, rotary)


def quantize_append(key_states, value_states, key_storage, value_storage, key_scales, value_scales, start,
                    clear_to=0):
    """See :func:`reference.quantize_append` (the int8 cache's writes, and the zeroing of a fresh storage's
    scales past them; one launch on Triton)."""
    args = (key_states, value_states, key_storage, value_storage, key_scales, value_scales, start, clear_to)
    check_append_inputs(*args)
    if backend_for(key_states) == "triton":
        return _on_device(_TRITON_OPS[7].quantize_append, *args)
    return reference.quantize_append(*args)


def pooled_block_logits(query, key, block_size, scale, q_offset=0, pool="max"):
    """See :func:`reference.pooled_block_logits` (gate distillation's targets; no logit matrix on Triton)."""
    if backend_for(query) == "triton":
        return _on_device(_TRITON_OPS[8].pooled_block_logits, query, key, block_size, scale, q_offset, pool)
    return reference.pooled_block_logits(query, key, block_size, scale, q_offset, pool)
