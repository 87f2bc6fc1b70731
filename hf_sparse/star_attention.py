"""Star Attention (attn_implementation="star"): blockwise context encoding with an anchor, then global attention.

Star Attention (Acharya, Jia, Ginsburg, 2024, arXiv:2411.17116) splits the input into a context and a query.

* Phase 1, context encoding: the context is cut into blocks of ``block_size`` tokens; block ``i`` attends causally
  to itself and to the anchor, the first ``anchor_size`` context tokens at their true positions. In one process
  this is a block-sparse prefill with the fixed selection {anchor, own block}: the anchor's KV at every layer
  depends only on the anchor (causal), so attending to the stored block-0 KV is the same as prefixing each block
  with the anchor. Distributed, each rank encodes a contiguous shard of blocks, prefixed with the anchor it
  recomputes itself, and keeps only its shard's KV.
* Phase 2, query and generated tokens attend to everything. In one process that is causal attention over the
  whole cache: sdpa for calls of up to ``DECODE_MAX_QUERY`` tokens (generation), the sparse attention kernel with
  every block selected for a longer query after its context (:func:`_all_blocks_attention`; sdpa where its
  conditions do not hold), and on an int8 ``SparseCache`` the sparse kernels with every block selected for
  generation, which read the int8 K/V. Distributed, each rank computes the partial attention (output and log-sum-exp) of the
  queries over its own KV, the partials are all-gathered and merged by log-sum-exp, so every rank produces the
  same outputs and tokens. Only the last rank keeps the query and generated tokens' KV.

Entry points: :func:`star_attention_forward` (the attention function; for a plain ``generate()`` the last
``StarConfig.query_tokens`` prompt tokens are the query) and :func:`generate` (explicit context/query split, one
process or sharded over the ranks of an initialised ``torch.distributed`` process group).
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from transformers.cache_utils import Cache

from . import distributed, kernels
from . import plan
from .attention import DECODE_MAX_QUERY, all_blocks_decode, forward_dense_attention, method_config
from .dense import NOT_FOR_SDPA, dense_attention, dequantized_kv, logn_base_for, logn_scaled
from .density import block_counts
from .padding import mask_layout, padding_layout, row_layout
from .recording import LayerRecord, record, recording
from .cache import CACHE_KWARG, CACHE_KWARGS, SparseCacheLayer, cache_layer_of, hand_over
from .config import StarConfig
from .methods.star import StarMethod
from .selection import RowLayout

logger = logging.getLogger(__name__)

#: Recorded phase names (``record_sparsity``): context encoding and query/generation.
CONTEXT_PHASE, QUERY_PHASE, GLOBAL = plan.CONTEXT_PHASE, plan.QUERY_PHASE, plan.GLOBAL


@dataclass
class _StarRun:
    """What :func:`encode_context` / :func:`generate_from_context` tell the attention function about a forward."""

    config: StarConfig
    phase: str                 # CONTEXT_PHASE: every query of the call is context; QUERY_PHASE: none is
    context_length: int        # context tokens of the whole input (all ranks together)
    prefix_tokens: int = 0     # anchor tokens prepended to this rank's shard (phase 1, ranks not holding block 0)
    sharded: bool = False      # context sharded over ranks: phase-2 partials are merged across `group`
    is_query_rank: bool = True
    group: Any = None
    calls: int = 0


_RUN: contextvars.ContextVar[_StarRun | None] = contextvars.ContextVar("hf_sparse_star_run", default=None)


@contextlib.contextmanager
def _running(run: _StarRun) -> Iterator[_StarRun]:
    token = _RUN.set(run)
    try:
        yield run
    finally:
        _RUN.reset(token)


# -- the attention function ----------------------------------------------------------------------------------
def _record_dense(layer_idx: int, phase: str, reason: str) -> None:
    if recording():
        record(LayerRecord(layer_idx, phase, reason))


def star_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """attn_implementation="star": the plan of :func:`hf_sparse.plan.plan_star`, executed.

    Without :func:`generate` around it, a call without a past (``key_length == query_length``) is a prompt: its
    last ``config.query_tokens`` tokens are the query, the rest the context; a call with a past is all query
    (generation). Contexts shorter than ``config.dense_threshold``, contexts whose pattern keeps more than
    ``config.dense_above_density`` of the causal blocks (one process) and ``dense_layers`` run dense (sdpa); so do
    masks that are not left padding and 4D masks.
    """
    if torch.compiler.is_compiling():  # a compiled model's forward: this call runs eagerly (a graph break)
        return _eager_star(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    layer = cache_layer_of(key, kwargs)
    unmasked = plan.forward_dense(module, query, key.shape[2], attention_mask, kwargs)
    if unmasked is not None:  # a later layer of a prompt that the first layer found shorter than dense_below
        return forward_dense_attention(module, query, key, value, attention_mask, dropout, scaling, unmasked, kwargs)
    run = _RUN.get()
    config = run.config if run is not None else method_config(module.config, "star")
    call = plan.Call("star", config, module, query, key, attention_mask, layer, kwargs, dropout)
    decided = plan.plan_star(call, run)
    cache_layer = layer if key.dtype == torch.int8 else None
    if key.dtype == torch.int8 and cache_layer is None:
        raise TypeError("int8 keys reach the Star attention only from an int8 SparseCache (it holds their scales)")
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    logn_base = logn_base_for(config, module.config)
    if decided.path == plan.ALL_BLOCKS:  # generation over a static cache (CUDA-graph decode)
        _record_dense(call.layer_idx, decided.phase, decided.reason)
        return all_blocks_decode(query, layer, scale, logn_base, {}), None
    rows = decided.rows
    if (cache_layer is not None or getattr(layer, "static", False)) and layer.row_layout is None:
        # The padding picks the int8 values' layout; a static layer keeps it for its decode steps.
        if rows is None and (attention_mask is None or attention_mask.dim() == 2):
            rows = row_layout(attention_mask, query.shape[0], call.key_length, query.device)
        if rows is not None:
            layer.set_padding(rows)
            if cache_layer is not None:
                value = cache_layer.values
    if logn_base is not None:  # a positive factor per query: the same in every phase, kernel and rank
        # by true positions (the model's position_ids): global ones on every rank
        query = logn_scaled(query, attention_mask, call.key_length, logn_base, kwargs.get("position_ids"))
    if run is not None:
        run.calls += 1
        if run.sharded and run.phase == QUERY_PHASE:
            if cache_layer is not None:
                raise NotImplementedError("sharded Star attention keeps its own float KV cache, not an int8 one")
            if dropout:
                raise NotImplementedError("Star attention does not support attention dropout (use model.eval())")
            return _sharded_query_attention(run, query, key, value, scale, call.layer_idx)

    def global_attention(queries: torch.Tensor) -> torch.Tensor:
        return _global_attention(module, config, queries, key, value, attention_mask, cache_layer, dropout, scaling,
                                 scale, **kwargs)

    def query_attention(queries: torch.Tensor) -> torch.Tensor:
        """Phase 2: the query tokens over every key."""
        if _long_query(queries, key, attention_mask, cache_layer, dropout, kwargs):
            return _all_blocks_attention(config, queries, key, value, attention_mask, scale)
        return global_attention(queries)

    if decided.path == plan.DENSE:
        logger.debug("layer %d: dense (%s)", call.layer_idx, decided.reason)
        _record_dense(call.layer_idx, decided.phase, decided.reason)
        if decided.rule == "length" and run is None and logn_base is None and cache_layer is None:
            # A prompt shorter than dense_below: sdpa in every layer; the later layers skip the steps above.
            plan.remember_forward(call, plan.Plan(plan.DENSE, "length"))
        if decided.phase == QUERY_PHASE:
            return query_attention(query), None
        return global_attention(query), None

    # Phase 1 on the first `context_queries` slots: keys are the same slots (the query part comes after them).
    context_queries = decided.context_queries
    selection = StarMethod(config).context_selection(query.shape[0], key.shape[1], context_queries, query.device,
                                                     run.prefix_tokens if run is not None else 0)
    if decided.full_rows is not None:  # rows whose own context is short run dense alone: every causal block here
        last_block = kernels.reference.tile_last_blocks(selection.num_query_tiles, selection.query_tile,
                                                        context_queries, 0, rows.starts, selection.block_size)
        selection = selection.with_full_rows(decided.full_rows, last_block,
                                             kernels.reference.num_row_blocks(context_queries, rows,
                                                                              selection.block_size))
    context = slice(0, context_queries)
    scales = {}
    if cache_layer is not None:
        scales = {"key_scale": cache_layer.key_scales[:, :, context], "value_scale": cache_layer.value_scales[:, :, context]}
    context_values = kernels.reference.leading_values(value, context_queries)
    output, _ = kernels.sparse_attention(query[:, :, context], key[:, :, context], context_values, selection,
                                         scale=scale, q_offset=0, kv_start=rows, **scales)
    if recording():
        attended, causal = block_counts(selection, context_queries, 0, rows)
        record(LayerRecord(call.layer_idx, CONTEXT_PHASE, None, attended, causal, selection,
                            (query[:, :, context], key[:, :, context], context_values, rows.starts)))
    output = output.transpose(1, 2)
    if context_queries == call.num_queries:
        return output.contiguous(), None
    # Phase 2 for the prompt's query tokens: global causal attention over the whole prompt.
    _record_dense(call.layer_idx, QUERY_PHASE, GLOBAL)
    return torch.cat([output, query_attention(query[:, :, context_queries:])], dim=1), None


@torch.compiler.disable
def _eager_star(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """:func:`star_attention_forward` outside ``torch.compile``'s tracing (a graph break)."""
    return star_attention_forward(*args, **kwargs)


