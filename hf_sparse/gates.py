"""PLAS gate weights: the per-layer ``[kv_heads, block_size, head_dim]`` weights that compress key blocks."""
from __future__ import annotations

import torch

_GATE_ATTR = "_hf_sparse_gate_weight"


def get_gate_weight(module: torch.nn.Module) -> torch.Tensor | None:
    """The gate weight attached to an attention module, or ``None`` (mean pooling)."""
    return module.__dict__.get(_GATE_ATTR)


def set_gate_weight(module: torch.nn.Module, weight: torch.Tensor | None) -> None:
    """Attach (or with ``None`` remove) a gate weight; kept outside the module's state dict."""
    if weight is None:
        module.__dict__.pop(_GATE_ATTR, None)
    else:
        module.__dict__[_GATE_ATTR] = weight
