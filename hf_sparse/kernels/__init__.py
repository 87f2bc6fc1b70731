"""Op dispatch: Triton kernels on CUDA tensors (or on CPU under ``TRITON_INTERPRET=1``), else the PyTorch reference.

``HF_SPARSE_BACKEND=torch|triton`` overrides the choice.
"""
from __future__ import annotations

import importlib.util
import os

import torch

from . import reference

__all__ = ["backend_for", "block_summaries", "select_blocks", "sparse_attention", "merge_lse", "reference"]

_TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def backend_for(tensor: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"``: the implementation used for ops on ``tensor``."""
    choice = os.environ.get("HF_SPARSE_BACKEND", "").strip().lower()
    if choice not in ("", "torch", "triton"):
        raise ValueError(f"HF_SPARSE_BACKEND must be 'torch' or 'triton', got {choice!r}")
    if choice == "torch":
        return "torch"
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    usable = _TRITON_AVAILABLE and (tensor.is_cuda or interpret) and _triton_ops_present()
    if choice == "triton" and not usable:
        raise RuntimeError(
            "HF_SPARSE_BACKEND=triton needs triton installed and CUDA tensors (or TRITON_INTERPRET=1 on CPU)"
        )
    return "triton" if usable else "torch"


def _triton_ops_present() -> bool:
    return False


def block_summaries(keys, gate_weight, kv_start, block_size, first_block=0, num_blocks=None):
    """See :func:`reference.block_summaries`."""
    return reference.block_summaries(keys, gate_weight, kv_start, block_size, first_block, num_blocks)


def select_blocks(query, summaries, **kwargs):
    """See :func:`reference.select_blocks`."""
    return reference.select_blocks(query, summaries, **kwargs)


def sparse_attention(query, key, value, selection, **kwargs):
    """See :func:`reference.sparse_attention`."""
    return reference.sparse_attention(query, key, value, selection, **kwargs)


def merge_lse(outputs, lses):
    """See :func:`reference.merge_lse`."""
    return reference.merge_lse(outputs, lses)
