"""The attention function behind attn_implementation="plas" / "xattn": prefill/decode dispatch, dense or sparse.

Its parts live beside it: the padding layout (``padding.py``), the dense path (``dense.py``), the density fallback
(``density.py``), recording (``recording.py``); the methods select blocks (``methods/``), the kernels attend."""
from __future__ import annotations

import contextvars
import functools
import logging
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from . import kernels
from .cache import DECODE_MAX_QUERY, LAYER_ATTR
from .config import config_value, method_config, stored_config
from .dense import dense_attention, dequantized_kv, logn_base_for, logn_scaled
from . import density
from .density import PROBE_QUERIES, block_counts, falls_back_by_density, selection_density
from .gates import get_gate_weight
from .methods import METHODS
from .padding import holds_no_padding, padding_layout
from .recording import LayerRecord, record, recording
from .selection import BlockSelection, RowLayout

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def call_phase(num_queries: int, key_length: int) -> str:
    """``"decode"`` for a call of at most :data:`DECODE_MAX_QUERY` queries with a past, else ``"prefill"``."""
    return "decode" if num_queries <= DECODE_MAX_QUERY and key_length > num_queries else "prefill"

def _summaries(key: torch.Tensor, cache_layer: Any, gate: torch.Tensor | None, rows: RowLayout,
               block_size: int, dtype: torch.dtype, num_queries: int) -> torch.Tensor:
    """Block summaries of a call's keys: those the SparseCache layer keeps when its blocks are the method's,
    else computed (an int8 cache's keys dequantised to ``dtype`` by the summary op). A sequence's first call
    (a prefill: its queries are all the cache holds) with no summaries kept computes them for itself alone: the
    cache makes its storage at the first decode step (``SparseCacheLayer._summary_buffer``), so the prefill's
    peak memory holds no summaries of earlier layers."""
    if cache_layer is not None and cache_layer.block_size == block_size:
        if cache_layer.summary_storage is not None or num_queries != cache_layer.length:
            return cache_layer.block_summaries(gate, rows)
        if cache_layer.row_layout is None:
            cache_layer.set_padding(rows)
    if getattr(cache_layer, "quantized", False):
        return kernels.block_summaries(key, gate, rows, block_size, key_scale=cache_layer.key_scales, dtype=dtype)
    return kernels.block_summaries(key, gate, rows, block_size)


# -- rows nothing reads ---------------------------------------------------------------------------------------
@dataclass
class ReadRows:
    """What a running forward's caller reads of its last decoder layer: the last ``rows`` positions (generate()'s
    forwards keep those positions' logits only and, without hidden states or attentions asked for, read nothing else
    of that layer: its keys and values, which the cache keeps, come from its input); ``sparse`` turns True once a
    layer of the forward attends sparsely (its output then differs from sdpa's by more than rounding)."""

    rows: int
    sparse: bool = False


#: The :class:`ReadRows` of the running forward, set around each generate() forward by ``integration``'s hook;
#: None otherwise (every row is read).
LAST_LAYER_ROWS: contextvars.ContextVar[ReadRows | None] = contextvars.ContextVar("hf_sparse_last_layer_rows",
                                                                                  default=None)


def read_rows(config: Any, module: torch.nn.Module, num_queries: int) -> int | None:
    """How many trailing query rows of this call its caller reads, where that is fewer than the call has and
    computing only those changes nothing but rounding that already differs from sdpa's: the last decoder layer of a
    forward under :data:`LAST_LAYER_ROWS` in which an earlier layer attended sparsely, with the config's
    ``trim_last_layer`` on. Else None (every row: a forward that ran dense throughout stays equal to sdpa's)."""
    state = LAST_LAYER_ROWS.get()
    if state is None or not state.sparse or state.rows >= num_queries or not getattr(config, "trim_last_layer", False):
        return None
    layer_idx = getattr(module, "layer_idx", None)
    if layer_idx is None or layer_idx != config_value(module.config, "num_hidden_layers", -1) - 1:
        return None
    return state.rows


