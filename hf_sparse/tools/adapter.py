"""The long-context adapter: low-rank (LoRA) updates of every decoder projection, trained with YaRN at long
sequence lengths (:mod:`hf_sparse.tools.long_context`), stored in one small safetensors file and merged into the
weights at load (:func:`merge_adapter`).

The file (:func:`save_adapter`, :func:`load_adapter`): per decoder layer and per linear projection (``q_proj k_proj
v_proj o_proj gate_proj up_proj down_proj``) the factors ``A`` ``[rank, in]`` and ``B`` ``[out, rank]``, optionally
the trained RMSNorm weights, and in the safetensors header the format version, base model id, the rope parameters it
was trained with, rank, alpha, trained sequence lengths and tokens. Merging adds ``(alpha / rank) * B @ A`` to each
weight in float32 and casts back.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import nn

from ..gate_files import save_safetensors_atomic

ADAPTER_FORMAT = "hf_sparse.long_context_adapter"


#: The adapter file version this code writes and reads.
ADAPTER_VERSION = 1


#: The linear projections of a decoder layer that get a low-rank update.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


#: Where the shipped adapter of the default model lives (package data).
SHIPPED_ADAPTER = Path(__file__).parent.parent / "data" / "smollm2_long_context.safetensors"


_REQUIRED_METADATA = ("format", "format_version", "base_model", "rope_parameters", "rank", "alpha", "projections",
                      "seq_length", "tokens_trained")


class AdapterError(ValueError):
    """An adapter file that cannot be read, or that does not fit the model."""


# -- LoRA -----------------------------------------------------------------------------------------------------
class LoRALinear(nn.Module):
    """``base(x) + (alpha / rank) * x A^T B^T`` with ``base`` frozen; ``A`` starts uniform in ``±1/sqrt(in)``
    (PyTorch's own ``nn.Linear`` initialisation), ``B`` at zero, so the wrapped layer starts equal to ``base``.
    The factors are float32 (the optimiser's master copy) and cast to the input's dtype in the forward."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.base = base
        self.rank, self.alpha = rank, float(alpha)
        self.scaling = self.alpha / rank
        bound = 1.0 / math.sqrt(base.in_features)
        initial = (torch.rand(rank, base.in_features, generator=generator) * 2 - 1) * bound
        self.lora_A = nn.Parameter(initial.to(base.weight.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(x, self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype))
        return self.base(x) + update * self.scaling


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM (``model.get_decoder().layers``)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no decoder layer list (model.get_decoder().layers)")
    return layers


def projection_modules(model: nn.Module, projections: Sequence[str] = PROJECTIONS) -> dict[str, nn.Module]:
    """``"layers.{i}.{path}"`` -> the linear projection (or its :class:`LoRALinear` wrapper) of every decoder layer,
    for each module whose attribute name is in ``projections``."""
    found: dict[str, nn.Module] = {}
    for index, layer in enumerate(decoder_layers(model)):
        for path, module in layer.named_modules():
            if path.rsplit(".", 1)[-1] in projections and isinstance(module, (nn.Linear, LoRALinear)):
                found[f"layers.{index}.{path}"] = module
    if not found:
        raise ValueError(f"{type(model).__name__}'s decoder layers have none of the projections {list(projections)}")
    return found


def norm_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``"layers.{i}.{path}"`` -> every normalisation module (a name containing "norm" and a 1-D weight) of the
    decoder layers, and ``"norm"`` -> the final norm."""
    found: dict[str, nn.Module] = {}
    for index, layer in enumerate(decoder_layers(model)):
        for path, module in layer.named_modules():
            weight = getattr(module, "weight", None)
            if "norm" in path.rsplit(".", 1)[-1] and isinstance(weight, nn.Parameter) and weight.dim() == 1:
                found[f"layers.{index}.{path}"] = module
    final = getattr(model.get_decoder(), "norm", None)
    if isinstance(getattr(final, "weight", None), nn.Parameter):
        found["norm"] = final
    return found


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    """Replace ``layers.{i}.{path}`` below the decoder with ``module``."""
    _, index, path = name.split(".", 2)
    parent_path, _, attribute = path.rpartition(".")
    layer = decoder_layers(root)[int(index)]
    parent = layer.get_submodule(parent_path) if parent_path else layer
    setattr(parent, attribute, module)


def attach_lora(model: nn.Module, rank: int = 16, alpha: float = 32.0, seed: int = 0,
                projections: Sequence[str] = PROJECTIONS) -> dict[str, LoRALinear]:
    """Wrap every projection of every decoder layer in a :class:`LoRALinear` (in place); name -> wrapper. The
    initial ``A`` factors come from ``seed`` (same seed, same start)."""
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive integer, got {rank!r}")
    generator = torch.Generator().manual_seed(seed)
    wrappers = {}
    for name, module in projection_modules(model, projections).items():
        if isinstance(module, LoRALinear):
            raise ValueError(f"{name} already carries a LoRA update: detach_lora(model) first")
        wrappers[name] = LoRALinear(module, rank, alpha, generator)
        _set_submodule(model, name, wrappers[name])
    return wrappers


def detach_lora(model: nn.Module) -> None:
    """Put the original projections back in place of their :class:`LoRALinear` wrappers (the update is dropped)."""
    for name, module in projection_modules(model).items():
        if isinstance(module, LoRALinear):
            _set_submodule(model, name, module.base)


# -- the adapter file -----------------------------------------------------------------------------------------
@dataclass
class LongContextAdapter:
    """A long-context adapter in memory: ``lora`` maps ``"layers.{i}.{path}"`` to ``(A [rank, in], B [out, rank])``;
    ``norms`` maps norm module names (:func:`norm_modules`) to trained weights (empty when norms were frozen)."""

    lora: dict[str, tuple[torch.Tensor, torch.Tensor]]
    norms: dict[str, torch.Tensor]
    rank: int
    alpha: float
    rope_parameters: dict[str, Any]
    base_model: str
    seq_lengths: list[int]
    tokens_trained: int
    projections: list[str] = field(default_factory=lambda: list(PROJECTIONS))
    training: dict[str, Any] = field(default_factory=dict)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def seq_length(self) -> int:
        """The longest trained sequence."""
        return max(self.seq_lengths)


def adapter_from_lora(wrappers: Mapping[str, LoRALinear], norms: Mapping[str, nn.Module] | None, *,
                      rope: Mapping[str, Any], base_model: str, seq_lengths: Sequence[int], tokens_trained: int,
                      training: Mapping[str, Any] | None = None) -> LongContextAdapter:
    """A :class:`LongContextAdapter` holding copies (float32, CPU) of the wrappers' factors and the norms' weights."""
    first = next(iter(wrappers.values()))
    lora = {name: (w.lora_A.detach().float().cpu().clone(), w.lora_B.detach().float().cpu().clone())
            for name, w in wrappers.items()}
    norm_weights = {name: module.weight.detach().float().cpu().clone() for name, module in (norms or {}).items()}
    projections = sorted({name.rsplit(".", 1)[-1] for name in wrappers}, key=lambda p: (PROJECTIONS + (p,)).index(p))
    return LongContextAdapter(lora, norm_weights, first.rank, first.alpha, dict(rope), base_model,
                              sorted({int(n) for n in seq_lengths}), int(tokens_trained), projections,
                              dict(training or {}))


def save_adapter(adapter: LongContextAdapter, path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``adapter`` to ``path`` (safetensors, atomically); LoRA factors in ``dtype`` (bfloat16 keeps the
    SmolLM2 adapter at rank 16 under 10 MB; merging computes in float32 either way), norms in float32."""
    tensors: dict[str, torch.Tensor] = {}
    for name, (lora_a, lora_b) in adapter.lora.items():
        tensors[f"{name}.lora_A"] = lora_a.detach().to("cpu", dtype).contiguous()
        tensors[f"{name}.lora_B"] = lora_b.detach().to("cpu", dtype).contiguous()
    for name, weight in adapter.norms.items():
        tensors[f"{name}.weight"] = weight.detach().to("cpu", torch.float32).contiguous()
    metadata = {
        "format": ADAPTER_FORMAT,
        "format_version": str(ADAPTER_VERSION),
        "base_model": adapter.base_model,
        "rope_parameters": json.dumps(adapter.rope_parameters, sort_keys=True),
        "rank": str(adapter.rank),
        "alpha": repr(float(adapter.alpha)),
        "projections": json.dumps(list(adapter.projections)),
        "seq_length": str(adapter.seq_length),
        "seq_lengths": json.dumps(list(adapter.seq_lengths)),
        "tokens_trained": str(adapter.tokens_trained),
        "training": json.dumps(adapter.training, sort_keys=True),
    }
    return save_safetensors_atomic(tensors, path, metadata)


def load_adapter(path: str | os.PathLike) -> LongContextAdapter:
    """Read an adapter file written by :func:`save_adapter`; :class:`AdapterError` (naming the problem) for a file
    of another format or version, missing or unreadable metadata, or tensors that do not form rank-``rank`` pairs."""

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no long-context adapter at {path}")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except (SafetensorError, OSError, ValueError) as error:
        raise AdapterError(f"{path} is not a readable safetensors file: {error}") from None
    if metadata.get("format") != ADAPTER_FORMAT:
        raise AdapterError(f"{path} is not a long-context adapter (format {metadata.get('format')!r}, "
                           f"expected {ADAPTER_FORMAT!r})")
    version = metadata.get("format_version")
    if version != str(ADAPTER_VERSION):
        raise AdapterError(f"{path} has adapter format version {version!r}; this hf_sparse reads version "
                           f"{ADAPTER_VERSION} only")
    missing = [key for key in _REQUIRED_METADATA if key not in metadata]
    if missing:
        raise AdapterError(f"{path} lacks the metadata {', '.join(missing)}")
    try:
        rank, alpha = int(metadata["rank"]), float(metadata["alpha"])
        rope = json.loads(metadata["rope_parameters"])
        projections = json.loads(metadata["projections"])
        seq_lengths = json.loads(metadata.get("seq_lengths", "[]")) or [int(metadata["seq_length"])]
        tokens_trained = int(metadata["tokens_trained"])
        training = json.loads(metadata.get("training", "{}"))
    except (ValueError, TypeError) as error:
        raise AdapterError(f"{path} has unreadable metadata: {error}") from None
    if rank < 1 or not isinstance(rope, dict) or not rope.get("rope_type") or not isinstance(projections, list):
        raise AdapterError(f"{path} has invalid metadata: rank {rank}, rope_parameters {rope!r}, "
                           f"projections {projections!r}")
    lora: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    norms: dict[str, torch.Tensor] = {}
    for name in sorted(tensors):
        stem, _, kind = name.rpartition(".")
        if kind == "lora_A":
            if f"{stem}.lora_B" not in tensors:
                raise AdapterError(f"{path}: {name} has no matching {stem}.lora_B")
            lora_a, lora_b = tensors[name], tensors[f"{stem}.lora_B"]
            if lora_a.dim() != 2 or lora_b.dim() != 2 or lora_a.shape[0] != rank or lora_b.shape[1] != rank:
                raise AdapterError(f"{path}: {stem} has factors A {tuple(lora_a.shape)} and B {tuple(lora_b.shape)}, "
                                   f"not [rank, in] and [out, rank] with rank {rank}")
            lora[stem] = (lora_a, lora_b)
        elif kind == "lora_B":
            if f"{stem}.lora_A" not in tensors:
                raise AdapterError(f"{path}: {name} has no matching {stem}.lora_A")
        elif kind == "weight" and tensors[name].dim() == 1:
            norms[stem] = tensors[name]
        else:
            raise AdapterError(f"{path}: unexpected tensor {name} {tuple(tensors[name].shape)}")
    if not lora:
        raise AdapterError(f"{path} holds no LoRA factors")
    return LongContextAdapter(lora, norms, rank, alpha, rope, metadata["base_model"], [int(n) for n in seq_lengths],
                              tokens_trained, projections, training)


def check_adapter_fits(model: nn.Module, adapter: LongContextAdapter) -> None:
    """:class:`AdapterError` unless the adapter updates exactly the model's projections named in its metadata, with
    factor shapes that fit their weights, and its norms exist in the model with the same shapes."""
    targets = projection_modules(model, adapter.projections)
    missing, extra = sorted(set(targets) - set(adapter.lora)), sorted(set(adapter.lora) - set(targets))
    if missing or extra:
        raise AdapterError(f"the adapter does not fit {type(model).__name__}: "
                           f"{len(missing)} projections without factors (first {missing[:3]}), {len(extra)} factors "
                           f"for projections the model lacks (first {extra[:3]})")
    for name, (lora_a, lora_b) in adapter.lora.items():
        module = targets[name]
        base = module.base if isinstance(module, LoRALinear) else module
        expected = (base.out_features, base.in_features)
        if (lora_b.shape[0], lora_a.shape[1]) != expected:
            raise AdapterError(f"the adapter's {name} is for a [{lora_b.shape[0]}, {lora_a.shape[1]}] weight, the "
                               f"model's is {list(expected)}: it was trained for another model")
    model_norms = norm_modules(model)
    for name, weight in adapter.norms.items():
        if name not in model_norms:
            raise AdapterError(f"the adapter has a norm {name} that the model lacks")
        if tuple(model_norms[name].weight.shape) != tuple(weight.shape):
            raise AdapterError(f"the adapter's norm {name} has shape {tuple(weight.shape)}, the model's "
                               f"{tuple(model_norms[name].weight.shape)}")


@torch.no_grad()
def merge_adapter(model: nn.Module, adapter: LongContextAdapter) -> nn.Module:
    """Add ``(alpha / rank) * B @ A`` to every adapted weight (float32 sum, cast back to the weight's dtype) and
    copy the adapter's norm weights; returns ``model``. The rope parameters are not touched: they belong in the
    config before the model is built (:func:`hf_sparse.rope_scaling.apply_rope_parameters`)."""
    check_adapter_fits(model, adapter)
    scaling = adapter.scaling
    for name, module in projection_modules(model, adapter.projections).items():
        weight = (module.base if isinstance(module, LoRALinear) else module).weight
        lora_a, lora_b = (factor.to(weight.device, torch.float32) for factor in adapter.lora[name])
        weight.copy_((weight.float() + scaling * (lora_b @ lora_a)).to(weight.dtype))
    model_norms = norm_modules(model)
    for name, value in adapter.norms.items():
        target = model_norms[name].weight
        target.copy_(value.to(target.device, target.dtype))
    return model