def _global_attention(module: torch.nn.Module, config: StarConfig, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None, cache_layer: SparseCacheLayer | None,
                      dropout: float, scaling: float | None, scale: float, **kwargs: Any) -> torch.Tensor:
    """Causal attention of ``query`` (the last queries of the keys) over every key, ``[B, Sq, Hq, Dv]``: sdpa (a
    long query after its context takes :func:`_all_blocks_attention` instead, when :func:`_long_query` holds).

    On an int8 cache (``cache_layer``), calls of at most ``DECODE_MAX_QUERY`` queries (generation) run the sparse
    attention kernels with every block selected, which read the int8 K/V with their scales; longer calls run
    sdpa on a dequantised copy of the layer's K/V (as the other methods' dense fallback does).
    """
    num_queries = query.shape[2]
    if cache_layer is None or num_queries > DECODE_MAX_QUERY or dropout:
        if cache_layer is not None:
            key, value = dequantized_kv(key, value, cache_layer, query.dtype)
        return dense_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                               **kwargs)[0]
    return _all_blocks_attention(config, query, key, value, attention_mask, scale, key_scale=cache_layer.key_scales,
                                 value_scale=cache_layer.value_scales)


def _long_query(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
                cache_layer: SparseCacheLayer | None, dropout: float, kwargs: dict) -> bool:
    """Whether phase 2 of ``query`` runs :func:`_all_blocks_attention`: more than ``DECODE_MAX_QUERY`` queries
    after some keys, a float cache, no dropout, no softcapping / sinks / sliding window, and no mask or a 2D
    left-padding one. Other calls run :func:`_global_attention`."""
    num_queries, key_length = query.shape[2], key.shape[2]
    if cache_layer is not None or dropout or not DECODE_MAX_QUERY < num_queries < key_length:
        return False
    if any(kwargs.get(name) is not None for name in NOT_FOR_SDPA):
        return False
    return attention_mask is None or (attention_mask.dim() == 2
                                      and mask_layout(attention_mask, key_length, query.device)[1])


