"""The weights an attention layer reads besides the model's own: PLAS gates and key directions.

A PLAS gate is a per-layer ``[kv_heads, block_size, head_dim]`` weight that compresses key blocks: the compressed key
of block ``j`` is ``sum_i K[j * block_size + i] * W[h, i, :]``; mean pooling is the constant case ``W = 1 /
block_size``, used for every layer that has no gate attached. Key directions (``[kv_heads, R, head_dim]``,
:mod:`hf_sparse.key_scorer`) let a PLAS prefill rank blocks by their largest projected logit. Both live outside the
model's state dict (so ``save_pretrained`` and weight hashes do not see them), attached to the attention modules;
:mod:`hf_sparse.gate_files` reads and writes the file that carries them.

Under transformers' tensor parallelism each rank's attention holds a contiguous chunk of the KV heads, so a rank
keeps the same chunk of every gate (:func:`shard_gates`): :func:`set_gates` takes gates with every head and
:func:`get_gates` returns the rank's chunks.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Collection, Mapping

import torch

from .config import CONFIG_KEY, PLASConfig, config_from_dict
from .distributed import tensor_parallel_rank_and_size

logger = logging.getLogger(__name__)


_GATE_ATTR = "_hf_sparse_gate_weight"


#: Where key directions sit on an attention module (outside its state dict).
_DIRECTIONS_ATTR = "_hf_sparse_key_directions"


def get_gate_weight(module: torch.nn.Module) -> torch.Tensor | None:
    """The gate weight attached to an attention module, or ``None`` (mean pooling).

    A gate that is not a trainable parameter follows the module's device: after ``model.to(device)`` it is moved
    once, on first use, and stored again (so repeated calls return the same tensor object).
    """
    weight = module.__dict__.get(_GATE_ATTR)
    if weight is None or isinstance(weight, torch.nn.Parameter):
        return weight
    return attached_on_device(module, _GATE_ATTR)


def attached_on_device(module: torch.nn.Module, attribute: str) -> torch.Tensor | None:
    """The tensor attached to ``module`` as ``attribute`` (outside its state dict), on the module's device: moved
    once, on first use after ``model.to(device)``, and stored again; ``None`` when none is attached."""
    tensor = module.__dict__.get(attribute)
    if tensor is None:  # (most calls: asked on every prefill)
        return None
    parameter = next(module.parameters(), None)
    if parameter is not None and parameter.device != tensor.device and parameter.device.type != "meta":
        tensor = tensor.to(parameter.device)
        module.__dict__[attribute] = tensor
    return tensor


def set_gate_weight(module: torch.nn.Module, weight: torch.Tensor | None) -> None:
    """Attach (or with ``None`` remove) a gate weight; kept outside the module's state dict."""
    if weight is None:
        module.__dict__.pop(_GATE_ATTR, None)
    else:
        module.__dict__[_GATE_ATTR] = weight


@dataclass(frozen=True)
class GateSpec:
    """What a model expects of its gates: one ``[kv_heads, block_size, head_dim]`` tensor per gated layer."""

    num_layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    gated_layers: tuple[int, ...]
    base_model: str

    @property
    def shape(self) -> tuple[int, int, int]:
        """Shape of one layer's gate."""
        return (self.kv_heads, self.block_size, self.head_dim)


def model_plas_config(model: Any) -> PLASConfig:
    """The PLAS configuration stored in ``model.config`` under ``CONFIG_KEY``, else ``PLASConfig()`` defaults."""
    config = model.config
    stored = getattr(config, CONFIG_KEY, None)
    if stored is None and hasattr(config, "get_text_config"):
        stored = getattr(config.get_text_config(decoder=True), CONFIG_KEY, None)
    if isinstance(stored, PLASConfig):
        return stored
    if isinstance(stored, Mapping):
        parsed = config_from_dict(stored)
        if isinstance(parsed, PLASConfig):
            return parsed
    return PLASConfig()


def attention_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The decoder's attention modules by ``layer_idx`` (the modules the attention function receives)."""
    found: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        layer_idx = getattr(module, "layer_idx", None)
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int):
            continue
        if "Attention" not in type(module).__name__ or layer_idx in found:
            continue  # decoder layers may carry layer_idx too; the outermost attention module wins
        found[layer_idx] = module
    if not found:
        raise ValueError(f"{type(model).__name__} has no attention modules with a layer_idx attribute")
    return dict(sorted(found.items()))


