"""Every touch of transformers internals: registration, mask function, generate() cache hook, probes.

All patches are idempotent and reversible (:func:`unpatch`).
"""
from __future__ import annotations

import contextlib
import copy
import logging
from typing import Any, Callable, Iterator

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.generation.utils import GenerationMixin
from transformers.masking_utils import AttentionMaskInterface

from .attention import dense_attention, plas_attention_forward
from .cache import SparseCache
from .config import CONFIG_KEY, PLASConfig

logger = logging.getLogger(__name__)

#: Attention implementations this package provides.
METHODS = ("plas", "xattn", "star")
_PENDING = {"xattn": "XAttention (issue #5)", "star": "Star Attention (issue #6)"}
_PROBE_NAME = "hf_sparse_probe"


def _not_yet(name: str) -> Callable[..., Any]:
    def attention(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f'attn_implementation="{name}" is registered but not implemented yet: {_PENDING[name]}')

    return attention


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                 mask_function: Callable | None = None, attention_mask: torch.Tensor | None = None,
                 **kwargs: Any) -> torch.Tensor | None:
    """Mask function for our implementations: the 2D padding mask ``[B, kv_length]`` (or None when the
    caller passed none).

    No dense ``[B, 1, S, S]`` mask is built; causality is applied inside the attention function. The mask
    is returned even when it holds no padding: checking that would read it on the host every step.
    """
    if attention_mask is None:
        return None
    return attention_mask[:, -kv_length:]


_ORIGINAL: dict[str, Any] = {}


def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
    """Default ``generate()`` cache: a SparseCache for our implementations when the user chose none."""
    result = _ORIGINAL["prepare_cache"](self, generation_config, model_kwargs, *args, **kwargs)
    implementation = getattr(self.config, "_attn_implementation", None)
    cache = model_kwargs.get("past_key_values")
    if (
        implementation in METHODS
        and generation_config.cache_implementation is None
        and cache is not None
        and type(cache).__name__ == "DynamicCache"
        and not getattr(cache, "_is_user_defined", False)
        and cache.get_seq_length() == 0
    ):
        model_kwargs["past_key_values"] = SparseCache(self.config)
    return result


def patch() -> None:
    """Register our attention/mask functions and install the generate() hook (idempotent)."""
    AttentionInterface.register("plas", plas_attention_forward)
    for name in _PENDING:
        AttentionInterface.register(name, _not_yet(name))
    for name in METHODS + (_PROBE_NAME,):
        AttentionMaskInterface.register(name, padding_mask)
    if "prepare_cache" not in _ORIGINAL:
        _ORIGINAL["prepare_cache"] = GenerationMixin._prepare_cache_for_generation
        GenerationMixin._prepare_cache_for_generation = _prepare_cache_for_generation


def unpatch() -> None:
    """Undo :func:`patch`'s generate() hook (registered names stay, as transformers cannot unregister)."""
    if "prepare_cache" in _ORIGINAL:
        GenerationMixin._prepare_cache_for_generation = _ORIGINAL.pop("prepare_cache")


def _check_model(model: PreTrainedModel) -> None:
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"expected a transformers PreTrainedModel, got {type(model).__name__}")
    if not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface, "
            "so hf_sparse cannot replace its attention"
        )


def configure(model: PreTrainedModel, config: PLASConfig | None = None) -> PreTrainedModel:
    """Attach a method configuration to ``model`` (stored in ``model.config``) and switch its attention to it."""
    _check_model(model)
    config = config if config is not None else PLASConfig()
    if not isinstance(config, PLASConfig):
        raise TypeError(f"configure() takes a PLASConfig, got {type(config).__name__}")
    text_config = model.config.get_text_config(decoder=True)
    for target in {id(model.config): model.config, id(text_config): text_config}.values():
        setattr(target, CONFIG_KEY, config.to_dict())
    if getattr(model.config, "_attn_implementation", None) != config.method:
        model.set_attn_implementation(config.method)
    return model


@contextlib.contextmanager
def attention_probe(model: PreTrainedModel, callback: Callable[..., None]) -> Iterator[PreTrainedModel]:
    """Within the context, every attention call of ``model`` first calls
    ``callback(module, query, key, value, attention_mask)`` and then computes dense sdpa attention."""
    _check_model(model)

    def probe(module, query, key, value, attention_mask, **kwargs):
        callback(module, query, key, value, attention_mask)
        return dense_attention(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(_PROBE_NAME, probe)
    previous = model.config._attn_implementation
    model.set_attn_implementation(_PROBE_NAME)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


def dense_copy_config(model: PreTrainedModel) -> Any:
    """A deep copy of the model's config (for building a dense twin in tests and reports)."""
    return copy.deepcopy(model.config)
