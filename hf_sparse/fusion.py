"""Fused norms and MLPs inside captured decode steps (``decode_compile``).

A CUDA-graph decode step of a small model is a sequence of ~45 kernels per layer, most of them elementwise: an
RMSNorm alone is eight launches in eager PyTorch. Replaying the graph removes the host's launch cost but not the
GPU's cost per kernel (a few microseconds each, whatever its size). While :mod:`hf_sparse.graphs` warms up and
captures a step, :func:`fused_modules` swaps the forward of each norm and dense MLP of the model for a
``torch.compile``'d one (one compilation per module class and step shape, shared by every layer), so the captured
step holds Inductor's fused kernels: one per norm, one for the MLP's activation and product. Nothing else of the
model changes, and nothing outside the warm-up and capture runs compiled (the prefill and eager decode stay as
transformers wrote them).

A class whose compilation or compiled call fails runs eagerly from then on (logged once): these modules are pure
functions of their input, so the eager retry of that module sees exactly the same input.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Iterator

import torch

logger = logging.getLogger(__name__)

#: Class-name endings of the modules whose forward is compiled: per-layer norms and dense MLPs.
_FUSED_SUFFIXES = ("RMSNorm", "LayerNorm", "MLP")
#: Mixture-of-experts blocks route tokens by data-dependent indexing; they stay eager.
_EAGER_MARKERS = ("Moe", "MoE", "Sparse", "Expert")

#: Compiled forward per module class; None once a class failed to compile or run compiled.
_COMPILED: dict[type, Any] = {}


def fusable(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward is compiled in captured decode steps."""
    name = type(module).__name__
    return name.endswith(_FUSED_SUFFIXES) and not any(marker in name for marker in _EAGER_MARKERS)


def _compiled_forward(cls: type) -> Any:
    if cls not in _COMPILED:
        _COMPILED[cls] = torch.compile(cls.forward, dynamic=False, fullgraph=True)
    return _COMPILED[cls]


def _fused_call(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    cls = type(module)
    compiled = _COMPILED.get(cls)
    if compiled is not None:
        try:
            return compiled(module, *args, **kwargs)
        except Exception as error:  # noqa: BLE001 - any compile or run failure: this class runs eagerly
            _COMPILED[cls] = None
            logger.warning("hf_sparse: decode_compile: %s runs eagerly in CUDA-graph decode (%s: %s)",
                           cls.__name__, type(error).__name__, str(error).splitlines()[0] if str(error) else "")
    return cls.forward(module, *args, **kwargs)


@contextlib.contextmanager
def fused_modules(model: torch.nn.Module, enabled: bool = True) -> Iterator[int]:
    """Within the block, ``model``'s norms and dense MLPs run compiled forwards (:func:`fusable`); yields how
    many modules were swapped. Modules whose ``forward`` is already an instance attribute (another library's
    hook) are left alone."""
    swapped = []
    try:
        if enabled:
            for module in model.modules():
                if fusable(module) and "forward" not in module.__dict__ and \
                        _compiled_forward(type(module)) is not None:
                    module.__dict__["forward"] = functools.partial(_fused_call, module)
                    swapped.append(module)
        yield len(swapped)
    finally:
        for module in swapped:
            module.__dict__.pop("forward", None)
