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
from .cache import SparseCache
from .feed_forward import SILU_ACTIVATIONS
from .kernels._common import DECODE_LINEAR_MAX_ROWS

logger = logging.getLogger(__name__)

#: Class-name endings of the modules swapped in captured steps: per-layer norms and dense MLPs (compiled forwards), and
#: the model's rotary embedding (:func:`rotary_call`).
_FUSED_SUFFIXES = ("RMSNorm", "LayerNorm", "MLP", "RotaryEmbedding")
#: Rope types whose embedding changes the module's frequencies as the positions grow (transformers'
#: ``dynamic_rope_update``): their steps run the module's own forward.
_DYNAMIC_ROPE = ("dynamic", "longrope")
#: Per (rotary class, rope type): whether :func:`rotary_embedding` gave the class's own forward's tables, bit for bit.
_ROTARY_CHECKED: dict[tuple[type, Any], bool] = {}
_ROTARY_KEY = ("hf_sparse.fusion", "rotary_embedding")
#: Mixture-of-experts blocks route tokens by data-dependent indexing; they stay eager.
_EAGER_MARKERS = ("Moe", "MoE", "Sparse", "Expert")

#: Module-level functions of a modeling module that are compiled (transformers' rotary embedding).
_FUSED_FUNCTIONS = ("apply_rotary_pos_emb",)

#: Compiled forward per module class, compiled function per (modeling module, name); None once one failed to
#: compile or run compiled.
_COMPILED: dict[Any, Any] = {}