def gate_spec(model: Any, block_size: int | None = None) -> GateSpec:
    """The gate shape and gated layers of ``model`` (block size from its PLAS configuration unless given)."""
    text = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    num_layers = int(text.num_hidden_layers)
    q_heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or q_heads)
    modules = attention_modules(model)
    head_dim = getattr(next(iter(modules.values())), "head_dim", None)
    head_dim = int(head_dim or getattr(text, "head_dim", None) or text.hidden_size // q_heads)
    plas = model_plas_config(model)
    block_size = plas.block_size if block_size is None else block_size
    gated = tuple(i for i in range(num_layers) if not plas.is_dense_layer(i, num_layers))
    base_model = str(getattr(model.config, "_name_or_path", "") or "")
    return GateSpec(num_layers, kv_heads, head_dim, block_size, gated, base_model)


def get_gates(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """The gates attached to ``model``'s attention modules, by layer index (under tensor parallelism this rank's
    chunk of the KV heads; :func:`hf_sparse.gate_files.gathered_gates` has them all)."""
    gates = {}
    for layer_idx, module in attention_modules(model).items():
        weight = get_gate_weight(module)
        if weight is not None:
            gates[layer_idx] = weight
    return gates


def shard_gates(gates: Mapping[int, torch.Tensor], kv_heads: int, rank: int,
                tp_size: int) -> dict[int, torch.Tensor]:
    """Rank ``rank``'s chunk of each ``[kv_heads, block_size, head_dim]`` gate under tensor parallelism of
    ``tp_size`` ranks: heads ``[rank * kv_heads / tp_size, (rank + 1) * kv_heads / tp_size)``, the heads its
    column-wise ``k_proj`` produces (:func:`hf_sparse.distributed.tensor_parallel_rank_and_size`).

    Raises ``ValueError`` when a gate does not hold ``kv_heads`` heads or ``kv_heads`` does not divide by ``tp_size``.
    """
    if kv_heads % tp_size:
        raise ValueError(f"{kv_heads} KV heads do not split over tensor parallelism's {tp_size} ranks (each rank's "
                         f"attention holds a contiguous chunk of the heads): load the model with a tp_size that "
                         f"divides {kv_heads}")
    per_rank = kv_heads // tp_size
    chunks = {}
    for layer_idx, weight in gates.items():
        if weight.dim() != 3 or weight.shape[0] != kv_heads:
            raise ValueError(f"layer {layer_idx}: gate shape {tuple(weight.shape)} does not hold the model's "
                             f"{kv_heads} KV heads; a tensor-parallel model (tp_size {tp_size}) takes gates with "
                             f"every head and keeps rank {rank}'s {per_rank}")
        chunks[layer_idx] = weight[rank * per_rank:(rank + 1) * per_rank]
    return chunks


def set_gates(model: torch.nn.Module, gates: Mapping[int, torch.Tensor] | None) -> None:
    """Attach ``gates`` (layer index -> ``[kv_heads, block_size, head_dim]``) as float32 on each module's device;
    ``None`` removes every gate (mean pooling). Layers not in ``gates`` are left as they are. On a model split by
    tensor parallelism each module keeps this rank's chunk of the heads (:func:`shard_gates`)."""
    modules = attention_modules(model)
    if gates is None:
        for module in modules.values():
            set_gate_weight(module, None)
        return
    unknown = sorted(set(gates) - set(modules))
    if unknown:
        raise ValueError(f"no attention module for layer(s) {unknown}; the model has layers {sorted(modules)}")
    rank, tp_size = tensor_parallel_rank_and_size(model)
    if tp_size > 1:
        gates = shard_gates(gates, gate_spec(model).kv_heads, rank, tp_size)
    for layer_idx, weight in gates.items():
        module = modules[layer_idx]
        parameter = next(module.parameters(), None)
        device = parameter.device if parameter is not None and parameter.device.type != "meta" else weight.device
        set_gate_weight(module, weight.detach().to(device=device, dtype=torch.float32))


def mean_pooling_gates(model: Any, block_size: int | None = None) -> dict[int, torch.Tensor]:
    """Gates equal to mean pooling over full blocks (``1 / block_size``) for every gated layer (float32, CPU)."""
    spec = gate_spec(model, block_size)
    return {i: torch.full(spec.shape, 1.0 / spec.block_size) for i in spec.gated_layers}


# -- key directions ---------------------------------------------------------------------------------------------
def get_key_directions(module: torch.nn.Module) -> torch.Tensor | None:
    """The key directions ``[kv_heads, R, head_dim]`` attached to an attention module, on its device (moved once,
    on first use, after ``model.to(device)``), or ``None``."""
    return attached_on_device(module, _DIRECTIONS_ATTR)


def set_key_directions(model: torch.nn.Module, directions: Mapping[int, torch.Tensor] | None) -> None:
    """Attach ``{layer: [kv_heads, R, head_dim]}`` to the model's attention modules (``None``: remove them all).
    Layers not named keep none. Raises ``ValueError`` naming a layer the model lacks or a tensor of the wrong
    shape (its KV heads or head dim not the model's), before attaching anything."""
    modules = attention_modules(model)
    if directions is None:
        for module in modules.values():
            module.__dict__.pop(_DIRECTIONS_ATTR, None)
        return
    spec = gate_spec(model)
    problem = directions_problem(directions, spec.kv_heads, spec.head_dim, modules.keys())
    if problem:
        raise ValueError(problem)
    checked = {layer: tensor.detach().float() for layer, tensor in directions.items()}
    for layer, module in modules.items():
        if layer in checked:
            module.__dict__[_DIRECTIONS_ATTR] = checked[layer]
        else:
            module.__dict__.pop(_DIRECTIONS_ATTR, None)


def directions_problem(directions: Mapping[int, torch.Tensor], kv_heads: int, head_dim: int,
                       layers: range | Collection[int]) -> str | None:
    """What makes ``{layer: [kv_heads, R, head_dim]}`` key directions unusable for a model whose attention
    layers are ``layers`` (a layer it lacks, another shape, several ranks R, not finite floats), or ``None``: the one
    check of attaching, writing and reading them."""
    for layer, tensor in sorted(directions.items()):
        if layer not in layers:
            named = f"0..{layers[-1]}" if isinstance(layers, range) and layers else ", ".join(map(str, sorted(layers)))
            return f"key directions for layer {layer}, but the model's attention layers are {named}"
        if tensor.dim() != 3 or (tensor.shape[0], tensor.shape[2]) != (kv_heads, head_dim) or tensor.shape[1] < 1:
            return (f"layer {layer}: key directions of shape {tuple(tensor.shape)}, expected [kv_heads={kv_heads}, "
                    f"R >= 1, head_dim={head_dim}]")
        if not tensor.is_floating_point() or not bool(torch.isfinite(tensor.float()).all()):
            return f"layer {layer}: key directions are not finite floats"
    ranks = sorted({tensor.shape[1] for tensor in directions.values()})
    if len(ranks) > 1:
        return f"key directions of several ranks {ranks}: one rank per model"
    return None