def _all_blocks_attention(config: StarConfig, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scale: float, **scales: torch.Tensor) -> torch.Tensor:
    """Phase 2 through the sparse attention kernel with every key block selected, ``[B, Sq, Hq, Dv]`` (``scales``:
    an int8 cache's ``key_scale`` / ``value_scale``). It serves an int8 cache's generation steps, and a long float
    query (the tri-shape's ``query_tokens``, or a question after an encoded context), for which sdpa takes
    transformers' ``Sq x key_length`` mask (no flash kernel): at 128K with 8,192 query tokens a prompt's TTFT is
    1.00 s and its peak 1.48x sdpa's prefill's that way, 0.68 s and 0.92x this way (docs/star.md)."""
    batch, num_queries, key_length = query.shape[0], query.shape[2], key.shape[2]
    rows = padding_layout(attention_mask, batch, key_length, query.device, validate=False)
    selection = StarMethod(config).full_selection(batch, key.shape[1], num_queries, key_length, query.device)
    output, _ = kernels.sparse_attention(query, key, value, selection, scale=scale, q_offset=key_length - num_queries,
                                         kv_start=rows, **scales)
    return output.transpose(1, 2).contiguous()


def _sharded_query_attention(run: _StarRun, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             scale: float, layer_idx: int) -> tuple[torch.Tensor, None]:
    """Phase 2 across ranks: partial attention over this rank's keys, merged with every other rank's."""
    batch, q_heads, num_queries, _ = query.shape
    key_length = key.shape[2]
    if key_length == 0:  # a rank without context blocks (more ranks than blocks)
        output = query.new_zeros(batch, q_heads, num_queries, value.shape[-1])
        lse = torch.full((batch, q_heads, num_queries), float("-inf"), dtype=torch.float32, device=query.device)
    else:
        # The query rank holds [its shard, query and generated tokens]: causal. The others hold their shard only,
        # all of it before every query (q_offset past the last key).
        q_offset = key_length - num_queries if run.is_query_rank else key_length
        rows = RowLayout.uniform(batch, query.device)
        selection = StarMethod(run.config).full_selection(batch, key.shape[1], num_queries, key_length, query.device)
        output, lse = kernels.sparse_attention(query, key, value, selection, scale=scale, q_offset=q_offset,
                                               kv_start=rows)
    output, _ = distributed.merge_partials(output, lse, run.group)
    _record_dense(layer_idx, QUERY_PHASE, GLOBAL)
    return output.transpose(1, 2).contiguous(), None


