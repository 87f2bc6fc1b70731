"""The attention function behind attn_implementation="plas": dense/sparse dispatch, prefill/decode dispatch."""
from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from . import kernels
from .cache import LAYER_ATTR
from .config import CONFIG_KEY, config_from_dict
from .gates import get_gate_weight
from .methods import METHODS
from .selection import BlockSelection

logger = logging.getLogger(__name__)

#: Calls with at most this many queries and a non-empty past run the decode path (one selection per
#: GQA group shared by all queries of the call: plain, assisted and speculative decoding).
DECODE_MAX_QUERY = 16

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: Where the density fallback applies, a prefill of at least ``4 * PROBE_QUERIES`` queries first selects for its
#: last ``PROBE_QUERIES`` only, a cheap estimate of the call's density (those queries see the most blocks; on
#: SmolLM2's text they read above the full selection at 128K and below it at 32K, docs/benchmarks.md "Late run",
#: so a sparse probe is followed by the full selection's own check). The selection for the rest is still to be
#: paid at the probe, so it runs the call dense from a lower density: :func:`probe_threshold`.
PROBE_QUERIES = 1024


def probe_threshold(dense_above_density: float, selection_share: float) -> float:
    """Probe density from which a prefill runs dense: where the sparse kernel plus the selection still to run
    cost what dense attention costs. Sparse attention time grows about in proportion to the density and
    matches dense at ``dense_above_density``; the selection adds ``selection_share`` of the dense time."""
    return dense_above_density * max(0.0, 1.0 - selection_share)


@functools.lru_cache(maxsize=64)
def _parse_config(serialized: str, method: str) -> Any:
    return config_from_dict(json.loads(serialized), default_method=method)


#: Last parse per model config: (its stored dict as parsed, method, config). Every attention call asks, so
#: an unchanged dict is answered by one comparison, not a re-serialisation.
_LAST_PARSED: dict[int, tuple[dict, str, Any]] = {}


def method_config(model_config: Any, method: str = "plas") -> Any:
    """The configuration of ``method`` stored in a model's config (its defaults when none, or another
    method's, is attached)."""
    stored = getattr(model_config, CONFIG_KEY, None)
    if not stored or stored.get("method", "plas") != method:
        return _parse_config("{}", method)
    last = _LAST_PARSED.get(id(model_config))
    if last is not None and last[1] == method and last[0] == stored:
        return last[2]
    config = _parse_config(json.dumps(stored, sort_keys=True), method)
    _LAST_PARSED[id(model_config)] = (copy.deepcopy(stored), method, config)
    return config


# -- sparsity recording ------------------------------------------------------------------------------------
@dataclass
class LayerRecord:
    """What one attention call did: phase, dense reason (or None when sparse), block counts."""

    layer_idx: int
    phase: str
    dense_reason: str | None
    attended_blocks: torch.Tensor | None = None   # scalar tensors, summed over (batch, head, tile)
    causal_blocks: torch.Tensor | None = None
    selection: BlockSelection | None = None
    inputs: tuple[torch.Tensor, ...] | None = None


@dataclass
class SparsityRecorder:
    """Collects a :class:`LayerRecord` per attention call inside :func:`record_sparsity`."""

    keep_inputs: bool = False
    records: list[LayerRecord] = field(default_factory=list)

    def density(self, phase: str | None = None) -> float:
        """Attended / causal key blocks over the sparse calls of ``phase`` (dense calls count as 1.0)."""
        attended = causal = 0.0
        for rec in self.records:
            if phase is not None and rec.phase != phase:
                continue
            if rec.dense_reason is not None:
                continue
            attended += float(rec.attended_blocks)
            causal += float(rec.causal_blocks)
        return attended / causal if causal else 1.0

    def dense_layers(self, phase: str | None = None) -> dict[int, str]:
        """Layers that ran dense, with the reason."""
        return {r.layer_idx: r.dense_reason for r in self.records
                if r.dense_reason is not None and (phase is None or r.phase == phase)}


_RECORDERS: list[SparsityRecorder] = []


