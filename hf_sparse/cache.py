"""SparseCache: a transformers Cache whose layers keep K/V in chunk-grown block storage plus per-block key summaries."""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer
from transformers.generation import utils as _generation_utils

from . import kernels
from .kernels import reference
from .config import KV_CACHE_DTYPES, method_config
from .selection import RowLayout

#: The keyword models and ``generate()`` take a cache by: ``cache`` from transformers 5.24 on (``past_key_values``
#: before; still accepted there, with a deprecation warning).
CACHE_KWARG = "cache" if "cache" in getattr(_generation_utils, "ALL_CACHE_NAMES", ()) else "past_key_values"
#: Every name a cache may arrive under (the current one first).
CACHE_KWARGS = tuple(dict.fromkeys((CACHE_KWARG, "past_key_values")))

#: Calls with at most this many queries and a non-empty past run the decode path (one selection per GQA group
#: shared by all queries of the call: plain, assisted and speculative decoding); only such calls are captured into
#: CUDA graphs (:mod:`hf_sparse.graphs`), so a longer write (a prefill) never asks whether a capture is under way.
DECODE_MAX_QUERY = 16

#: The keyword argument under which the attention function receives the :class:`SparseCacheLayer` that holds its
#: keys. transformers (5.24 on) hands the attention call's keyword arguments to ``Cache.update`` (``kwargs=``), and
#: the layer adds itself there (:func:`hand_over`); transformers does not pass the cache to attention functions.
LAYER_KWARG = "hf_sparse_layer"

#: Releases before 5.24 call ``Cache.update`` without the attention's keyword arguments: the layer that just
#: returned its keys waits here, as weak references (layer, keys), for the attention call that receives those keys
#: (:func:`cache_layer_of`), which takes it.
_HANDED_OVER: list[tuple[weakref.ref, weakref.ref]] = []


def hand_over(layer: "SparseCacheLayer", keys: torch.Tensor, update_kwargs: dict[str, Any]) -> None:
    """Give ``layer`` to the attention call that receives ``keys``: in its keyword arguments where transformers
    passes them to the cache update (``kwargs=``), else through :data:`_HANDED_OVER`."""
    attention_kwargs = update_kwargs.get("kwargs")
    if isinstance(attention_kwargs, dict):
        attention_kwargs[LAYER_KWARG] = layer
        _HANDED_OVER.clear()
    else:
        _HANDED_OVER[:] = [(weakref.ref(layer), weakref.ref(keys))]


def cache_layer_of(key: torch.Tensor, attention_kwargs: dict[str, Any]) -> "SparseCacheLayer | None":
    """The SparseCache layer holding an attention call's ``key`` (taken out of its keyword arguments, or the one
    :func:`hand_over` left for exactly these keys), None without one."""
    layer = attention_kwargs.pop(LAYER_KWARG, None)
    if layer is not None or not _HANDED_OVER:
        return layer
    layer_ref, keys_ref = _HANDED_OVER[0]
    if keys_ref() is not key:
        return None
    _HANDED_OVER.clear()
    return layer_ref()


def _check_max_cache_len(max_cache_len: int | None) -> int | None:
    """``max_cache_len`` as an int (None stays None: a dynamic cache); raises unless positive."""
    if max_cache_len is None:
        return None
    if int(max_cache_len) < 1:
        raise ValueError(f"max_cache_len must be a positive number of tokens, got {max_cache_len}")
    return int(max_cache_len)


def capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class _View:
    """A layer attribute holding a view of its storage, refreshed (``layer._views()``) when read while the layer's
    ``_stale_views`` says its length moved on since (a graph replay's write, an int8 layer's first write)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, layer: Any, owner: type | None = None) -> Any:
        if layer is None:
            return self
        if layer._stale_views:
            layer._views()
        return getattr(layer, self.slot)

    def __set__(self, layer: Any, value: torch.Tensor | None) -> None:
        setattr(layer, self.slot, value)


class SparseCacheLayer(CacheLayerMixin):
    """One layer's KV in preallocated storage ``[B, H, capacity, D]`` grown by whole chunks, and float32
    block summaries ``[B, H, capacity // block_size, D]`` computed once per full block.

    With ``kv_dtype="int8"`` K and V are stored as int8 with one float32 scale per (batch, head, token)
    (``key_scale_storage`` / ``value_scale_storage`` ``[B, H, capacity]``): each token is quantised once, when
    appended, so a filling block never needs requantising, and a scale folds into the kernels' score and
    probability columns. int8 values are stored blocked, ``[B, H, capacity // block_size, D, block_size]``
    (``kernels.reference.blocked_values``: each block's slots contiguous per channel, the order the kernels
    read int8 values in), unless the padding layout taken by :meth:`set_padding` starts rows at different
    slots (or off the block grid): then token-major ``[B, H, capacity, D]``, since the kernels would read
    blocked values of such rows byte by byte. Both layouts give the same results. :meth:`update` returns the
    int8 views (keys ``[B, H, length, D]``, blocked values as the blocks holding ``length`` slots); the
    attention function reads the scales from the layer (``key_scales`` / ``value_scales``). A sequence's first
    write (the layer empty: a first prefill) is the exception: it stores the int8 copy and returns the states it
    was given, in their own dtype, so that prefill attends as over a float cache (the K/V it has in hand, exact;
    no int8 tiles or dequantised copy in its attention); every later call reads the int8 storage. The attention
    tells which it got by the keys' dtype. Summaries kept for decode are computed from the dequantised keys.

    With ``max_cache_len`` the layer is static: storage for that many tokens is allocated once, new states are
    written at the positions of ``device_length`` (the valid-slot count kept on the device), and decode can
    read lengths on the device (:meth:`recent_block_summaries` and the kernels' ``length``) so that a decode
    step captures into a CUDA graph (:mod:`hf_sparse.graphs`). Past ``max_cache_len`` it grows like the
    dynamic layer. ``version`` changes whenever storage or the padding layout is replaced.
    """

    is_sliding = False
    is_croppable = True
    is_compileable = False
    #: Whether ``keys`` / ``values`` trail ``length`` (after :meth:`SparseCache.advance_host_length`: a graph
    #: replay wrote on the device); refreshed on their next read.
    _stale_views = False
    #: Whether an int8 layer's scales of the slots past ``length`` are still to be zeroed (storage just grown: the
    #: next write's launch zeroes them).
    _scales_unset = False

    # Views of the storage over the valid slots, refreshed on read when stale (:class:`_View`): K ``[B, H, length,
    # D]``; V (int8 blocked values: the blocks holding ``length`` slots); an int8 layer's key and value scales
    # ``[B, H, length]`` (None for a float layer).
    keys = _View()
    values = _View()
    key_scales = _View()
    value_scales = _View()

    def __init__(self, block_size: int = 128, chunk_blocks: int = 16, kv_dtype: str = "auto",
                 max_cache_len: int | None = None, **kwargs: Any) -> None:
        super().__init__()
        if kv_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_CACHE_DTYPES}, got {kv_dtype!r}")
        self.max_cache_len = _check_max_cache_len(max_cache_len)
        self._device_length: torch.Tensor | None = None
        # A host length that device_length is still to be set to (prefill writes defer that launch to its first
        # reader: a short prefill is bound by the host's launches per layer).
        self._pending_length: int | None = None
        # Each row's count of valid key blocks as the last device-side append (a CUDA-graph decode step) wrote it,
        # for an all-blocks decode of the same step (attention.all_blocks_selection); None after any other write.
        self.valid_blocks: torch.Tensor | None = None
        self._valid_blocks_storage: torch.Tensor | None = None
        self.version = 0
        self.kv_dtype = kv_dtype
        self.quantized = kv_dtype == "int8"
        self.key_scale_storage: torch.Tensor | None = None
        self.value_scale_storage: torch.Tensor | None = None
        self.key_scales = self.value_scales = None
        self.block_size = block_size
        self.chunk_tokens = block_size * chunk_blocks
        self.length = 0
        self.capacity = 0
        self.key_storage: torch.Tensor | None = None
        self.value_storage: torch.Tensor | None = None
        self.summary_storage: torch.Tensor | None = None
        self.summarized_blocks = 0
        self._summary_source: tuple[Any, ...] | None = None
        # The gate (in a 1-tuple) a static decode summarises with, once it has (kept across reset(): a CUDA graph
        # kept for the next sequence summarises with it), and whether this sequence's full blocks still need it.
        self.decode_gate: tuple[torch.Tensor | None] | None = None
        self._decode_summaries_due = True
        self.row_layout: RowLayout | None = None
        # The layout whose starts tensor this layer keeps (across reset(), for reuse by the next sequence).
        self._kept_layout: RowLayout | None = None
        self._kept_source: RowLayout | None = None  # the layout _kept_layout was last set from

    # -- storage -------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        if self.static:
            self._device_length = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.is_initialized = True

    @property
    def device_length(self) -> torch.Tensor | None:
        """A static layer's valid-slot count as a one-element int64 device tensor (what CUDA-graph decode reads);
        None for a dynamic layer. A length the host set (a prefill's write, a crop) is written into it here,
        before it is read: never while a CUDA graph captures (the step before a capture reads it eagerly, and a
        replay's caller calls :meth:`SparseCache.prepare_replay`)."""
        self.write_pending_length()
        return self._device_length

    def write_pending_length(self) -> None:
        """Write the length the host set into ``device_length`` (one launch; nothing when none is pending)."""
        if self._pending_length is None:
            return
        if capturing(self._device_length.device):
            raise RuntimeError("hf_sparse: a static cache layer's device length was set on the host and not yet "
                               "written when a CUDA graph capture read it")
        self._device_length.fill_(self._pending_length)
        self._pending_length = None

    @property
    def static(self) -> bool:
        """Whether states are written at device-side positions into storage allocated once."""
        return self.max_cache_len is not None

    def _grow(self, needed: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # Geometric growth rounded up to whole chunks: amortised O(1) copies per token.
        if self.static and needed <= self.max_cache_len:
            new_capacity = -(-self.max_cache_len // self.block_size) * self.block_size
        else:
            new_capacity = max(needed, self.capacity + self.capacity // 2)
            new_capacity = -(-new_capacity // self.chunk_tokens) * self.chunk_tokens
        batch, heads = key_states.shape[:2]
        storage_dtype = torch.int8 if self.quantized else key_states.dtype
        keys = key_states.new_empty(batch, heads, new_capacity, key_states.shape[-1], dtype=storage_dtype)
        if self.values_blocked:  # new_capacity is a whole number of blocks
            values = value_states.new_empty(batch, heads, new_capacity // self.block_size, value_states.shape[-1],
                                            self.block_size, dtype=storage_dtype)
        else:
            values = value_states.new_empty(batch, heads, new_capacity, value_states.shape[-1], dtype=storage_dtype)
        if self.quantized:
            # Slots past the kept ones hold zero scales (a reader of a static layer's whole storage multiplies
            # them). A prefill's write zeroes them in its own launch (quantize_append's clear_to: a short prefill
            # is bound by the host's launches); a decode-sized write's few programs would clear a long tail slowly.
            fill = torch.empty if key_states.shape[2] > DECODE_MAX_QUERY else torch.zeros
            key_scales = fill(batch, heads, new_capacity, dtype=torch.float32, device=key_states.device)
            value_scales = fill(batch, heads, new_capacity, dtype=torch.float32, device=key_states.device)
            self._scales_unset = fill is torch.empty
            if self.length:
                key_scales[:, :, : self.length] = self.key_scale_storage[:, :, : self.length]
                value_scales[:, :, : self.length] = self.value_scale_storage[:, :, : self.length]
            self.key_scale_storage, self.value_scale_storage = key_scales, value_scales
        if self.length:
            keys[:, :, : self.length] = self.key_storage[:, :, : self.length]
            kept = reference.leading_values(self.value_storage, self.length)
            values[:, :, : kept.shape[2]] = kept
        if self.summary_storage is not None:
            summaries = self.summary_storage.new_zeros(batch, heads, new_capacity // self.block_size,
                                                       key_states.shape[-1])
            summaries[:, :, : self.summary_storage.shape[2]] = self.summary_storage
            self.summary_storage = summaries
        self.key_storage, self.value_storage = keys, values
        self.capacity = new_capacity
        self.version += 1

    def _zero_unset_scales(self) -> None:
        """Zero the scales of the slots past the kept ones, where a write that would have has not."""
        if self._scales_unset:
            self.key_scale_storage[:, :, self.length:] = 0
            self.value_scale_storage[:, :, self.length:] = 0
            self._scales_unset = False

    @property
    def values_blocked(self) -> bool:
        """Whether the int8 values are (or, before the first states, will be) stored blocked."""
        return self.quantized and (self.value_storage is None or self.value_storage.dim() == 5)

    def _lay_out_values(self, blocked: bool) -> None:
        """Store the int8 values blocked or token-major (one copy of the storage when the layout changes)."""
        if self.value_storage is None or self.values_blocked == blocked:
            return
        if blocked:
            self.value_storage = reference.blocked_values(self.value_storage, self.block_size)
        else:
            self.value_storage = reference.token_values(self.value_storage, self.capacity).contiguous()
        self.version += 1
        self._views()

    def _views(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._stale_views = False
        self._keys = self.key_storage.narrow(2, 0, self.length)
        self._values = reference.leading_values(self.value_storage, self.length)
        if self.quantized:
            self.key_scales = self.key_scale_storage[:, :, : self.length]
            self.value_scales = self.value_scale_storage[:, :, : self.length]
        return self._keys, self._values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        """Append ``[B, H, n, D]`` states; returns views over all cached states (no copy; an int8 layer's first
        write: the given states, see the class), and hands this layer to the attention call that receives them
        (:func:`hand_over`)."""
        if torch.compiler.is_compiling():  # host state (lengths, growth): outside a compiled graph
            return _eager_update(self, key_states, value_states, *args, **kwargs)
        keys, values = self.append(key_states, value_states)
        hand_over(self, keys, kwargs)
        return keys, values

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[B, H, n, D]`` states; returns views over all cached states (no copy), or, for an int8 layer's
        first write (the layer empty), the given states themselves (the class says why)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new_length = self.length + key_states.shape[2]
        if self.key_storage is None or new_length > self.capacity or self.key_storage.shape[0] != key_states.shape[0]:
            if self.key_storage is not None and self.key_storage.shape[0] != key_states.shape[0]:
                raise ValueError(
                    f"SparseCache holds batch {self.key_storage.shape[0]} but got states for batch {key_states.shape[0]}"
                )
            self._grow(new_length, key_states, value_states)
        # A static layer writes at the device's length while a CUDA graph captures (what a replay reads), else at
        # the host's, which equals it then, and sets the device's (fewer launches: a short prefill is host-bound).
        on_device = self.static and key_states.shape[2] <= DECODE_MAX_QUERY and capturing(self.device)
        self.valid_blocks = None  # (a device-side append below writes them)
        if self.quantized:  # quantised per token and written in one op (one launch on Triton)
            first = self.length == 0 and not on_device
            try:
                kernels.quantize_append(key_states, value_states, self.key_storage, self.value_storage,
                                        self.key_scale_storage, self.value_scale_storage,
                                        self.device_length if on_device else self.length,
                                        self.capacity if self._scales_unset else 0)
            except BaseException:
                self._zero_unset_scales()
                raise
            self._scales_unset = False
            if on_device:
                self.device_length.add_(key_states.shape[2])
            elif first:  # a first prefill attends over the states as given; later calls read the int8 copy
                self.length = new_length
                if self.static:
                    self._pending_length = new_length
                self._stale_views = True  # the int8 views when first read (a short prefill is bound by the host)
                return key_states, value_states
        elif on_device:  # written at the device's length, which it advances, with the rows' block counts (one launch)
            starts = self.row_layout.starts if self.row_layout is not None else None
            if starts is not None and (self._valid_blocks_storage is None
                                       or self._valid_blocks_storage.shape[0] != starts.shape[0]):
                self._valid_blocks_storage = torch.empty(starts.shape[0], dtype=torch.int32, device=self.device)
            counts = self._valid_blocks_storage if starts is not None else None
            kernels.append_kv(key_states, value_states, self.key_storage, self.value_storage, self.device_length,
                              starts, counts, self.block_size)
            self.valid_blocks = counts
        elif self.length == 0:  # a sequence's first states: the written slots are the views update() returns
            self.length = new_length
            if self.static:
                self._pending_length = new_length
            self._stale_views = False
            self._keys = self.key_storage.narrow(2, 0, new_length)
            self._values = self.value_storage.narrow(2, 0, new_length)
            self._keys.copy_(key_states)
            self._values.copy_(value_states)
            return self._keys, self._values
        else:
            self.key_storage.narrow(2, self.length, key_states.shape[2]).copy_(key_states)
            self.value_storage.narrow(2, self.length, value_states.shape[2]).copy_(value_states)
        if self.static and not on_device:
            self._pending_length = new_length
        self.length = new_length
        return self._views()

    # -- summaries ----------------------------------------------------------------------------------------
    def block_summaries(self, gate_weight: torch.Tensor | None, row_layout: RowLayout | torch.Tensor) -> torch.Tensor:
        """Summaries of every row block ``[B, H, num_blocks, D]`` (blocks counted from each row's first slot).

        Blocks full in every row are summarised once (``kernels.block_summaries``); the later, partly filled
        ones (at most the padding spread plus one) are recomputed exactly on each call.
        A different gate recomputes all. The padding layout ``row_layout`` is taken when the sequence starts
        and kept (its range is known on the host: no read per call).
        """
        source = (id(gate_weight), None if gate_weight is None else gate_weight._version)
        if source != self._summary_source:
            self.summarized_blocks = 0
            self._summary_source = source
        if self.row_layout is None:
            self.set_padding(row_layout)
        row_layout = self.row_layout
        self._summary_buffer()
        least_pad, most_pad = row_layout.low, row_layout.high
        full_blocks = max(0, self.length - most_pad) // self.block_size
        total_blocks = -(-(self.length - least_pad) // self.block_size)
        if full_blocks > self.summarized_blocks:
            self._summarize(gate_weight, row_layout, self.summarized_blocks, full_blocks)
            self.summarized_blocks = full_blocks
        if total_blocks > full_blocks:
            self._summarize(gate_weight, row_layout, full_blocks, total_blocks)
        return self.summary_storage[:, :, :total_blocks]

    def _summary_buffer(self) -> torch.Tensor:
        """The summary storage ``[B, H, capacity // block_size, D]`` (float32), made at its first use: a prefill
        summarises its keys for its own call only (:func:`hf_sparse.attention`), so the storage exists from the first
        decode step on, after the prefill's activations are gone, and adds nothing to a generate()'s peak memory.
        Made once per layer (no ``version`` change: a graph that reads it is captured after a warm-up step of the
        same graph key, which made it), never while a graph captures."""
        if self.summary_storage is None:
            if capturing(self.key_storage.device):
                raise RuntimeError("hf_sparse: a cache layer's block summaries were first needed inside a CUDA graph "
                                   "capture")
            batch, heads, _, dim = self.key_storage.shape
            self.summary_storage = torch.zeros(batch, heads, self.capacity // self.block_size, dim,
                                               dtype=torch.float32, device=self.key_storage.device)
            self.summarized_blocks = 0
        return self.summary_storage

    def summarize_full_blocks(self, gate_weight: torch.Tensor | None, recent: int) -> None:
        """Before :meth:`recent_block_summaries` (which rewrites the blocks holding the last ``recent`` tokens):
        summarise the earlier blocks that are not yet (or were with another gate), i.e. those of a prefill that ran
        dense, which computes no summaries. Nothing to do, and no launch, when they are up to date: after the first
        decode step, so never inside a CUDA-graph capture."""
        self.decode_gate, self._decode_summaries_due = (gate_weight,), False
        source = (id(gate_weight), None if gate_weight is None else gate_weight._version)
        earlier = max(0, self.length - recent - self.row_layout.high) // self.block_size
        if source != self._summary_source or earlier > self.summarized_blocks:
            self.block_summaries(gate_weight, self.row_layout)

    def set_padding(self, row_layout: RowLayout | torch.Tensor) -> None:
        """Take the sequence's padding layout (left-padding slots per row: a :class:`RowLayout`, or a tensor whose
        range is then read once), and lay int8 values out for it (blocked when every row starts at one slot on
        the block grid)."""
        kept = self._kept_layout
        if row_layout is self._kept_source and kept is not None and not self.quantized:
            # The very layout this storage took last (layouts passed down are never changed in place): every
            # layer of a reset cache taking the shared no-padding layout, in one host step.
            self.row_layout = kept
            return
        self._kept_source = row_layout if isinstance(row_layout, RowLayout) else None
        row_layout = RowLayout.of(row_layout)
        if (kept is not None and (kept.low, kept.high) == (row_layout.low, row_layout.high)
                and kept.starts.shape == row_layout.starts.shape and kept.starts.device == row_layout.starts.device
                and kept.starts.dtype == row_layout.starts.dtype):
            # A reset cache starting a sequence of the same layout range: the starts are written in place, so
            # the version (and a CUDA graph captured over this layer) stays valid. A range of one value (no
            # padding spread) fixes every start: the kept tensor holds them already.
            if row_layout.low != row_layout.high:
                kept.starts.copy_(row_layout.starts)
        else:
            kept = self._kept_layout = RowLayout(row_layout.starts.clone(), row_layout.low, row_layout.high)
            self.version += 1
        self.row_layout = kept
        if self.quantized:
            self._lay_out_values(self.row_layout.aligned(self.block_size))

    def recent_block_summaries(self, gate_weight: torch.Tensor | None, recent: int) -> torch.Tensor:
        """Static layers in decode: rewrite the summaries of the blocks holding the last ``recent``
        tokens, reading the length on the device (no host state is read or changed: CUDA-graph safe), and
        return the whole summary storage ``[B, H, capacity // block_size, D]``. Earlier blocks were summarised
        by :meth:`block_summaries` (prefill) or by earlier calls."""
        return kernels.recent_block_summaries(self.key_storage, gate_weight, self.row_layout, self.block_size,
                                              self.device_length, recent, self._summary_buffer(),
                                              key_scale=self.key_scale_storage, dtype=self.dtype)

    def _summarize(self, gate_weight: torch.Tensor | None, row_layout: RowLayout, first: int, end: int) -> None:
        """Write the summaries of row blocks ``[first, end)`` into the storage (int8 keys dequantised to the
        dtype the model computes in)."""
        kernels.block_summaries(self.key_storage[:, :, : self.length], gate_weight, row_layout, self.block_size, first,
                                end - first, out=self.summary_storage[:, :, first:end],
                                key_scale=self.key_scale_storage[:, :, : self.length] if self.quantized else None,
                                dtype=self.dtype)

    # -- Cache protocol -----------------------------------------------------------------------------------
    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        # (device_length is set from the next update(), which a new sequence's first call makes outside a capture)
        self.length = 0
        self.summarized_blocks = 0
        self._summary_source = None
        self._decode_summaries_due = True
        self.row_layout = None
        self._stale_views = False  # (a first int8 write nobody read left them stale)
        self.keys = self.values = None
        self.key_scales = self.value_scales = None

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (negative), or keep the first ``tokens_to_remove`` (positive)."""
        if tokens_to_remove >= 0:
            new_length = min(self.length, tokens_to_remove) if tokens_to_remove > 0 else self.length
        else:
            new_length = max(0, self.length + tokens_to_remove)
        self.length = new_length
        if self._device_length is not None:
            self._pending_length = new_length
        most_pad = self.row_layout.high if self.row_layout is not None else 0
        self.summarized_blocks = min(self.summarized_blocks, max(0, new_length - most_pad) // self.block_size)
        if new_length == 0:
            self.reset()
            return
        if self.key_storage is not None:
            self._views()

    def _apply_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.key_storage is None:
            return
        self.key_storage = fn(self.key_storage)
        self.value_storage = fn(self.value_storage)
        if self.quantized:
            self.key_scale_storage = fn(self.key_scale_storage)
            self.value_scale_storage = fn(self.value_scale_storage)
        if self.summary_storage is not None:
            self.summary_storage = fn(self.summary_storage)
        if self.row_layout is not None:  # rows selected or repeated: their range is read again (one host read)
            self.row_layout = self._kept_layout = RowLayout.read(fn(self.row_layout.starts))
        self._kept_source = None  # the kept layout no longer is the one a caller passed
        self.version += 1
        self._views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply_batch(lambda t: t[indices.to(t.device)])

    def offload(self) -> None:
        raise NotImplementedError("SparseCache does not support offloading")

    def prefetch(self) -> None:
        return None


@torch.compiler.disable
def _eager_update(layer: SparseCacheLayer, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`SparseCacheLayer.update` run eagerly from a compiled forward (a graph break)."""
    return layer.update(*args, **kwargs)


class SparseCache(Cache):
    """KV cache for hf_sparse attention: block storage and incrementally updated block summaries.

    ``generate()`` creates one automatically for models using "plas"; pass one explicitly as
    ``cache=SparseCache(model.config)`` (``past_key_values=`` before transformers 5.24) to control it. ``kv_dtype="int8"`` stores K/V as int8 with
    per-token scales (:class:`SparseCacheLayer`); ``None`` takes the method config's ``kv_cache_dtype``.
    ``max_cache_len`` makes every layer static (storage for that many tokens allocated once, lengths also kept
    on the device): what decoding under a CUDA graph needs (``generate()`` picks it on CUDA, see
    :mod:`hf_sparse.graphs`).
    """

    def __init__(self, config: Any = None, block_size: int | None = None, chunk_blocks: int = 16,
                 kv_dtype: str | None = None, max_cache_len: int | None = None) -> None:
        if block_size is None:
            block_size = block_size_for(config)
        if kv_dtype is None:
            kv_dtype = kv_dtype_for(config)
        if kv_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_CACHE_DTYPES}, got {kv_dtype!r}")
        self.block_size = block_size
        self.kv_dtype = kv_dtype
        # (not `max_cache_len`: transformers 5.17's Cache has a read-only property of that name)
        self.static_length = _check_max_cache_len(max_cache_len)
        num_layers = None
        if config is not None:
            text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
            num_layers = getattr(text_config, "num_hidden_layers", None)
        if num_layers is not None:
            # Sliding-window layers attend densely inside their window (attention.py): the cache keeps only that
            # window for them, as transformers' caches do (static ones too: such models decode without CUDA graphs,
            # graphs.window_layers, so their window layers need no static storage).
            windows = layer_windows(config)
            layers = [SparseCacheLayer(block_size, chunk_blocks, kv_dtype, max_cache_len) if window is None
                      else DynamicSlidingWindowLayer(sliding_window=window) for window in windows]
            super().__init__(layers=layers)
        else:
            super().__init__(layer_class_to_replicate=_LayerFactory(block_size, chunk_blocks, kv_dtype, max_cache_len))

    @property
    def layout_version(self) -> tuple[int, ...]:
        """Changes whenever a layer's storage or padding layout is replaced (what a captured graph points at)."""
        return tuple(getattr(layer, "version", 0) for layer in self.layers)

    def prepare_replay(self) -> None:
        """Before a replayed decode step: every static layer's device length holds its host length (a prefill
        defers that write), and the layers whose static decode selects on block summaries summarise the full
        blocks their sequence has and they lack (a dense prefill computes none). The eager decode path does both
        itself (reading ``device_length``; :meth:`SparseCacheLayer.summarize_full_blocks`); a CUDA graph kept from
        an earlier sequence replays only the rewrite of the last block, so the first replay of each sequence needs
        this. No work, and no launch, once done for a sequence."""
        for layer in self.layers:
            if isinstance(layer, SparseCacheLayer):
                layer.write_pending_length()
            if getattr(layer, "decode_gate", None) is not None and layer._decode_summaries_due \
                    and layer.row_layout is not None:
                layer.summarize_full_blocks(layer.decode_gate[0], 0)

    def advance_host_length(self, tokens: int) -> None:
        """Count ``tokens`` more on the host side of every layer, after a graph replay wrote them on the device
        (the layers' views are refreshed when next read: a replayed step reads none)."""
        for layer in self.layers:
            layer.length += tokens
            layer._stale_views = True

    def memory_per_token(self) -> int:
        """Bytes of K/V storage (values plus int8 scales) per token of one sequence, over all initialised layers."""
        total = 0
        for layer in self.layers:
            if getattr(layer, "key_storage", None) is None:
                continue
            for storage in (layer.key_storage, layer.value_storage, layer.key_scale_storage, layer.value_scale_storage):
                if storage is not None:  # every storage holds `capacity` slots per sequence
                    total += storage[0].numel() * storage.element_size() // layer.capacity
        return total


def layer_windows(config: Any) -> list[int | None]:
    """Each decoder layer's sliding window in tokens, or None for a full-attention layer, from a transformers
    config (``layer_types``, else ``sliding_window`` for every layer unless ``use_sliding_window`` is False)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if types is not None:
        return [window if kind == "sliding_attention" else None for kind in types]
    uses_window = window is not None and getattr(text, "use_sliding_window", True) is not False
    return [window if uses_window else None] * text.num_hidden_layers


class _LayerFactory:
    """Picklable zero-argument factory of cache layers (for lazily created layers)."""

    def __init__(self, block_size: int, chunk_blocks: int, kv_dtype: str = "auto",
                 max_cache_len: int | None = None) -> None:
        self.block_size, self.chunk_blocks, self.kv_dtype = block_size, chunk_blocks, kv_dtype
        self.max_cache_len = max_cache_len

    def __call__(self) -> SparseCacheLayer:
        return SparseCacheLayer(self.block_size, self.chunk_blocks, self.kv_dtype, self.max_cache_len)


def block_size_for(config: Any) -> int:
    """The block size of the SparseCache a model with ``config`` gets (its method's kernel block size; 128)."""
    stored = method_config(config, None)
    return getattr(stored, "kernel_block_size", stored.block_size)


def kv_dtype_for(config: Any) -> str:
    """The K/V storage dtype of the SparseCache a model with ``config`` gets (its method's ``kv_cache_dtype``)."""
    return getattr(method_config(config, None), "kv_cache_dtype", "auto")
