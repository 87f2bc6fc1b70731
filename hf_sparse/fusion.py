"""Fused layers, norms and MLPs inside captured decode steps (``decode_compile``, ``decode_fused_layers``).

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

Llama-style decoder layers (:func:`fusable_layer`: Llama, Mistral, Qwen2 layers of plain linear layers, RMSNorms and
a SiLU-gated MLP) go further: their forward is swapped whole for :func:`fused_layer_forward`, whose weight
products run as four :func:`hf_sparse.kernels.decode_linear` launches (the norm, the query, key and value
products and the rotary embedding; the output product and the residual add; the norm and the gated up product;
the down product and the residual add) around the cache write and the attention function, which it calls as the
layer's attention module does. Nothing is copied: the kernels read the modules' own weights.

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
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import kernels
from .kernels._common import DECODE_LINEAR_MAX_ROWS

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


#: Decoder layer classes whose forward :func:`fused_layer_forward` computes (read in transformers 5.17-5.24: the
#: norm, attention with rotary embedding, residual add, norm, gated MLP, residual add; the layer returns a tensor).
_FUSED_LAYER_CLASSES = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer")
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def fusable_layer(layer: torch.nn.Module) -> bool:
    """Whether ``layer``'s decode steps may run :func:`fused_layer_forward`: one of the known Llama-style classes,
    made of plain ``nn.Linear`` projections (a bias on all of q / k / v or none, on gate and up or neither) of plain
    tensors, RMSNorms and a SiLU gate, all in one dtype on one device, with no hooks (another library's offloading
    or quantisation), no query / key norms and no sliding window."""
    if type(layer).__name__ not in _FUSED_LAYER_CLASSES or type(layer).forward.__annotations__.get("return") not in (
            "torch.Tensor", torch.Tensor):
        return False
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    linears = [getattr(attention, name, None) for name in _PROJECTIONS] + \
        [getattr(mlp, name, None) for name in _MLP_PROJECTIONS]
    if any(type(linear) is not torch.nn.Linear for linear in linears) or hasattr(attention, "q_norm") \
            or hasattr(attention, "k_norm") or type(getattr(mlp, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
        return False
    if any(not type(norm).__name__.endswith("RMSNorm") or not isinstance(getattr(norm, "variance_epsilon", None), float)
           or getattr(norm, "weight", None) is None for norm in norms):
        return False
    if len({linear.bias is None for linear in linears[:3]}) != 1 or len({linear.bias is None for linear in linears[4:6]}) != 1:
        return False
    # A sliding window the attention module passes (Qwen2's per layer, Mistral's from its config) is not computed here
    window = (getattr(attention, "sliding_window", None) if hasattr(attention, "sliding_window")
              else getattr(getattr(attention, "config", None), "sliding_window", None))
    if window is not None:
        return False
    tensors = [linear.weight for linear in linears] + [norm.weight for norm in norms] + \
        [linear.bias for linear in linears if linear.bias is not None]
    if (len({tensor.dtype for tensor in tensors}) != 1 or len({tensor.device for tensor in tensors}) != 1
            or not all(type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.is_contiguous()
                       and tensor.device.type != "meta" for tensor in tensors)):
        return False
    return not any(_foreign_hook(hook) for module in layer.modules()
                   for hook in (*module._forward_hooks.values(), *module._forward_pre_hooks.values()))


def _foreign_hook(hook: Any) -> bool:
    """Whether a module hook is another library's (offloading, quantisation, a user's probe), not transformers' own
    output-capture hook, which it installs on every layer once a call asks for hidden states and which records
    nothing while no such call runs (the fused forward still runs under the layer's hooks)."""
    return "output_cap" not in getattr(hook, "__qualname__", "")


def fused_layer_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """What a :func:`fusable_layer`'s own forward computes, with its weight products in four launches
    (:func:`hf_sparse.kernels.decode_linear`); the layer's own forward where those do not apply (positional
    arguments, more rows than a decode step's, no rotary embedding or cache given, another dtype). The attention
    function gets what the layer's attention module passes it: the mask, and the layer's other keyword arguments
    (position ids, ...) but the rotary embedding and the cache."""
    attention, mlp = layer.self_attn, layer.mlp
    batch, steps, hidden = hidden_states.shape
    rows = batch * steps
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    position_embeddings = kwargs.get("position_embeddings")
    if args or rows > DECODE_LINEAR_MAX_ROWS or position_embeddings is None or cache is None \
            or hidden_states.dtype != attention.q_proj.weight.dtype:
        return type(layer).forward(layer, hidden_states, *args, **kwargs)
    passed = {name: value for name, value in kwargs.items()
              if name not in ("attention_mask", "position_embeddings", "cache", "past_key_values")}
    x = hidden_states.reshape(rows, hidden)
    norm = layer.input_layernorm
    projections = [getattr(attention, name) for name in _PROJECTIONS[:3]]
    head_dim = attention.head_dim
    sizes = [p.weight.shape[0] for p in projections]
    cos, sin = position_embeddings
    # The rotary embedding in the same launch where its tables are the plain [B or 1, S, head_dim] ones
    rotary = (cos, sin) if (cos.dim() == 3 and cos.shape == sin.shape and cos.shape[1:] == (steps, head_dim)
                            and cos.shape[0] in (1, batch) and cos.dtype == sin.dtype == x.dtype
                            and cos.stride(-1) == sin.stride(-1) == 1) else None
    qkv = kernels.decode_linear(x, [p.weight for p in projections], [p.bias for p in projections],
                                norm_weight=norm.weight, eps=norm.variance_epsilon, rotary=rotary)
    query, key, value = (part.view(batch, steps, -1, head_dim).transpose(1, 2) for part in qkv.split(sizes, dim=-1))
    if rotary is None:
        query, key = sys.modules[type(attention).__module__].apply_rotary_pos_emb(query, key, cos, sin)
    key, value = cache.update(key, value, attention.layer_idx)
    function = ALL_ATTENTION_FUNCTIONS[attention.config._attn_implementation]
    output, _ = function(attention, query, key, value, kwargs.get("attention_mask"), dropout=0.0,
                         scaling=attention.scaling, **passed)
    output = output.reshape(rows, -1)
    o_proj = attention.o_proj
    x = kernels.decode_linear(output, [o_proj.weight], [o_proj.bias], residual=x)
    norm = layer.post_attention_layernorm
    gate, up, down = (getattr(mlp, name) for name in _MLP_PROJECTIONS)
    product = kernels.decode_linear(x, [gate.weight, up.weight], [gate.bias, up.bias], norm_weight=norm.weight,
                                    eps=norm.variance_epsilon, gated=True)
    x = kernels.decode_linear(product, [down.weight], [down.bias], residual=x)
    return x.view(batch, steps, hidden)


@contextlib.contextmanager
def fused_modules(model: torch.nn.Module, enabled: bool = True, layers: bool = True) -> Iterator[int]:
    """Within the block, ``model``'s Llama-style decoder layers run :func:`fused_layer_forward` (unless ``layers`` is
    False), its other norms and dense MLPs compiled forwards (:func:`fusable`), and its modeling module's rotary
    embedding a compiled function;
    yields how many modules and functions were swapped. Modules whose ``forward`` is already an instance attribute
    (another library's hook) are left alone."""
    swapped, functions = [], []
    try:
        if enabled:
            for module in model.modules():
                if "forward" in module.__dict__:
                    continue
                if layers and fusable_layer(module):
                    module.__dict__["forward"] = functools.partial(fused_layer_forward, module)
                    swapped.append(module)
                elif fusable(module) and _compiled_forward(type(module)) is not None:
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