def fusable(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward is swapped in captured decode steps: compiled (norms, dense MLPs), or the rotary
    embedding's :func:`rotary_call`."""
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


def rotary_embedding(inv_freq: torch.Tensor, position_ids: torch.Tensor, scaling: float,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and sin tables ``[B, S, 2F]`` of transformers' rotary embedding for ``position_ids`` ``[B, S]``
    and frequencies ``inv_freq`` ``[F]``, their position-frequency product written as the elementwise product it
    is (transformers up to 5.17 writes it as a float32 matrix product of inner size one: a cuBLAS call)."""
    freqs = position_ids[:, :, None].float() * inv_freq[None, None, :].float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def _rotary_inputs(args: tuple, kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The states and 2D position ids of a rotary embedding call ``(x, position_ids)``, the ids positional or by
    name; None for any other call."""
    if len(args) == 2 and not kwargs:
        x, position_ids = args
    elif len(args) == 1 and list(kwargs) == ["position_ids"]:
        x, position_ids = args[0], kwargs["position_ids"]
    else:
        return None
    if not isinstance(x, torch.Tensor) or not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2:
        return None
    return x, position_ids


def _elementwise_rotary(module: torch.nn.Module, inputs: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
    """Whether the module's tables for ``inputs`` (:func:`_rotary_inputs`) are :func:`rotary_embedding` of its
    frequencies: a rope type with fixed frequencies, of a class whose own forward gave the same tables, bit for bit,
    the first time (checked once per class and rope type, outside graph capture)."""
    rope_type = getattr(module, "rope_type", "default")
    inv_freq, scaling = getattr(module, "inv_freq", None), getattr(module, "attention_scaling", None)
    if (inputs is None or not isinstance(rope_type, str) or rope_type in _DYNAMIC_ROPE
            or not isinstance(inv_freq, torch.Tensor) or inv_freq.dim() != 1 or isinstance(scaling, bool)
            or not isinstance(scaling, (int, float))):
        return False
    key = (type(module), rope_type)
    if key not in _ROTARY_CHECKED:
        x, position_ids = inputs
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        # On the CPU (the formula is what is checked): the module's own forward on the GPU would call cuBLAS on the
        # capture stream, which is what this replaces.
        positions, states = position_ids.cpu(), torch.zeros(1, dtype=x.dtype)
        try:
            own = type(module).forward(module, states, positions)
        except Exception:  # noqa: BLE001 - a forward that does not take CPU tables: its own forward runs
            own = None
        ours = rotary_embedding(inv_freq.cpu(), positions, scaling, x.dtype)
        _ROTARY_CHECKED[key] = (isinstance(own, tuple) and len(own) == 2
                                and all(torch.equal(a, b) for a, b in zip(own, ours)))
        if not _ROTARY_CHECKED[key]:
            logger.debug("%s (%s): tables differ from rotary_embedding's; its own forward runs", *key)
    return _ROTARY_CHECKED[key]


def rotary_call(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A rotary embedding module's call in a captured step: :func:`rotary_embedding` compiled where it computes the
    module's own tables (:func:`_elementwise_rotary`), else the module's own forward (eager: a dynamic rope type
    branches on the positions)."""
    inputs = _rotary_inputs(args, kwargs)
    if _elementwise_rotary(module, inputs):
        x, position_ids = inputs
        _compiled_function(_ROTARY_KEY, rotary_embedding)
        return _run(_ROTARY_KEY, rotary_embedding, "the rotary embedding", module.inv_freq, position_ids,
                    float(module.attention_scaling), x.dtype)
    return type(module).forward(module, *args, **kwargs)


#: Decoder layer classes whose forward :func:`fused_layer_forward` computes (read in transformers 5.17-5.24: the
#: norm, attention with rotary embedding, residual add, norm, gated MLP, residual add; the layer returns a tensor).
_FUSED_LAYER_CLASSES = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer")
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def fusable_layer(layer: torch.nn.Module) -> bool:
    """Whether ``layer``'s decode steps may run :func:`fused_layer_forward`: one of the known Llama-style classes,
    made of plain ``nn.Linear`` projections (a bias on all of q / k / v or none, on gate and up or neither) of plain
    tensors, RMSNorms and a SiLU gate, all in one dtype on one device, with no hooks (another library's offloading
    or quantisation) and no module whose ``forward`` another library replaced, no query / key norms and no sliding
    window.

    A tensor-parallel layer is refused on both counts: transformers' tensor parallelism wraps the projections
    (module hooks up to 5.17; from 5.18 a ``forward`` instance attribute around DTensor weights, which the plain
    tensor rule refuses too), and those wrappers hold the gather and reduction a fused product of the local
    shards would skip."""
    if type(layer).__name__ not in _FUSED_LAYER_CLASSES or type(layer).forward.__annotations__.get("return") not in (
            "torch.Tensor", torch.Tensor):
        return False
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    linears = [getattr(attention, name, None) for name in _PROJECTIONS] + \
        [getattr(mlp, name, None) for name in _MLP_PROJECTIONS]
    if any(type(linear) is not torch.nn.Linear for linear in linears) or hasattr(attention, "q_norm") \
            or hasattr(attention, "k_norm") or type(getattr(mlp, "act_fn", None)).__name__ not in SILU_ACTIVATIONS:
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
    return not any("forward" in module.__dict__ or any(_foreign_hook(hook) for hook in (
        *module._forward_hooks.values(), *module._forward_pre_hooks.values())) for module in layer.modules())


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
    # A SparseCache adds the layer holding the keys to the attention's keyword arguments
    update_kwargs = {"kwargs": passed} if isinstance(cache, SparseCache) else {}
    key, value = cache.update(key, value, attention.layer_idx, **update_kwargs)
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


def fusable_head(module: torch.nn.Module) -> bool:
    """Whether ``module`` (a model's output embeddings) may run :func:`head_forward`: a plain ``nn.Linear`` of plain
    contiguous tensors without hooks."""
    tensors = [module.weight] + ([module.bias] if getattr(module, "bias", None) is not None else [])
    return (type(module) is torch.nn.Linear and "forward" not in module.__dict__
            and all(type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.is_contiguous()
                    and tensor.device.type != "meta" for tensor in tensors)
            and not any(_foreign_hook(hook) for hook in (*module._forward_hooks.values(),
                                                         *module._forward_pre_hooks.values())))


def head_forward(head: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The output head's product (``lm_head``) for a decode step's few rows as one
    :func:`hf_sparse.kernels.decode_linear` launch; other inputs run the layer's own forward."""
    rows = x.numel() // x.shape[-1] if x.dim() >= 2 and x.shape[-1] else 0
    if not 1 <= rows <= DECODE_LINEAR_MAX_ROWS or x.dtype != head.weight.dtype or x.device != head.weight.device:
        return type(head).forward(head, x)
    flat = x.reshape(rows, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    return kernels.decode_linear(flat, [head.weight], [head.bias]).view(*x.shape[:-1], head.weight.shape[0])


@contextlib.contextmanager
def fused_modules(model: torch.nn.Module, enabled: bool = True, layers: bool = True) -> Iterator[int]:
    """Within the block, ``model``'s Llama-style decoder layers run :func:`fused_layer_forward` and its output head
    :func:`head_forward` (unless ``layers`` is False), its other norms, dense MLPs and rotary embedding compiled
    forwards (:func:`fusable`), and its modeling module's rotary function a compiled function;
    yields how many modules and functions were swapped. Modules whose ``forward`` is already an instance attribute
    (another library's hook) are left alone. In a tensor-parallel model the layers and the head stay unfused
    (:func:`fusable_layer`, :func:`fusable_head`); its norms and MLPs are still compiled, their projections running
    transformers' tensor-parallel forwards (hooks or wrapped ``forward``) inside the compiled code.

    A step of a model whose layers all fuse then calls no cuBLAS routine (the rotary embedding through
    :func:`rotary_call`): cuBLAS keeps a workspace per stream it runs on for the process's life (32 MiB on Hopper),
    and the capture stream's would be memory that dense decode does not hold."""
    swapped, functions = [], []
    try:
        if enabled:
            head = model.get_output_embeddings() if layers and hasattr(model, "get_output_embeddings") else None
            if isinstance(head, torch.nn.Module) and fusable_head(head):
                head.__dict__["forward"] = functools.partial(head_forward, head)
                swapped.append(head)
            for module in model.modules():
                if "forward" in module.__dict__:
                    continue
                if layers and fusable_layer(module):
                    module.__dict__["forward"] = functools.partial(fused_layer_forward, module)
                    swapped.append(module)
                elif fusable(module) and type(module).__name__.endswith("RotaryEmbedding"):
                    module.__dict__["forward"] = functools.partial(rotary_call, module)
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
