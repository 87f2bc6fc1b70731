"""Fused norms and MLPs inside captured decode steps (``decode_compile``).

A CUDA-graph decode step of a small model is a sequence of ~45 kernels per layer, most of them elementwise: an
RMSNorm alone is eight launches in eager PyTorch. Replaying the graph removes the host's launch cost but not the
GPU's cost per kernel (a few microseconds each, whatever its size). While :mod:`hf_sparse.graphs` warms up and
captures a step, :func:`fused_modules` swaps the forward of each norm and dense MLP of the model for a
``torch.compile``'d one (one compilation per module class and step shape, shared by every layer), and the rotary
embedding function of the model's modeling module (``apply_rotary_pos_emb``, which transformers' attention
modules call by that global name) for a compiled one; so the captured step holds Inductor's fused kernels: one
per norm, one for the MLP's activation and product, one or two for the rotation of the queries and keys. Nothing
else of the model changes, and nothing outside the warm-up and capture runs compiled (the prefill and eager
decode stay as transformers wrote them).

A class or function whose compilation or compiled call fails runs eagerly from then on (logged once): these are
pure functions of their inputs, so the eager retry sees exactly the same inputs.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import sys
from typing import Any, Iterator

import torch

logger = logging.getLogger(__name__)

#: Class-name endings of the modules whose forward is compiled: per-layer norms and dense MLPs.
_FUSED_SUFFIXES = ("RMSNorm", "LayerNorm", "MLP")
#: Mixture-of-experts blocks route tokens by data-dependent indexing; they stay eager.
_EAGER_MARKERS = ("Moe", "MoE", "Sparse", "Expert")

#: Module-level functions of a modeling module that are compiled (transformers' rotary embedding).
_FUSED_FUNCTIONS = ("apply_rotary_pos_emb",)

#: Compiled forward per module class, compiled function per (modeling module, name); None once one failed to
#: compile or run compiled.
_COMPILED: dict[Any, Any] = {}


def fusable(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward is compiled in captured decode steps."""
    name = type(module).__name__
    return name.endswith(_FUSED_SUFFIXES) and not any(marker in name for marker in _EAGER_MARKERS)


def _compiled_forward(cls: type) -> Any:
    if cls not in _COMPILED:
        _COMPILED[cls] = torch.compile(cls.forward, dynamic=False, fullgraph=True)
    return _COMPILED[cls]


def _compiled_function(key: tuple[str, str], function: Any) -> Any:
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(function, dynamic=False, fullgraph=True)
    return _COMPILED[key]


def _run(key: Any, eager: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """The compiled version of ``key`` on the arguments, else (none, or it fails: from then on) ``eager``."""
    compiled = _COMPILED.get(key)
    if compiled is not None:
        try:
            return compiled(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - any compile or run failure: this one runs eagerly
            _COMPILED[key] = None
            message = str(error).splitlines()[0] if str(error) else ""
            logger.warning("hf_sparse: decode_compile: %s runs eagerly in CUDA-graph decode (%s: %s)",
                           name, type(error).__name__, message)
    return eager(*args, **kwargs)


def _fused_call(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    cls = type(module)
    return _run(cls, cls.forward, cls.__name__, module, *args, **kwargs)


@contextlib.contextmanager
def fused_modules(model: torch.nn.Module, enabled: bool = True) -> Iterator[int]:
    """Within the block, ``model``'s norms and dense MLPs run compiled forwards (:func:`fusable`) and its modeling
    module's rotary embedding a compiled function; yields how many modules and functions were swapped. Modules
    whose ``forward`` is already an instance attribute (another library's hook) are left alone."""
    swapped, functions = [], []
    try:
        if enabled:
            for module in model.modules():
                if fusable(module) and "forward" not in module.__dict__ and \
                        _compiled_forward(type(module)) is not None:
                    module.__dict__["forward"] = functools.partial(_fused_call, module)
                    swapped.append(module)
            for namespace in {sys.modules.get(type(module).__module__) for module in model.modules()} - {None}:
                for name in _FUSED_FUNCTIONS:
                    original = getattr(namespace, name, None)
                    key = (namespace.__name__, name)
                    swapped_already = isinstance(original, functools.partial) and original.func is _run
                    if callable(original) and not swapped_already and _compiled_function(key, original) is not None:
                        setattr(namespace, name, functools.partial(_run, key, original, name))
                        functions.append((namespace, name, original))
        yield len(swapped) + len(functions)
    finally:
        for module in swapped:
            module.__dict__.pop("forward", None)
        for namespace, name, original in functions:
            setattr(namespace, name, original)