# -- the KV a rank keeps -------------------------------------------------------------------------------------
class StarCacheLayer(SparseCacheLayer):
    """One layer of a rank's KV: its context shard and, on the query rank, the query and generated tokens.

    ``drop_prefix``: the first update (phase 1) stores its states without that many leading tokens (the anchor a
    rank recomputes) but returns them all to the attention call. ``reserve_tokens``: room allocated with the
    shard for later tokens (the query rank's query and generated tokens), so generation does not regrow a long
    context's storage. ``frozen`` (ranks other than the query rank, phase 2): updates store nothing and return
    the stored shard, so the query and generated tokens' KV is kept once, on the query rank.
    """

    def __init__(self, block_size: int, drop_prefix: int = 0, reserve_tokens: int = 0) -> None:
        super().__init__(block_size)
        self.drop_prefix = drop_prefix
        self.reserve_tokens = reserve_tokens
        self.frozen = False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if self.frozen:
            if self.keys is None:
                return key_states[:, :, :0], value_states[:, :, :0]
            hand_over(self, self.keys, kwargs)
            return self.keys, self.values
        prefix, self.drop_prefix = self.drop_prefix, 0
        stored_keys, stored_values = key_states[:, :, prefix:], value_states[:, :, prefix:]
        if self.key_storage is None and self.reserve_tokens:
            self.lazy_initialization(stored_keys, stored_values)
            self._grow(stored_keys.shape[2] + self.reserve_tokens, stored_keys, stored_values)
        keys, values = self.append(stored_keys, stored_values)
        if prefix:  # the attention call gets states this layer does not hold as they are
            return key_states, value_states
        hand_over(self, keys, kwargs)
        return keys, values


@dataclass
class StarContext:
    """The context encoded by :func:`encode_context` on this rank.

    Attributes:
        cache: this rank's KV (a transformers ``Cache`` of :class:`StarCacheLayer`).
        config: the Star configuration used.
        context_ids: the whole context ``[B, C]`` (every rank holds the token ids, not their KV).
        attention_mask: the context's 2D padding mask, or None.
        shard: ``(first, end)`` context tokens whose KV this rank keeps.
        sharded: whether the context is split over the ranks of ``group``.
        is_query_rank: whether this rank keeps the query and generated tokens' KV.
        group: the process group (None: the default group).
    """

    cache: Cache
    config: StarConfig
    context_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    shard: tuple[int, int]
    sharded: bool
    is_query_rank: bool
    group: Any = None


def _num_layers(model: Any) -> int:
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    return config.num_hidden_layers


