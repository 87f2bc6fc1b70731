"""The attention function behind attn_implementation="plas" / "xattn": it makes the call's plan and executes it.

Which path a call takes, and why, is decided in ``plan.py`` (its rules in order); here are the paths: dense
(:func:`run_dense`), every block through the decode kernel (:func:`all_blocks_decode`) and sparse
(:func:`run_sparse`). Their parts live beside them: the padding layout (``padding.py``), the dense attention
(``dense.py``), the density fallback's measurements (``density.py``), recording (``recording.py``); the methods
select blocks (``methods/``), the kernels attend.
"""
from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from . import density, kernels, plan
from .cache import DECODE_MAX_QUERY, cache_layer_of
from .config import method_config
from .dense import dense_attention, dequantized_kv, logn_base_for, logn_scaled
from .gates import get_gate_weight, get_key_directions
from .methods import METHODS
from .padding import row_layout
from .plan import ALL_BLOCKS, DENSE, Call, Plan
from .recording import LayerRecord, record, recording
from .selection import BlockSelection, RowLayout

__all__ = ["DECODE_MAX_QUERY", "dense_attention", "method_config", "sparse_attention_forward"]

logger = logging.getLogger(__name__)


def sparse_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             *, method: str = "plas", **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Block-sparse attention with ``method``'s selection, or dense attention where :mod:`hf_sparse.plan` says so.

    Gemma 2's ``softcap`` and GPT-OSS's sinks (``s_aux``) are computed as transformers' eager attention computes
    them: the dense path is eager's math (:func:`~hf_sparse.dense.eager_attention`); the sparse kernels cap the
    scaled scores and rescale the output by the sinks (``kernels.reference.sparse_attention``); the selection
    sees the cap where it thresholds a softmax mass (XAttention; see the methods)."""
    if torch.compiler.is_compiling():  # a compiled model's forward: this call runs eagerly (a graph break)
        return _eager_forward(module, query, key, value, attention_mask, dropout, scaling, method=method, **kwargs)
    requests = plan.packed_requests(attention_mask, kwargs)
    if requests is not None:  # continuous batching: each request as if alone
        return run_packed(module, query, key, value, requests, dropout, scaling, method, kwargs)
    layer = cache_layer_of(key, kwargs)
    unmasked = plan.forward_dense(module, query, key.shape[2], attention_mask, kwargs)
    if unmasked is not None:  # a later layer of a forward that runs dense in every layer
        return forward_dense_attention(module, query, key, value, attention_mask, dropout, scaling, unmasked, kwargs)
    call = Call(method, method_config(module.config, method), module, query, key, attention_mask, layer, kwargs,
                dropout)
    if call.phase == "decode" and getattr(layer, "static", False) and layer.row_layout is None:
        _keep_padding(call)
    decided = plan.plan_call(call)
    if decided.path == DENSE:
        plan.remember_forward(call, decided)
        return run_dense(call, decided, value, scaling)
    if decided.path == ALL_BLOCKS:
        _record_dense(call, decided)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return all_blocks_decode(query, layer, scale, logn_base_for(call.config, module.config),
                                 softcap_and_sinks(kwargs, query)), None
    return run_sparse(call, decided, value, scaling)


def run_packed(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               requests: list[plan.PackedRequest], dropout: float, scaling: float | None, method: str,
               kwargs: dict[str, Any]) -> tuple[torch.Tensor, None]:
    """A packed batch (rule ``packed``) request by request: each request's queries over its own keys through
    :func:`sparse_attention_forward`, as a ``generate()`` of that request alone calls it (its queries the last of
    its keys: a prefill, a prefill chunk or a decode step; no mask, no cache layer), so a short request runs dense
    and a long one sparse by the same rules. Returns ``[1, total_q, Hq, Dv]``; rows of no request stay zero."""
    if query.shape[0] != 1:
        raise ValueError(f"packed requests need a batch of one row, got {query.shape[0]}")
    alone = {name: item for name, item in kwargs.items() if name not in plan.PACKED_KWARGS}
    positions = kwargs.get("position_ids")
    output = query.new_zeros(1, query.shape[2], query.shape[1], value.shape[-1])
    for request in requests:
        if isinstance(positions, torch.Tensor):
            alone["position_ids"] = positions[:, request.queries]
        part, _ = sparse_attention_forward(module, query[:, :, request.queries].contiguous(),
                                           key[:, :, request.keys].contiguous(),
                                           value[:, :, request.keys].contiguous(), None, dropout, scaling,
                                           method=method, **alone)
        output[:, request.queries] = part
    return output, None


def forward_dense_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float, scaling: float | None, unmasked: bool,
                            kwargs: dict[str, Any]) -> tuple[torch.Tensor, None]:
    """A later layer of a forward that runs dense in every layer (:func:`hf_sparse.plan.forward_dense`), in the
    fewest host steps: sdpa straight where the mask holds no padding, else :func:`~hf_sparse.dense.dense_attention`."""
    if unmasked:
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs)
    return dense_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _keep_padding(call: Call) -> None:
    """A static cache layer keeps its sequence's padding layout for the decode steps (with it a step reads its
    lengths on the device, :attr:`~hf_sparse.plan.Call.static`, as a CUDA graph's replays do); a prefill that ran
    dense leaves it to the first decode step, whose mask holds the same padding."""
    mask = call.attention_mask
    rows = None if mask is not None and mask.dim() != 2 else row_layout(mask, call.query.shape[0], call.key_length,
                                                                          call.query.device)
    if rows is not None:  # (a mask that is not left padding runs dense: rules `mask`, `padding`)
        call.layer.set_padding(rows)


@torch.compiler.disable
def _eager_forward(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """:func:`sparse_attention_forward` outside ``torch.compile``'s tracing: the plan reads host values (lengths,
    densities) and the cache keeps host state, which a traced graph would freeze."""
    return sparse_attention_forward(*args, **kwargs)


def _record_dense(call: Call, decided: Plan) -> None:
    """Log a dense call's reason (DEBUG) and hand it to :func:`hf_sparse.record_sparsity`'s recorders."""
    if recording() or logger.isEnabledFor(logging.DEBUG):
        reason = decided.why()
        logger.debug("layer %d %s: dense (%s)", call.layer_idx, call.phase, reason)
        if recording():
            record(LayerRecord(call.layer_idx, call.phase, reason))


# -- the dense path ---------------------------------------------------------------------------------------------
def run_dense(call: Call, decided: Plan, value: torch.Tensor, scaling: float | None) -> tuple[torch.Tensor, None]:
    """sdpa's attention of the call (eager's with softcap / sinks), with logN scaling and int8 K/V dequantised where
    the call has them; only the last ``decided.read_rows`` queries where the caller reads no other."""
    _record_dense(call, decided)
    query, key, kwargs = call.query, call.key, call.kwargs
    logn_base = logn_base_for(call.config, call.module.config)
    if logn_base is not None:
        query = logn_scaled(query, call.attention_mask, call.key_length, logn_base)
    if call.quantized:
        key, value = dequantized_kv(key, value, call.layer, query.dtype)
    if decided.read_rows is not None:
        return last_rows_dense(call.module, query, key, value, call.attention_mask, decided.read_rows,
                               dropout=call.dropout, scaling=scaling, **kwargs)
    return dense_attention(call.module, query, key, value, call.attention_mask, dropout=call.dropout,
                           scaling=scaling, **kwargs)


def last_rows_dense(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, rows: int, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """:func:`~hf_sparse.dense.dense_attention` of the last ``rows`` queries (over every key, causally), in an output
    of every row whose other rows are zero: what a last layer returns when its caller reads those rows only."""
    part, _ = dense_attention(module, query[:, :, -rows:], key, value, attention_mask, **kwargs)
    out = part.new_zeros(part.shape[0], query.shape[2], *part.shape[2:])
    out[:, -rows:] = part
    return out, None


def softcap_and_sinks(kwargs: dict[str, Any], query: torch.Tensor) -> dict[str, Any]:
    """The kernels' ``softcap`` and ``sinks`` arguments from what the model passed (``softcap``; ``s_aux``, one
    logit per query head), validated; empty when the model passes neither."""
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    if softcap is None and sinks is None:
        return {}
    kernels.reference.check_softcap_and_sinks(softcap, sinks, query)
    return {name: value for name, value in (("softcap", softcap), ("sinks", sinks)) if value is not None}


# -- every block through the decode kernel ----------------------------------------------------------------------
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


# -- the sparse path --------------------------------------------------------------------------------------------
def _summaries(call: Call, gate: torch.Tensor | None, rows: RowLayout) -> torch.Tensor:
    """Block summaries of a call's keys: those the SparseCache layer keeps when its blocks are the method's and
    the call's keys are its storage, else computed (int8 keys dequantised to the query's dtype by the summary op).
    A sequence's first call (a prefill: its queries are all the cache holds) with no summaries kept computes them
    for itself alone: the cache makes its storage at the first decode step (``SparseCacheLayer._summary_buffer``),
    so the prefill's peak memory holds no summaries of earlier layers. So does an int8 layer's first prefill,
    which gets its states in the compute dtype, not the storage: its summaries are those a float cache's first
    prefill computes; decode summarises the dequantised int8 keys (``SparseCacheLayer.summarize_full_blocks``)."""
    key, layer, block_size = call.key, call.layer, call.config.block_size
    if layer is not None and layer.block_size == block_size and call.quantized == getattr(layer, "quantized", False):
        if layer.summary_storage is not None or call.num_queries != layer.length:
            return layer.block_summaries(gate, rows)
    if call.quantized:
        return kernels.block_summaries(key, gate, rows, block_size, key_scale=layer.key_scales,
                                       dtype=call.query.dtype)
    return kernels.block_summaries(key, gate, rows, block_size)


def _checked_gate(call: Call) -> torch.Tensor | None:
    """The layer's PLAS gate weight (None: mean pooling), its shape checked against the call's."""
    gate = get_gate_weight(call.module)
    expected = (call.key.shape[1], call.config.block_size, call.query.shape[-1])
    if gate is not None and tuple(gate.shape) != expected:
        raise ValueError(f"layer {call.layer_idx}: gate weight shape {tuple(gate.shape)} does not match "
                         f"[kv_heads={expected[0]}, block_size={expected[1]}, head_dim={expected[2]}]")
    return gate


def _full_rows(selection: BlockSelection, decided: Plan, num_queries: int, q_offset: Any,
               num_blocks: int) -> BlockSelection:
    """The selection with every causal block in the plan's full rows (rows that alone run dense)."""
    if decided.full_rows is None:
        return selection
    last_block = kernels.reference.tile_last_blocks(selection.num_query_tiles, selection.query_tile, num_queries,
                                                    q_offset, decided.rows.starts, selection.block_size)
    return selection.with_full_rows(decided.full_rows, last_block, num_blocks)


