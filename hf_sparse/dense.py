"""The dense path: exactly what ``attn_implementation="sdpa"`` computes (short inputs, dense layers, dense
selections), or what ``"eager"`` computes for models that pass softcapping or attention sinks, plus what the dense
path needs of hf_sparse's features (int8 K/V, logN scaling)."""
from __future__ import annotations

from typing import Any

import torch
from transformers.integrations.sdpa_attention import repeat_kv

from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

from . import kernels
from .padding import holds_no_padding, padding_layout


#: Keyword arguments dense_attention computes itself rather than pass to sdpa: softcap, sinks, sliding window.
NOT_FOR_SDPA = frozenset(("softcap", "s_aux", "sliding_window"))


def dense_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Exactly what attn_implementation="sdpa" computes for the same inputs (same mask, same call); a
    ``sliding_window`` layer gets transformers' sliding-window causal mask over the keys it is given.

    A model that passes ``softcap`` (Gemma 2) or ``s_aux`` (GPT-OSS's sinks) gets :func:`eager_attention` with
    transformers' eager mask: sdpa cannot compute either (transformers' sdpa raises on ``softcap`` and ignores
    ``s_aux``), and those models run eager attention by default."""
    softcap = sinks = window = None
    if kwargs and not NOT_FOR_SDPA.isdisjoint(kwargs):
        softcap, sinks, window = kwargs.pop("softcap", None), kwargs.pop("s_aux", None), kwargs.pop("sliding_window", None)
    eager = softcap is not None or sinks is not None
    batch, num_queries, key_length = query.shape[0], query.shape[2], key.shape[2]
    if (not eager and window is None and (num_queries == 1 or num_queries == key_length)
            and not torch.compiler.is_compiling()):
        if attention_mask is not None and attention_mask.dim() == 2:
            # A mask without padding: the memoised layout says so without a host read per layer.
            if holds_no_padding(attention_mask, key_length, query.device):
                attention_mask = None
        if attention_mask is None:
            # sdpa_mask would return None here (sdpa's is_causal); called straight (a short prefill is bound by
            # the host's time per layer).
            return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs)
    shape = {} if window is None else {"mask_function": sliding_window_causal_mask_function(window),
                                       "local_size": window}
    if attention_mask is None or attention_mask.dim() == 2:
        attention_mask = sdpa_mask(
            batch_size=batch, q_length=num_queries, kv_length=key_length, q_offset=key_length - num_queries,
            kv_offset=0, attention_mask=attention_mask, device=query.device, allow_is_causal_skip=not eager, **shape,
        )
    if eager:
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            # transformers' eager mask: 0 where attended, the dtype's minimum elsewhere
            attention_mask = torch.where(attention_mask, torch.zeros((), device=query.device, dtype=query.dtype),
                                         torch.finfo(query.dtype).min)
        return eager_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                               softcap=softcap, sinks=sinks)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def eager_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
    """transformers' eager attention, op for op: Gemma 2's softcapping (``models/gemma2``: the scaled scores
    capped, ``tanh(s / softcap) * softcap``, before the additive mask; softmax in float32) and GPT-OSS's sinks
    (``models/gpt_oss``: a column of the sink logits appended to the masked scores, the row maximum subtracted,
    softmax in the scores' dtype, the sink column dropped). Returns ``(output [B, Sq, Hq, Dv], None)``."""
    group = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, group), repeat_kv(value, group)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        weights = torch.tanh(weights / softcap) * softcap
    if attention_mask is not None:
        weights = weights + attention_mask
    if sinks is None:
        probs = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    else:
        sink = sinks.reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[2], -1)
        combined = torch.cat([weights, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training).to(value.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


def dequantized_kv(key: torch.Tensor, value: torch.Tensor, cache_layer: Any,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 cache layer's K/V in ``dtype`` (values token-major): a copy, for the dense fallback of calls that
    read the int8 storage (decode and continuation prefills; a first prefill attends over its states as given)."""
    value = kernels.reference.token_values(value, key.shape[2])
    return (kernels.reference.dequantize_per_token(key, cache_layer.key_scales).to(dtype),
            kernels.reference.dequantize_per_token(value, cache_layer.value_scales).to(dtype))


def logn_base_for(config: Any, model_config: Any) -> int | None:
    """The training length ``m`` of logN scaling, or None when the method's config leaves it off."""
    if not getattr(config, "logn_scaling", False):
        return None
    base = config.logn_base or getattr(model_config, "max_position_embeddings", None)
    if base is None:
        raise ValueError("logn_scaling=True needs logn_base (the training length): the model config has no "
                         "max_position_embeddings to default to")
    return int(base)


def logn_scaled(query: torch.Tensor, attention_mask: torch.Tensor | None, key_length: int, logn_base: int,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``query`` times Qwen's logN factor of each query's position: ``position_ids`` (0-based, ``[B or 1, Sq]``)
    when given, else the row positions of the padding mask (the dense path's logN)."""
    batch, _, num_queries, _ = query.shape
    if position_ids is None:
        kv_start = padding_layout(attention_mask, batch, key_length, query.device, validate=False).starts
        slots = key_length - num_queries + torch.arange(num_queries, device=query.device)
        position_ids = slots[None, :] - kv_start[:, None]
    elif position_ids.shape[-1] != num_queries:
        raise ValueError(f"position_ids {tuple(position_ids.shape)} do not match the {num_queries} queries")
    factor = kernels.reference.logn_factors(position_ids.to(query.device), logn_base)
    return (query.float() * factor.reshape(-1, 1, num_queries, 1)).to(query.dtype)
