"""Settings shared by the Triton launchers."""
from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_settings(dtype: torch.dtype) -> tuple[bool, str]:
    """``(upcast operands to float32, tl.dot input precision)`` for inputs of ``dtype``.

    float32 inputs use three tf32 products per product on the GPU ("tf32x3": float32 accuracy on tensor
    cores; plain "ieee" lowers to slow FMA loops there). The interpreter computes exactly, and since the one
    of triton 3.9 computes bfloat16 dots wrongly, half-precision operands are upcast there.
    """
    if interpreting():
        return True, "ieee"
    if dtype == torch.float32:
        return True, "tf32x3"
    return False, "tf32"