def _star_config(model: Any, config: StarConfig | None) -> StarConfig:
    config = config if config is not None else method_config(model.config, "star")
    if not isinstance(config, StarConfig):
        raise TypeError(f"expected a StarConfig, got {type(config).__name__}")
    return config


def _check_called(run: _StarRun) -> None:
    if run.calls == 0:
        raise ValueError(
            "the model never called the Star attention function: load it with attn_implementation='star' "
            "(or model.set_attn_implementation('star'))"
        )


def encode_context(
    model: Any,
    context_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    config: StarConfig | None = None,
    group: Any = None,
    reserve_tokens: int = 0,
) -> StarContext:
    """Phase 1: encode ``context_ids`` ``[B, C]`` into this rank's KV.

    With an initialised process group of more than one rank (and a context of at least ``dense_below`` tokens) the
    context blocks are sharded contiguously over the ranks; each rank recomputes the anchor at its true positions
    and keeps only its shard. Otherwise this process encodes the whole context. ``attention_mask`` (left padding)
    is supported in one process only. ``reserve_tokens``: storage the query rank allocates with its shard for the
    query and generated tokens. Every rank must pass the same inputs.
    """
    config = _star_config(model, config)
    if context_ids.dim() != 2 or context_ids.shape[1] == 0:
        raise ValueError(f"context_ids must be [batch, length] with length >= 1, got {tuple(context_ids.shape)}")
    batch, length = context_ids.shape
    device = context_ids.device
    rank, world_size = distributed.rank_and_world(group)
    if distributed.is_distributed(group) and (getattr(model, "tp_size", None) or 1) > 1:
        raise ValueError(
            f"Star's context sharding over the {world_size} ranks of the process group cannot run on a model split "
            f"by tensor parallelism (tp_plan / distributed_config, tp_size {model.tp_size}): each rank holds only some "
            "heads. Load the model whole on each rank (device_map or one GPU) for sharded Star, or call "
            "model.generate() with attn_implementation='star' under tensor parallelism")
    sharded = distributed.is_distributed(group) and length >= config.dense_threshold(CONTEXT_PHASE)
    if distributed.is_distributed(group) and not sharded:
        logger.info("context of %d tokens < dense_below %d: every rank encodes it whole", length,
                    config.dense_threshold(CONTEXT_PHASE))
    first, end, prefix = 0, length, 0
    if sharded:
        if config.dense_layers:
            raise ValueError("StarConfig.dense_layers needs the whole context on one rank: unsupported when sharded")
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise NotImplementedError("padded contexts are supported in one process only (pass batches without padding)")
        attention_mask = None
        distributed.check_same_on_all_ranks([batch, length], device, "context shapes", group)
        num_blocks = -(-length // config.block_size)
        first_block, end_block = distributed.shard_blocks(num_blocks, world_size)[rank]
        first, end = min(first_block * config.block_size, length), min(end_block * config.block_size, length)
        prefix = config.anchor_size if first > 0 else 0
        logger.info("rank %d/%d: context tokens [%d, %d) of %d%s", rank, world_size, first, end, length,
                    f" (+ anchor {prefix})" if prefix else "")
    is_query_rank = not sharded or rank == distributed.query_rank(world_size)

    reserve = reserve_tokens if is_query_rank else 0
    cache = Cache(layers=[StarCacheLayer(config.kernel_block_size, prefix, reserve) for _ in range(_num_layers(model))])
    if end > first:
        input_ids = context_ids[:, first:end]
        positions = torch.arange(first, end, device=device)
        if prefix:
            input_ids = torch.cat([context_ids[:, :prefix], input_ids], dim=1)
            positions = torch.cat([torch.arange(prefix, device=device), positions])
        positions = positions[None].expand(batch, -1)
        if attention_mask is not None:  # left padding: positions count real tokens, as generate() does
            positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        run = _StarRun(config, CONTEXT_PHASE, length, prefix, sharded, is_query_rank, group)
        with torch.no_grad(), _running(run):
            model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                  use_cache=True, logits_to_keep=1, **{CACHE_KWARG: cache})
        _check_called(run)
    if not is_query_rank:
        for layer in cache.layers:
            layer.frozen = True
    return StarContext(cache, config, context_ids, attention_mask, (first, end), sharded, is_query_rank, group)