def last_rows_dense(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, rows: int, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """:func:`~hf_sparse.dense.dense_attention` of the last ``rows`` queries (over every key, causally), in an output
    of every row whose other rows are zero: what a last layer returns when its caller reads those rows only."""
    part, _ = dense_attention(module, query[:, :, -rows:], key, value, attention_mask, **kwargs)
    out = part.new_zeros(part.shape[0], query.shape[2], *part.shape[2:])
    out[:, -rows:] = part
    return out, None


# -- the attention function ----------------------------------------------------------------------------------
#: What models pass through the attention interface that only some implementations compute, by argument name.
FEATURES = {"softcap": "attention logit softcapping", "s_aux": "attention sinks", "position_bias": "a position bias"}
#: The FEATURES the "plas" and "xattn" attention compute (Gemma 2's softcapping, GPT-OSS's sinks).
SPARSE_FEATURES = ("softcap", "s_aux")


def check_supported(kwargs: dict[str, Any], key_length: int, windows: bool = False,
                    computed: tuple[str, ...] = (), implementation: str = "hf_sparse") -> None:
    """Raise a clear error for what a model passes that ``implementation`` does not compute: arguments of
    :data:`FEATURES` not in ``computed``, and sliding-window layers longer than their window unless ``windows``
    (the caller runs them dense inside their window)."""
    if kwargs.get("output_attentions"):
        raise ValueError(
            "hf_sparse attention does not return attention weights: output_attentions=True is unsupported; "
            "load the model with attn_implementation='eager' to inspect attention"
        )
    for name, feature in FEATURES.items():
        if name not in computed and kwargs.get(name) is not None:
            others = "; attn_implementation='plas' and 'xattn' compute it" if name in SPARSE_FEATURES else ""
            raise NotImplementedError(f"{implementation} attention does not support `{name}` ({feature}), which this "
                                      f"model passes{others}")
    window = kwargs.get("sliding_window")
    if window is not None and key_length > window and not windows:
        raise NotImplementedError(
            f"hf_sparse attention does not support sliding-window layers (window {window} < {key_length} tokens)"
        )


#: Keyword arguments that take a call off :func:`known_dense_prefill`'s path when set (a feature to compute or refuse).
_UNUSUAL_KWARGS = frozenset(FEATURES) | {"output_attentions", "sliding_window"}


def asks_more_than_sdpa(kwargs: dict[str, Any]) -> bool:
    """Whether a call's keyword arguments set any of :data:`_UNUSUAL_KWARGS` (a feature to compute or refuse, a
    window): such a call is not decided dense from shapes alone. Most calls pass none of them: one set test."""
    return not _UNUSUAL_KWARGS.isdisjoint(kwargs) and any(kwargs.get(name) is not None for name in _UNUSUAL_KWARGS)


#: :func:`known_dense_prefill`'s reasons that hold for every layer of a forward (its shapes and configuration
#: alone), so that its later layers may reuse the first layer's decision (:func:`decided_dense`).
FORWARD_WIDE = ("length", "floor")


def known_dense_prefill(config: Any, method: str, module: torch.nn.Module, num_queries: int, key_length: int,
                        query: torch.Tensor, cache_layer: Any, kwargs: dict[str, Any]) -> str | None:
    """Why a call is a prefill that runs sdpa's dense attention whatever its keys hold, known from the shapes
    and the configuration alone: ``"length"`` (shorter than ``dense_below``), ``"layer"`` (a ``dense_layers``
    layer) or ``"floor"`` (where the density fallback applies, the method's sparsest possible selection already
    reaches the density threshold: its ``density_floor``, PLAS at head dim 64 up to about 16K tokens, XAttention's
    scoring at head dim 64 up to about 32K); None otherwise. Such a call needs nothing beyond sdpa (no logN, no
    int8 K/V to dequantise, none of :data:`_UNUSUAL_KWARGS`) and is decided in a few host steps: a prefill of
    this size is bound by the host's time per layer, and the decision is to cost next to nothing beside sdpa's
    own call."""
    if (call_phase(num_queries, key_length) != "prefill" or getattr(config, "logn_scaling", False)
            or query.dtype not in SUPPORTED_DTYPES or getattr(cache_layer, "quantized", False)):
        return None
    if asks_more_than_sdpa(kwargs):
        return None
    if key_length < config.dense_threshold("prefill"):
        return "length"
    layer_idx = getattr(module, "layer_idx", 0)
    if config.dense_layers and config.is_dense_layer(
            layer_idx, config_value(module.config, "num_hidden_layers", layer_idx + 1)):
        return "layer"
    if (config.dense_above_density is None or not getattr(module, "is_causal", True)
            or not falls_back_by_density(query)):
        return None
    floor, threshold, _ = density.known_floor_and_threshold(METHODS[method], config, num_queries, key_length,
                                                            query.shape[-1])
    return "floor" if floor >= threshold else None


#: The forward whose layers all run sdpa (a :data:`FORWARD_WIDE` decision of its first layer), one tuple replaced
#: whole: (weak reference to the forward's :func:`_forward_marker`; the model config; the method configuration dict
#: it holds; the query shape; the key length; whether sdpa takes the call without a mask, i.e. no padding).
_DENSE_FORWARD: list[tuple] = []


def _forward_marker(attention_mask: torch.Tensor | None, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The tensor that tells one forward's layers from another forward's: its 2D mask, or without a mask its
    ``position_ids`` (transformers makes each once per forward and hands it to every layer); None for anything
    else (a 4D mask, no ``position_ids``)."""
    if attention_mask is not None:
        return attention_mask if attention_mask.dim() == 2 else None
    position_ids = kwargs.get("position_ids")
    return position_ids if isinstance(position_ids, torch.Tensor) else None


def decided_dense(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float, scaling: float | None,
                  kwargs: dict[str, Any]) -> tuple[torch.Tensor, None] | None:
    """The attention of a later layer of a forward whose first layer ran dense for the whole forward
    (:func:`remember_dense_forward`), in the fewest host steps (a prompt of a few thousand tokens is bound by the
    host's time per layer): sdpa straight where the mask holds no padding, else
    :func:`~hf_sparse.dense.dense_attention`. None for any other call (another forward's: its
    :func:`_forward_marker`, model config, method configuration or shapes differ), and while recording (which
    names each layer's reason)."""
    entry = _DENSE_FORWARD[0] if _DENSE_FORWARD else None
    if entry is None:
        return None
    marker = _forward_marker(attention_mask, kwargs)
    config = module.config
    if (marker is None or entry[0]() is not marker or entry[1] is not config or entry[3] != query.shape
            or entry[4] != key.shape[2] or entry[2] is not stored_config(config) or recording()
            or asks_more_than_sdpa(kwargs)):
        return None
    if entry[5]:
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs)
    return dense_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def remember_dense_forward(module: torch.nn.Module, query: torch.Tensor, key_length: int,
                           attention_mask: torch.Tensor | None, kwargs: dict[str, Any]) -> None:
    """Keep a first layer's forward-wide dense decision for the forward's later layers (:func:`decided_dense`),
    where the forward has a :func:`_forward_marker`. The caller has decided from the shapes and the configuration
    alone that a plain sdpa call is every layer's attention."""
    marker = _forward_marker(attention_mask, kwargs)
    if marker is None or torch.compiler.is_compiling():
        _DENSE_FORWARD.clear()
        return
    unmasked = attention_mask is None or (query.shape[2] == key_length
                                          and holds_no_padding(attention_mask, key_length, query.device))
    _DENSE_FORWARD[:] = [(weakref.ref(marker), module.config, stored_config(module.config), query.shape, key_length,
                          unmasked)]


def softcap_and_sinks(kwargs: dict[str, Any], query: torch.Tensor) -> dict[str, Any]:
    """The kernels' ``softcap`` and ``sinks`` arguments from what the model passed (``softcap``; ``s_aux``, one
    logit per query head), validated; empty when the model passes neither."""
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    if softcap is None and sinks is None:
        return {}
    kernels.reference.check_softcap_and_sinks(softcap, sinks, query)
    return {name: value for name, value in (("softcap", softcap), ("sinks", sinks)) if value is not None}


def static_decode(phase: str, cache_layer: Any, block_size: int, query: torch.Tensor) -> bool:
    """Whether a call reads the key length on the device: decode over a static :class:`~hf_sparse.SparseCache`
    layer (float or int8 K/V) of the method's ``block_size`` on the Triton path. Such a call depends on no host
    length, so it replays correctly under a CUDA graph (PLAS reads nothing back to the host; XAttention's
    selection is device-side torch ops plus the threshold kernel; Star's global decode and every dense layer
    attend to all blocks, :func:`all_blocks_decode`)."""
    return (phase == "decode" and cache_layer is not None and getattr(cache_layer, "static", False)
            and cache_layer.row_layout is not None and cache_layer.block_size == block_size
            and kernels.backend_for(query) == "triton")


def static_scales(cache_layer: Any) -> dict[str, torch.Tensor]:
    """The int8 scales of a static layer's whole storage as kernel arguments (none for float storage)."""
    if not cache_layer.quantized:
        return {}
    return {"key_scale": cache_layer.key_scale_storage, "value_scale": cache_layer.value_scale_storage}


_ALL_BLOCKS: dict[tuple[torch.device, int], torch.Tensor] = {}


def all_blocks_selection(cache_layer: Any, kv_heads: int, num_queries: int) -> BlockSelection:
    """Every valid block of each row of a static layer, counted on the device (dense decode with the sparse
    kernel, CUDA-graph safe): in a captured step the layer's append wrote the counts (no launch here), else
    they are computed from its device length."""
    block_size = cache_layer.block_size
    num_blocks = cache_layer.capacity // block_size
    device = cache_layer.device_length.device
    ids = _ALL_BLOCKS.get((device, num_blocks))
    if ids is None:
        ids = _ALL_BLOCKS[(device, num_blocks)] = torch.arange(num_blocks, dtype=torch.int32, device=device)
    starts = cache_layer.row_layout.starts
    counts = cache_layer.valid_blocks
    if counts is None:
        counts = kernels.reference.valid_blocks(cache_layer.device_length, starts, block_size).to(torch.int32)
    return BlockSelection(indices=ids.expand(starts.shape[0], kv_heads, 1, num_blocks),
                          counts=counts[:, None, None].expand(starts.shape[0], kv_heads, 1),
                          block_size=block_size, query_tile=num_queries)


def all_blocks_decode(query: torch.Tensor, cache_layer: Any, scale: float, logn_base: int | None,
                      extras: dict[str, Any]) -> torch.Tensor:
    """Decode queries ``[B, Hq, Sq, D]`` over every valid block of a static layer (lengths read on the device), as
    ``[B, Sq, Hq, Dv]``: a dense layer's or Star's global decode step under a CUDA graph (sdpa would take the
    host's length, which a graph cannot replay). ``extras``: the kernels' softcap / sinks."""
    selection = all_blocks_selection(cache_layer, cache_layer.key_storage.shape[1], query.shape[2])
    output, _ = kernels.sparse_attention(query, cache_layer.key_storage, cache_layer.value_storage, selection,
                                         scale=scale, q_offset=0, kv_start=cache_layer.row_layout,
                                         logn_base=logn_base, length=cache_layer.device_length,
                                         **static_scales(cache_layer), **extras)
    return output.transpose(1, 2).contiguous()


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
    """Block-sparse attention with ``method``'s selection: dense below ``dense_below``, on ``dense_layers`` and
    (on CUDA) for dense selections; block-sparse otherwise.

    Gemma 2's ``softcap`` and GPT-OSS's sinks (``s_aux``) are computed as transformers' eager attention computes
    them: the dense path is eager's math (:func:`~hf_sparse.dense.eager_attention`); the sparse kernels cap the
    scaled scores and rescale the output by the sinks (``kernels.reference.sparse_attention``); the selection
    sees the cap where it thresholds a softmax mass (XAttention; see the methods)."""
    key_length = key.shape[2]
    # The common prompt that runs dense in every layer: the first layer decides for the forward, the later ones
    # look it up.
    decided = decided_dense(module, query, key, value, attention_mask, dropout, scaling, kwargs)
    if decided is not None:
        return decided
    num_queries = query.shape[2]
    config = method_config(module.config, method)
    cache_layer = getattr(key, LAYER_ATTR, None)
    rows_read = read_rows(config, module, num_queries)
    if not recording() and rows_read is None:
        known = known_dense_prefill(config, method, module, num_queries, key_length, query, cache_layer, kwargs)
        if known is not None:
            if known in FORWARD_WIDE:
                remember_dense_forward(module, query, key_length, attention_mask, kwargs)
            return dense_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                   **kwargs)
    if cache_layer is not None and cache_layer.row_layout is None and cache_layer.static:
        # A static cache's layers keep the padding layout for their decode (a prefill decided dense above leaves
        # it to the first decode step, whose mask holds the same padding).
        cache_layer.set_padding(padding_layout(attention_mask, query.shape[0], key_length, query.device,
                                               validate=False))
    batch, head_dim = query.shape[0], query.shape[-1]
    check_supported(kwargs, key_length, windows=True, computed=SPARSE_FEATURES, implementation=method)
    if query.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"hf_sparse attention supports float32/float16/bfloat16, got {query.dtype}")
    extras = softcap_and_sinks(kwargs, query)  # softcap / sinks for the kernels
    layer_idx = getattr(module, "layer_idx", 0)
    phase = call_phase(num_queries, key_length)
    logn_base = logn_base_for(config, module.config)
    quantized = cache_layer is not None and getattr(cache_layer, "quantized", False)

    scale = scaling if scaling is not None else 1.0 / math.sqrt(head_dim)
    # A sliding-window layer attends inside its window, dense, exactly as transformers' sdpa path (on the host's
    # length: models with such layers decode without CUDA graphs, graphs.window_layers).
    window = kwargs.get("sliding_window")
    on_device = window is None and static_decode(phase, cache_layer, config.block_size, query)
    below = key_length < config.dense_threshold(phase)
    dense_layer = config.is_dense_layer(layer_idx, getattr(module.config, "num_hidden_layers", layer_idx + 1))
    if on_device and (below or dense_layer):
        # A dense layer, or a short sequence, in a static decode step: every valid block through the decode kernel.
        if recording():
            record(LayerRecord(layer_idx, phase, f"length {key_length} < dense_below" if below else "dense_layers"))
        return all_blocks_decode(query, cache_layer, scale, logn_base, extras), None

    reason = None
    if window is not None:
        reason = f"sliding window of {window} tokens"
    elif dense_layer:
        reason = "dense_layers"
    elif below:
        reason = functools.partial("length {} < dense_below {}".format, key_length, config.dense_threshold(phase))
    elif not getattr(module, "is_causal", True):
        raise NotImplementedError("hf_sparse attention supports causal (decoder) attention only")

    def run_dense(reason: str | Callable[[], str]) -> tuple[torch.Tensor, None]:
        # (a reason is formatted only where it is read: a short prefill is bound by the host's time per layer)
        if recording() or logger.isEnabledFor(logging.DEBUG):
            reason = reason if isinstance(reason, str) else reason()
            logger.debug("layer %d %s: dense (%s)", layer_idx, phase, reason)
            if recording():
                record(LayerRecord(layer_idx, phase, reason))
        dense_query = query if logn_base is None else logn_scaled(query, attention_mask, key_length, logn_base)
        dense_key, dense_value = dequantized_kv(key, value, cache_layer, query.dtype) if quantized else (key, value)
        if rows_read is not None and phase == "prefill":
            # the last layer of a sparse prefill whose caller reads only its last rows (generate(): the next token)
            return last_rows_dense(module, dense_query, dense_key, dense_value, attention_mask, rows_read,
                                   dropout=dropout, scaling=scaling, **kwargs)
        return dense_attention(module, dense_query, dense_key, dense_value, attention_mask, dropout=dropout,
                               scaling=scaling, **kwargs)

    if reason is not None:
        return run_dense(reason)

    if dropout:
        raise NotImplementedError("hf_sparse sparse attention does not support attention dropout (use model.eval())")
    q_offset = key_length - num_queries
    if phase == "decode" and cache_layer is not None and cache_layer.row_layout is not None:
        rows = cache_layer.row_layout  # the layout taken from the mask when the sequence started
    else:
        rows = padding_layout(attention_mask, batch, key_length, query.device, validate=phase == "prefill")
    gate = get_gate_weight(module)
    if gate is not None and tuple(gate.shape) != (key.shape[1], config.block_size, head_dim):
        raise ValueError(
            f"layer {layer_idx}: gate weight shape {tuple(gate.shape)} does not match "
            f"[kv_heads={key.shape[1]}, block_size={config.block_size}, head_dim={head_dim}]"
        )
    scales = {}
    if quantized:
        if cache_layer.row_layout is None:  # the sequence's padding picks the int8 values' layout (SparseCacheLayer)
            cache_layer.set_padding(rows)
        value = cache_layer.values  # in the layout now kept
        scales = {"key_scale": cache_layer.key_scales, "value_scale": cache_layer.value_scales}
    # Blocks and query tiles are counted per row from its first valid slot (see kernels.reference). Selection
    # sees the unscaled queries: logN scales each query's logits by one positive factor, which keeps their order.
    policy = METHODS[method](config)
    select = functools.partial(policy.select_decode if phase == "decode" else policy.select_prefill,
                               softcap=extras.get("softcap"))
    falls_back = phase == "prefill" and config.dense_above_density is not None and falls_back_by_density(query)
    if falls_back:
        floor, threshold, share = density.known_floor_and_threshold(METHODS[method], config, num_queries,
                                                                    key_length, head_dim)
        if floor >= threshold:
            return run_dense(lambda: f"the sparsest selection keeps {floor:.3f} >= {threshold:.3f} (dense_above_"
                             f"density {config.dense_above_density} less the selection, {share:.2f} of dense attention)")
        known = density.recall(module, config, key_length, num_queries) if config.density_memory else None
        if known is not None:
            if known.dense:
                return run_dense(lambda: f"{known.reason}; remembered for this length")
            falls_back = False  # remembered sparse: no probe, no density read
    # Summaries only now: a layer decided dense above computes none (a later call summarises what it needs).
    device_length = {}
    if on_device:  # static storage and lengths read on the device (CUDA-graph safe)
        key, value = cache_layer.key_storage, cache_layer.value_storage
        device_length = {"length": cache_layer.device_length}
        scales = static_scales(cache_layer)
        cache_layer.summarize_full_blocks(gate, num_queries)  # those a dense prefill left
        summaries = cache_layer.recent_block_summaries(gate, num_queries)
    else:
        summaries = _summaries(key, cache_layer, gate, rows, config.block_size, query.dtype, num_queries)
    if falls_back and num_queries >= 4 * PROBE_QUERIES:
        def select_run(run_query, run_key, run_key_scale, run_offset):
            return select(run_query, summaries, run_key, scale=scale, q_offset=run_offset, kv_start=rows,
                          key_scale=run_key_scale, probe=True)

        probe_density = density.probe_density(select_run, query, key, scales.get("key_scale"), q_offset, rows,
                                              PROBE_QUERIES, config.block_size)
        if probe_density >= threshold:
            reason = (f"probe density {probe_density:.3f} ({PROBE_QUERIES} queries in {density.PROBE_RUNS} runs) "
                      f">= {threshold:.3f} "
                      f"(dense_above_density {config.dense_above_density} less the selection still to run, "
                      f"{share:.2f} of dense attention)")
            if config.density_memory:
                density.remember(module, config, key_length, num_queries, True, reason)
            return run_dense(reason)
    selection = select(query, summaries, key, scale=scale, q_offset=q_offset, kv_start=rows,
                       key_scale=scales.get("key_scale"), **device_length)
    if falls_back:
        selected = selection_density(selection, num_queries, q_offset, rows)
        dense = selected >= config.dense_above_density
        reason = f"density {selected:.3f} >= dense_above_density {config.dense_above_density}" if dense else ""
        if config.density_memory:
            density.remember(module, config, key_length, num_queries, dense, reason)
        if dense:
            return run_dense(reason)
    output, _ = kernels.sparse_attention(query, key, value, selection, scale=scale, q_offset=q_offset, kv_start=rows,
                                         logn_base=logn_base, **scales, **device_length, **extras)
    read = LAST_LAYER_ROWS.get()
    if read is not None:
        read.sparse = True
    if recording():
        attended, causal = block_counts(selection, num_queries, q_offset, rows)
        record(LayerRecord(layer_idx, phase, None, attended, causal, selection, (query, key, value, rows.starts)))
    return output.transpose(1, 2).contiguous(), None