@contextlib.contextmanager
def record_sparsity(keep_inputs: bool = False) -> Iterator[SparsityRecorder]:
    """Record what every hf_sparse attention call does while the context is open."""
    recorder = SparsityRecorder(keep_inputs=keep_inputs)
    _RECORDERS.append(recorder)
    try:
        yield recorder
    finally:
        _RECORDERS.remove(recorder)


def _record(rec: LayerRecord) -> None:
    for recorder in _RECORDERS:
        if not recorder.keep_inputs:
            rec = LayerRecord(rec.layer_idx, rec.phase, rec.dense_reason, rec.attended_blocks, rec.causal_blocks)
        recorder.records.append(rec)


def _block_counts(selection: BlockSelection, num_queries: int, q_offset: int, kv_start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(attended, causal) block totals; causal = row blocks up to each tile's last real query."""
    pad_q = (kv_start - q_offset).clamp(0, num_queries)
    tiles = torch.arange(selection.num_query_tiles, device=kv_start.device)
    last_query = torch.minimum(pad_q[:, None] + (tiles[None, :] + 1) * selection.query_tile,
                               torch.full_like(pad_q[:, None], num_queries)) - 1
    has_query = last_query >= pad_q[:, None] + tiles[None, :] * selection.query_tile
    last_block = torch.div(q_offset + last_query - kv_start[:, None], selection.block_size, rounding_mode="floor")
    causal = torch.where(has_query, last_block + 1, torch.zeros_like(last_block)).clamp_min(0)
    return selection.counts.sum(), causal.sum() * selection.num_heads


def _summaries(key: torch.Tensor, cache_layer: Any, gate: torch.Tensor | None, kv_start: torch.Tensor,
               block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Block summaries of a call's keys: those the SparseCache layer keeps when its blocks are the method's,
    else computed (an int8 cache's keys dequantised to ``dtype`` by the summary op)."""
    if cache_layer is not None and cache_layer.block_size == block_size:
        return cache_layer.block_summaries(gate, kv_start)
    if getattr(cache_layer, "quantized", False):
        return kernels.block_summaries(key, gate, kv_start, block_size, key_scale=cache_layer.key_scales, dtype=dtype)
    return kernels.block_summaries(key, gate, kv_start, block_size)


def _density(selection: BlockSelection, num_queries: int, q_offset: int, kv_start: torch.Tensor) -> float:
    """Attended / causal blocks of a selection (one device-to-host read)."""
    attended, causal = torch.stack(_block_counts(selection, num_queries, q_offset, kv_start)).tolist()
    return attended / max(causal, 1)


# -- the attention function ----------------------------------------------------------------------------------
def _unsupported(kwargs: dict[str, Any], key_length: int) -> None:
    if kwargs.get("output_attentions"):
        raise ValueError(
            "hf_sparse attention does not return attention weights: output_attentions=True is unsupported; "
            "load the model with attn_implementation='eager' to inspect attention"
        )
    for name in ("softcap", "s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"hf_sparse attention does not support `{name}` (passed by this model)")
    window = kwargs.get("sliding_window")
    if window is not None and key_length > window:
        raise NotImplementedError(
            f"hf_sparse attention does not support sliding-window layers (window {window} < {key_length} tokens)"
        )


#: The last 2D mask's padding layout, one tuple (mask weakref, key, kv_start, left-padded): every layer of a
#: forward gets the same mask tensor, so its host reads (the left-padding check and kv_start's range) happen
#: once per forward, not once per layer (each read is a host sync, which on small models costs more than the
#: attention). One tuple, replaced whole: threads running other models read either entry, never a mix.
_LAST_LAYOUT: list[tuple] = []


def _mask_layout(attention_mask: torch.Tensor, key_length: int, device: torch.device) -> tuple[torch.Tensor, bool]:
    """(kv_start noted with its range, whether the mask is left padding only) of a 2D mask, memoised on the
    mask tensor (identity and version)."""
    key = (attention_mask._version, key_length, device)
    entry = _LAST_LAYOUT[0] if _LAST_LAYOUT else None
    if entry is None or entry[0]() is not attention_mask or entry[1] != key:
        entry = (weakref.ref(attention_mask), key, *_read_layout(attention_mask, key_length, device))
        _LAST_LAYOUT[:] = [entry]
    return entry[2], entry[3]


def _read_layout(attention_mask: torch.Tensor, key_length: int, device: torch.device) -> tuple[torch.Tensor, bool]:
    """:func:`_mask_layout` without the memo: one host read."""
    mask = attention_mask[:, -key_length:].bool()
    kv_start = key_length - mask.sum(-1)
    left_only = (mask == (torch.arange(key_length, device=mask.device)[None, :] >= kv_start[:, None])).all()
    low, high, left_padded = torch.stack([kv_start.min(), kv_start.max(), left_only.long()]).tolist()
    return kernels.reference.note_range(kv_start.to(device), low, high), bool(left_padded)


def padding_start(attention_mask: torch.Tensor | None, batch: int, key_length: int, device: torch.device,
                  validate: bool) -> torch.Tensor:
    """Per-row count of left-padding slots from the 2D mask (zeros when there is no mask), noted with its
    range (``kernels.reference.note_range``); shared by the layers of a forward, so not to be changed in place."""
    if attention_mask is None:
        return kernels.reference.note_range(torch.zeros(batch, dtype=torch.int64, device=device), 0, 0)
    if attention_mask.dim() != 2:
        raise NotImplementedError(
            f"hf_sparse sparse attention takes the 2D padding mask; got a {attention_mask.dim()}D mask "
            "(custom 4D masks are not supported on the sparse path)"
        )
    kv_start, left_padded = _mask_layout(attention_mask, key_length, device)
    if validate and not left_padded:
        raise ValueError(
            "hf_sparse needs left padding (padding_side='left'): the attention mask has masked slots after "
            "unmasked ones"
        )
    return kv_start


def dense_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Exactly what attn_implementation="sdpa" computes for the same inputs (same mask, same call)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    batch, num_queries, key_length = query.shape[0], query.shape[2], key.shape[2]
    if (attention_mask is not None and attention_mask.dim() == 2 and (num_queries == 1 or num_queries == key_length)
            and not torch.compiler.is_compiling()):
        # sdpa_mask would return None (sdpa's is_causal) for a mask without padding here; the memoised layout
        # answers that without a host read per layer.
        kv_start, left_padded = _mask_layout(attention_mask, key_length, query.device)
        if left_padded and kernels.reference.kv_start_range(kv_start) == (0, 0):
            attention_mask = None
    if attention_mask is None or attention_mask.dim() == 2:
        attention_mask = sdpa_mask(
            batch_size=batch, q_length=num_queries, kv_length=key_length, q_offset=key_length - num_queries,
            kv_offset=0, attention_mask=attention_mask, device=query.device,
        )
    kwargs.pop("sliding_window", None)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def dequantized_kv(key: torch.Tensor, value: torch.Tensor, cache_layer: Any,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 cache layer's K/V in ``dtype`` (values token-major): a copy, for the dense fallback (short
    sequences, few layers)."""
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
        kv_start = padding_start(attention_mask, batch, key_length, query.device, validate=False)
        slots = key_length - num_queries + torch.arange(num_queries, device=query.device)
        position_ids = slots[None, :] - kv_start[:, None]
    elif position_ids.shape[-1] != num_queries:
        raise ValueError(f"position_ids {tuple(position_ids.shape)} do not match the {num_queries} queries")
    factor = kernels.reference.logn_factors(position_ids.to(query.device), logn_base)
    return (query.float() * factor.reshape(-1, 1, num_queries, 1)).to(query.dtype)


def _falls_back_by_density(query: torch.Tensor) -> bool:
    """Whether a dense selection is run dense: on CUDA with the Triton kernels, where dense attention (cuDNN or
    flash) is faster than the sparse kernel at high density. Elsewhere the sparse path always runs, so the
    reference and interpreter paths stay what the tests compare."""
    return query.is_cuda and kernels.backend_for(query) == "triton"


def static_decode(method: str, phase: str, cache_layer: Any, config: Any, query: torch.Tensor) -> bool:
    """Whether a call reads the key length on the device: PLAS or XAttention decode over a static
    :class:`~hf_sparse.SparseCache` layer (float or int8 K/V) on the Triton path. Such a call depends on no host
    length, so it replays correctly under a CUDA graph (PLAS reads nothing back to the host; XAttention's
    selection is device-side torch ops plus the threshold kernel)."""
    return (method in ("plas", "xattn") and phase == "decode" and cache_layer is not None
            and getattr(cache_layer, "static", False)
            and cache_layer.kv_start is not None and cache_layer.block_size == config.block_size
            and kernels.backend_for(query) == "triton")


def static_scales(cache_layer: Any) -> dict[str, torch.Tensor]:
    """The int8 scales of a static layer's whole storage as kernel arguments (none for float storage)."""
    if not cache_layer.quantized:
        return {}
    return {"key_scale": cache_layer.key_scale_storage, "value_scale": cache_layer.value_scale_storage}


_ALL_BLOCKS: dict[tuple[torch.device, int], torch.Tensor] = {}


def all_blocks_selection(cache_layer: Any, kv_heads: int, num_queries: int) -> BlockSelection:
    """Every valid block of each row of a static layer, counted on the device (dense decode with the sparse
    kernel, CUDA-graph safe)."""
    block_size = cache_layer.block_size
    num_blocks = cache_layer.summary_storage.shape[2]
    device = cache_layer.device_length.device
    ids = _ALL_BLOCKS.get((device, num_blocks))
    if ids is None:
        ids = _ALL_BLOCKS[(device, num_blocks)] = torch.arange(num_blocks, dtype=torch.int32, device=device)
    batch = cache_layer.kv_start.shape[0]
    counts = torch.div(cache_layer.device_length - cache_layer.kv_start + block_size - 1, block_size,
                       rounding_mode="floor").clamp_min(0).to(torch.int32)
    return BlockSelection(indices=ids.expand(batch, kv_heads, 1, num_blocks),
                          counts=counts[:, None, None].expand(batch, kv_heads, 1),
                          block_size=block_size, query_tile=num_queries)


def sparse_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    *,
    method: str = "plas",
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Block-sparse attention with ``method``'s selection: dense below ``dense_below`` and on
    ``dense_layers``, block-sparse otherwise."""
    batch, q_heads, num_queries, head_dim = query.shape
    key_length = key.shape[2]
    _unsupported(kwargs, key_length)
    if query.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"hf_sparse attention supports float32/float16/bfloat16, got {query.dtype}")
    config = method_config(module.config, method)
    layer_idx = getattr(module, "layer_idx", 0)
    num_layers = getattr(module.config, "num_hidden_layers", layer_idx + 1)
    phase = "decode" if (num_queries <= DECODE_MAX_QUERY and key_length > num_queries) else "prefill"
    logn_base = logn_base_for(config, module.config)
    cache_layer = getattr(key, LAYER_ATTR, None)
    quantized = cache_layer is not None and getattr(cache_layer, "quantized", False)

    scale = scaling if scaling is not None else 1.0 / math.sqrt(head_dim)
    if getattr(cache_layer, "static", False) and cache_layer.kv_start is None:
        # Every layer of a static cache keeps the padding layout, dense ones too (their decode needs it).
        cache_layer.set_padding(padding_start(attention_mask, batch, key_length, query.device, validate=False))
    on_device = static_decode(method, phase, cache_layer, config, query)
    if on_device and key_length >= config.dense_threshold(phase) and config.is_dense_layer(layer_idx, num_layers):
        # A dense layer of a static decode step: every valid block, through the decode kernel (sdpa would
        # take the host's length).
        if _RECORDERS:
            _record(LayerRecord(layer_idx, phase, "dense_layers"))
        selection = all_blocks_selection(cache_layer, key.shape[1], num_queries)
        output, _ = kernels.sparse_attention(query, cache_layer.key_storage, cache_layer.value_storage, selection,
                                             scale=scale, q_offset=0, kv_start=cache_layer.kv_start,
                                             logn_base=logn_base, length=cache_layer.device_length,
                                             **static_scales(cache_layer))
        return output.transpose(1, 2).contiguous(), None

    reason = None
    if config.is_dense_layer(layer_idx, num_layers):
        reason = "dense_layers"
    elif key_length < config.dense_threshold(phase):
        reason = f"length {key_length} < dense_below {config.dense_threshold(phase)}"
    elif not getattr(module, "is_causal", True):
        raise NotImplementedError("hf_sparse attention supports causal (decoder) attention only")
    def run_dense(reason: str) -> tuple[torch.Tensor, None]:
        logger.debug("layer %d %s: dense (%s)", layer_idx, phase, reason)
        if _RECORDERS:
            _record(LayerRecord(layer_idx, phase, reason))
        dense_query = query if logn_base is None else logn_scaled(query, attention_mask, key_length, logn_base)
        dense_key, dense_value = dequantized_kv(key, value, cache_layer, query.dtype) if quantized else (key, value)
        return dense_attention(module, dense_query, dense_key, dense_value, attention_mask, dropout=dropout,
                               scaling=scaling, **kwargs)

    if reason is not None:
        return run_dense(reason)

    if dropout:
        raise NotImplementedError("hf_sparse sparse attention does not support attention dropout (use model.eval())")
    q_offset = key_length - num_queries
    if phase == "decode" and cache_layer is not None and cache_layer.kv_start is not None:
        kv_start = cache_layer.kv_start  # the layout taken from the mask when the sequence started
    else:
        kv_start = padding_start(attention_mask, batch, key_length, query.device, validate=phase == "prefill")
    gate = get_gate_weight(module)
    if gate is not None and tuple(gate.shape) != (key.shape[1], config.block_size, head_dim):
        raise ValueError(
            f"layer {layer_idx}: gate weight shape {tuple(gate.shape)} does not match "
            f"[kv_heads={key.shape[1]}, block_size={config.block_size}, head_dim={head_dim}]"
        )
    scales = {}
    if quantized:
        if cache_layer.kv_start is None:  # the sequence's padding picks the int8 values' layout (SparseCacheLayer)
            cache_layer.set_padding(kv_start)
        value = cache_layer.values  # in the layout now kept
        scales = {"key_scale": cache_layer.key_scales, "value_scale": cache_layer.value_scales}
    device_length = {}
    if on_device:  # static storage and lengths read on the device (CUDA-graph safe)
        key, value = cache_layer.key_storage, cache_layer.value_storage
        device_length = {"length": cache_layer.device_length}
        scales = static_scales(cache_layer)
        summaries = cache_layer.recent_block_summaries(gate, num_queries)
    else:
        summaries = _summaries(key, cache_layer, gate, kv_start, config.block_size, query.dtype)
    # Blocks and query tiles are counted per row from its first valid slot (see kernels.reference). Selection
    # sees the unscaled queries: logN scales each query's logits by one positive factor, which keeps their order.
    policy = METHODS[method](config)
    select = policy.select_decode if phase == "decode" else policy.select_prefill
    falls_back = phase == "prefill" and config.dense_above_density is not None and _falls_back_by_density(query)
    if falls_back and num_queries >= 4 * PROBE_QUERIES:
        probe_offset = q_offset + num_queries - PROBE_QUERIES
        probe = select(query[:, :, -PROBE_QUERIES:], summaries, key, scale=scale, q_offset=probe_offset,
                       kv_start=kv_start, key_scale=scales.get("key_scale"))
        density = _density(probe, PROBE_QUERIES, probe_offset, kv_start)
        share = policy.selection_share(num_queries, head_dim)
        threshold = probe_threshold(config.dense_above_density, share)
        if density >= threshold:
            return run_dense(f"probe density {density:.3f} (last {PROBE_QUERIES} queries) >= {threshold:.3f} "
                             f"(dense_above_density {config.dense_above_density} less the selection still to "
                             f"run, {share:.2f} of dense attention)")
    selection = select(query, summaries, key, scale=scale, q_offset=q_offset, kv_start=kv_start,
                       key_scale=scales.get("key_scale"), **device_length)
    if falls_back:
        density = _density(selection, num_queries, q_offset, kv_start)
        if density >= config.dense_above_density:
            return run_dense(f"density {density:.3f} >= dense_above_density {config.dense_above_density}")
    output, _ = kernels.sparse_attention(query, key, value, selection, scale=scale, q_offset=q_offset, kv_start=kv_start,
                                         logn_base=logn_base, **scales, **device_length)
    if _RECORDERS:
        attended, causal = _block_counts(selection, num_queries, q_offset, kv_start)
        _record(LayerRecord(layer_idx, phase, None, attended, causal, selection, (query, key, value, kv_start)))
    return output.transpose(1, 2).contiguous(), None