def generate_from_context(model: Any, context: StarContext, query_ids: torch.Tensor, **generate_kwargs: Any) -> Any:
    """Phase 2: ``model.generate`` for ``query_ids`` ``[B, Q]`` after the encoded ``context``.

    Returns what ``generate`` returns for the query (sequences ``[query, generated]``). Afterwards the cache is
    cut back to the context, so one encoded context can answer several queries. Sharded runs: every rank must
    call this with the same arguments (seed sampling identically on every rank); all ranks get the same tokens.
    """
    return _generate_after(model, context, query_ids, restore_context=True, **generate_kwargs)


def _generate_after(model: Any, context: StarContext, query_ids: torch.Tensor, restore_context: bool,
                    **generate_kwargs: Any) -> Any:
    for name in ("attention_mask", *CACHE_KWARGS, "position_ids", "input_ids", "inputs_embeds"):
        if name in generate_kwargs:
            raise TypeError(f"hf_sparse.star_attention.generate sets `{name}` itself")
    batch, length = context.context_ids.shape
    if query_ids.dim() != 2 or query_ids.shape[0] != batch or query_ids.shape[1] == 0:
        raise ValueError(f"query_ids must be [{batch}, length >= 1] (the context's batch), got {tuple(query_ids.shape)}")
    if context.sharded:
        distributed.check_same_on_all_ranks(list(query_ids.shape), query_ids.device, "query shapes", context.group)
    context_mask = context.attention_mask
    if context_mask is None:
        context_mask = torch.ones(batch, length, dtype=torch.long, device=query_ids.device)
    # The mask spans context + query, so generate() takes query_ids as the new tokens and derives their true
    # positions (length, length + 1, ...) from it, whatever the length of this rank's cache.
    full_mask = torch.cat([context_mask.to(query_ids.device).long(), torch.ones_like(query_ids)], dim=1)
    run = _StarRun(context.config, QUERY_PHASE, length, 0, context.sharded, context.is_query_rank, context.group)
    stored = context.shard[1] - context.shard[0]
    try:
        with _running(run):
            output = model.generate(query_ids, attention_mask=full_mask, **{CACHE_KWARG: context.cache},
                                    **generate_kwargs)
    finally:
        for layer in context.cache.layers:
            if restore_context and not layer.frozen and layer.get_seq_length() > stored:
                layer.crop(stored)
    _check_called(run)
    return output


def generate(
    model: Any,
    context_ids: torch.Tensor,
    query_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    config: StarConfig | None = None,
    group: Any = None,
    **generate_kwargs: Any,
) -> Any:
    """Star Attention generation: encode ``context_ids`` ``[B, C]`` (phase 1), then ``model.generate`` for
    ``query_ids`` ``[B, Q]`` (phase 2).

    Returns what ``model.generate(torch.cat([context_ids, query_ids], 1), ...)`` returns: the sequences hold the
    context, the query and the generated tokens. ``attention_mask`` is the context's left-padding mask (one
    process only). ``config`` defaults to the StarConfig stored in ``model.config``. Under ``torchrun`` (an
    initialised process group, or ``group``) the context is sharded over the ranks; see :func:`encode_context`.
    A returned ``past_key_values`` holds this rank's KV (its context shard; on the query rank also the query and
    generated tokens).
    """
    new_tokens = generate_kwargs.get("max_new_tokens") or getattr(model.generation_config, "max_new_tokens", None) or 0
    context = encode_context(model, context_ids, attention_mask=attention_mask, config=config, group=group,
                             reserve_tokens=query_ids.shape[1] + new_tokens)
    output = _generate_after(model, context, query_ids, restore_context=False, **generate_kwargs)
    context_ids = context_ids.to(query_ids.device)
    if isinstance(output, torch.Tensor):
        return torch.cat([context_ids, output], dim=1)
    output.sequences = torch.cat([context_ids.repeat_interleave(output.sequences.shape[0] // context_ids.shape[0], 0),
                                  output.sequences], dim=1)
    return output


__all__ = ["StarCacheLayer", "StarContext", "encode_context", "generate", "generate_from_context",
           "star_attention_forward"]