def run_sparse(call: Call, decided: Plan, value: torch.Tensor, scaling: float | None) -> tuple[torch.Tensor, None]:
    """The method's block selection, then the sparse kernels; on CUDA the density fallback's two rules
    (:func:`hf_sparse.plan.after_probe`, :func:`hf_sparse.plan.after_selection`) may still send the call, or some of
    its rows, dense."""
    config, query, key, layer, rows = call.config, call.query, call.key, call.layer, decided.rows
    num_queries, key_length = call.num_queries, call.key_length
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    extras = softcap_and_sinks(call.kwargs, query)
    if layer is not None and layer.row_layout is None:
        layer.set_padding(rows)  # the sequence's layout, kept for its decode steps (int8 values laid out for it)
    gate = _checked_gate(call)
    scales = {}
    if call.quantized:
        value = layer.values  # in the layout now kept
        scales = {"key_scale": layer.key_scales, "value_scale": layer.value_scales}
    policy = METHODS[call.method](config)
    decode = call.phase == "decode"
    select = functools.partial(policy.select_decode if decode else policy.select_prefill,
                               softcap=extras.get("softcap"))
    directions = get_key_directions(call.module) if call.method == "plas" and not decode else None
    if directions is not None:  # the layer's key scorer ranks the prefill's blocks (hf_sparse.key_scorer)
        select = functools.partial(select, key_directions=directions)
    q_offset, device_length = key_length - num_queries, {}
    # where full rows count their causal blocks from (on the device in a static decode step)
    full_offset, num_blocks = q_offset, kernels.reference.num_row_blocks(key_length, rows, config.block_size)
    if call.static:  # static storage and lengths read on the device (CUDA-graph safe)
        key, value = layer.key_storage, layer.value_storage
        device_length = {"length": layer.device_length}
        full_offset, num_blocks = layer.device_length - num_queries, layer.capacity // layer.block_size
        scales = static_scales(layer)
        layer.summarize_full_blocks(gate, num_queries)  # those a dense prefill left
        summaries = layer.recent_block_summaries(gate, num_queries)
    else:
        summaries = _summaries(call, gate, rows)
    if decided.probe:
        def select_run(run_query, run_key, run_key_scale, run_offset):
            return select(run_query, summaries, run_key, scale=scale, q_offset=run_offset, kv_start=rows,
                          key_scale=run_key_scale, probe=True, call_length=key_length)

        row_density = density.probe_density(select_run, query, key, scales.get("key_scale"), q_offset, rows,
                                            density.PROBE_QUERIES, config.block_size)
        decided = plan.after_probe(call, decided, row_density)
        if decided.path == DENSE:
            return run_dense(call, decided, value, scaling)
    selection = select(query, summaries, key, scale=scale, q_offset=q_offset, kv_start=rows,
                       key_scale=scales.get("key_scale"), **device_length)
    selection = _full_rows(selection, decided, num_queries, full_offset, num_blocks)
    if decided.measure:
        measured = plan.after_selection(call, decided, density.row_densities(selection, num_queries, q_offset, rows))
        if measured.path == DENSE:
            return run_dense(call, measured, value, scaling)
        if measured.full_rows is not decided.full_rows:
            selection = _full_rows(selection, measured, num_queries, full_offset, num_blocks)
        decided = measured
    output, _ = kernels.sparse_attention(query, key, value, selection, scale=scale, q_offset=q_offset, kv_start=rows,
                                         logn_base=logn_base_for(config, call.module.config), **scales,
                                         **device_length, **extras)
    plan.mark_sparse()
    if recording():
        attended, causal = density.block_counts(selection, num_queries, q_offset, rows)
        record(LayerRecord(call.layer_idx, call.phase, None, attended, causal, selection,
                           (query, key, value, rows.starts)))
    return output.transpose(1, 2).contiguous(), None
