"""CUDA-graph decode inside ``generate()``: each decode step of a static SparseCache replays one captured forward.

Eager decode is bound by the host: a 32-layer model launches hundreds of kernels per token from Python. Over a
static :class:`~hf_sparse.SparseCache` the PLAS, XAttention and Star decode paths read every length on the device
(:func:`hf_sparse.attention.static_decode`), so one captured forward is valid for every later step of the same
sequence. :class:`DecodeGraphs` wraps a model's ``forward`` for the length of one ``generate()`` call
(:func:`install` from the cache hook, :func:`uninstall` when generate() returns): the first qualifying decode call
runs eagerly (on the capture stream: kernels compile, per-stream buffers are made), the second is captured and
replayed, and later ones copy their inputs into the captured buffers and replay. Any other call runs the model's
forward unchanged. A new cache, a re-allocated or reordered one, or a new batch or step width captures again, and
so does a sequence crossing the method's ``dense_below`` (below it every layer decodes all blocks, through the same
decode kernel).

Between ``generate()`` calls a model keeps its :class:`DecodeState`: the static cache ``generate()`` made (reset and
reused by the next call whose prompt fits it, :func:`reusable_cache`) and the captured graphs, which point at that
cache's storage. A later call that fits therefore allocates nothing and captures nothing: its first decode step
replays. :func:`release` frees both. :func:`stats` tells what happened (replays, captures, and why graphs were
turned off, if they were).
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from .attention import DECODE_MAX_QUERY, method_config
from .fusion import fused_modules
from .padding import padding_layout
from .recording import recording
from .cache import CACHE_KWARGS, SparseCache

logger = logging.getLogger(__name__)

#: Attention implementations whose decode over a static SparseCache reads no host length
#: (:func:`hf_sparse.attention.static_decode`), so one captured step replays for every later one.
GRAPH_METHODS = ("plas", "xattn", "star")

#: Keyword arguments a captured forward takes; a call with any other runs eagerly.
_ACCEPTED = {"input_ids", "position_ids", "attention_mask", "use_cache", "return_dict", "logits_to_keep",
             "cache_position", "output_attentions", "output_hidden_states", *CACHE_KWARGS}


def window_layers(config: Any) -> bool:
    """Whether a transformers model config has sliding-window (or chunked) attention layers: those attend on the
    host's length (:func:`hf_sparse.attention.sparse_attention_forward`), so its decode is not captured."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types = getattr(text, "layer_types", None)
    if types is not None:
        return any(kind != "full_attention" for kind in types)
    return getattr(text, "sliding_window", None) is not None and getattr(text, "use_sliding_window", True) is not False


def _cache_of(mapping: Any) -> Any:
    """The cache a forward's keyword arguments (or output) hold, under whichever name this transformers uses."""
    return next((mapping[name] for name in CACHE_KWARGS if name in mapping), None)


#: Attribute of the model holding its :class:`GraphStats` (plain data: the model still copies and pickles).
_STATS_ATTR = "_hf_sparse_graph_stats"

_RECORDING_NOTED: list[bool] = []


def _note_recording() -> None:
    """Say once per process that record_sparsity() decodes without CUDA graphs."""
    if not _RECORDING_NOTED:
        _RECORDING_NOTED.append(True)
        logger.warning("hf_sparse: decode runs eagerly inside record_sparsity() (its block counts are read back "
                       "every step, so no CUDA graph; about 10x slower decode on small models): time generate() "
                       "outside it")


#: The side stream of every warm-up and capture on a device, shared by all models: cuBLAS keeps a workspace per
#: stream it runs on (32 MiB on Hopper, held for the process's life), so a stream per model or per cache would
#: hold one such workspace each; the steps of models whose layers all fuse call no cuBLAS routine and leave this
#: stream none (:func:`hf_sparse.fusion.fused_modules`).
_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """hf_sparse's capture stream on ``device`` (made once)."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    stream = _CAPTURE_STREAMS.get(device)
    if stream is None:
        stream = _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


@dataclass
class GraphStats:
    """Counts over a model's generate() calls: decode steps replayed, graphs captured, and the reason graphs were
    turned off for this model (a failed capture), if any."""

    replays: int = 0
    captures: int = 0
    disabled_reason: str | None = None


@dataclass
class _Captured:
    """One captured decode step: the graph, its input buffers and its output's buffers."""

    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    output: tuple[type, dict[str, Any], str]


#: Captured graphs a model keeps at once (one per graph key: step width, below / above ``dense_below``, ...).
MAX_GRAPHS = 4


def _take_padding(cache: SparseCache, attention_mask: torch.Tensor | None, batch: int, steps: int) -> bool:
    """Give the static layers that have none the padding layout of a decode step's 2D mask (the prompt's
    padding): a prefill that ran dense leaves it to the first decode step (the attention function's known-dense
    path takes no host step it does not need); the step's graph key holds the layout's version. False for a
    sequence's first call (nothing cached yet), which runs eagerly."""
    layers = [layer for layer in cache.layers if layer.row_layout is None]
    if layers and layers[0].length == 0:
        return False
    if layers:
        rows = padding_layout(attention_mask, batch, layers[0].length + steps, layers[0].device, validate=False)
        for layer in layers:
            layer.set_padding(rows)
    return True


class DecodeGraphs:
    """A model's ``forward`` whose decode calls over a static SparseCache run as CUDA-graph replays.

    Its graphs belong to one cache (they point at its storage): a call over another cache drops them. Between
    ``generate()`` calls the object is kept (:class:`DecodeState`) without the model's ``forward``."""

    def __init__(self, model: torch.nn.Module, stats: GraphStats) -> None:
        self._model = weakref.ref(model)
        self._method: tuple[str, Any] | None = None  # (implementation, its config) of the generate() call
        self.forward: Any = None
        self.previous: Any = None  # the instance attribute `forward` replaced (e.g. accelerate's hook), if any
        self.stats = stats
        self._forget()

    def attach(self, forward: Any, previous: Any) -> None:
        """Wrap ``forward`` (the model's own) for one generate() call, whose method and configuration it reads
        once here (every decode step asks; a model's config lookups cost microseconds each)."""
        self.forward, self.previous = forward, previous
        self.__wrapped__ = forward  # inspect.signature(model.forward) still sees the model's arguments
        self.__doc__ = getattr(forward, "__doc__", None)
        model = self._model()
        implementation = getattr(model.config, "_attn_implementation", None) if model is not None else None
        graphed = implementation in GRAPH_METHODS and not window_layers(model.config)
        self._method = (implementation, method_config(model.config, implementation)) if graphed else None

    def detach(self) -> None:
        """Let go of the model's ``forward`` (kept graphs stay)."""
        self.forward = self.previous = self.__wrapped__ = self._method = None

    def _forget(self) -> None:
        self._cache: weakref.ref | None = None
        self._warm: set[tuple] = set()
        self._graphs: dict[tuple, _Captured] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = None if args else self._graph_key(kwargs)
        if key is None:
            return self.forward(*args, **kwargs)
        cache = _cache_of(kwargs)
        if self._cache is None or self._cache() is not cache:
            self._forget()
            self._cache = weakref.ref(cache)
        captured = self._graphs.get(key)
        if captured is None:
            if key not in self._warm:
                self._warm.add(key)
                return self._on_capture_stream(kwargs)
            try:
                captured = self._capture(cache, kwargs, key)
            except Exception as error:  # noqa: BLE001 - any capture failure: decode eagerly from now on
                self.stats.disabled_reason = f"CUDA graph capture failed ({type(error).__name__}: {error})"
                logger.warning("hf_sparse: %s; decoding eagerly", self.stats.disabled_reason)
                self._forget()
                return self.forward(**kwargs)
        return self._replay(captured, cache, kwargs)

    # -- which calls -------------------------------------------------------------------------------------
    def _graph_key(self, kwargs: dict[str, Any]) -> tuple | None:
        """What a captured graph is specific to, or None when this call must run eagerly."""
        if recording():
            _note_recording()
            return None
        if self.stats.disabled_reason is not None or torch.is_grad_enabled() or not set(kwargs) <= _ACCEPTED:
            return None
        cache, input_ids = _cache_of(kwargs), kwargs.get("input_ids")
        position_ids = kwargs.get("position_ids")
        if not isinstance(cache, SparseCache) or not isinstance(input_ids, torch.Tensor) or position_ids is None:
            return None
        if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
            return None
        if not input_ids.is_cuda or input_ids.dim() != 2 or not 1 <= input_ids.shape[1] <= DECODE_MAX_QUERY:
            return None
        if self._method is None:  # not a graph method, or sliding-window layers
            return None
        implementation, config = self._method
        if not config.decode_cuda_graph or not cache.layers:
            return None
        steps = input_ids.shape[1]
        for layer in cache.layers:
            if (not getattr(layer, "static", False) or layer.key_storage is None
                    or layer.length + steps > layer.capacity):
                return None
        if not _take_padding(cache, kwargs.get("attention_mask"), input_ids.shape[0], steps):
            return None  # a sequence's first call: eager (the attention function takes its layout)
        # Below dense_below every layer decodes all blocks; above it the sparse layers select: two graphs.
        sparse = cache.layers[0].length >= config.dense_threshold("decode")
        tensors = tuple((name, tuple(value.shape), value.dtype) for name, value in sorted(kwargs.items())
                        if isinstance(value, torch.Tensor) and name != "attention_mask")
        others = tuple((name, value) for name, value in sorted(kwargs.items())
                       if not isinstance(value, torch.Tensor) and name not in CACHE_KWARGS)
        return tensors + others + (implementation, id(config), sparse, cache.layout_version)

    # -- capture and replay ------------------------------------------------------------------------------
    def _call_arguments(self, kwargs: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        # The decode path takes padding from the cache, not from the mask, so the mask stays out of the graph.
        call = {name: value for name, value in kwargs.items() if name != "attention_mask"}
        call.update(tensors)
        return call

    def _fused(self) -> Any:
        """The model's layers fused, or its norms and MLPs compiled, while a step warms up or is captured, as its
        config asks (``decode_compile``, ``decode_fused_layers``; :mod:`hf_sparse.fusion`)."""
        model = self._model()
        implementation = getattr(model.config, "_attn_implementation", None) if model is not None else None
        if model is None or implementation not in GRAPH_METHODS:
            return contextlib.nullcontext()
        config = method_config(model.config, implementation)
        return fused_modules(model, enabled=config.decode_compile, layers=config.decode_fused_layers)

    def _on_capture_stream(self, kwargs: dict[str, Any]) -> Any:
        """An eager step on the capture stream: what capture needs then exists (compiled kernels, buffers)."""
        device = kwargs["input_ids"].device
        stream = capture_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), self._fused():
            output = self.forward(**self._call_arguments(kwargs, {}))
        torch.cuda.current_stream(device).wait_stream(stream)
        return output

    def _capture(self, cache: SparseCache, kwargs: dict[str, Any], key: tuple) -> _Captured:
        device = kwargs["input_ids"].device
        inputs = {name: value.clone() for name, value in kwargs.items()
                  if isinstance(value, torch.Tensor) and name != "attention_mask"}
        lengths = [layer.length for layer in cache.layers]
        graph = torch.cuda.CUDAGraph()
        stream = capture_stream(device)
        try:
            with self._fused(), torch.cuda.graph(graph, stream=stream):
                output = self.forward(**self._call_arguments(kwargs, inputs))
        finally:
            # Capture ran the Python side of a step (host lengths advanced) but no device work: undo it.
            for layer, length in zip(cache.layers, lengths):
                layer.length = length
                layer._views()
        # Keep the output's buffers, not its cache: the cache must be freed when generate() lets it go.
        fields = {name: value for name, value in output.items() if name not in CACHE_KWARGS}
        cache_field = next((name for name in CACHE_KWARGS if name in output.keys()), CACHE_KWARGS[0])
        while len(self._graphs) >= MAX_GRAPHS:
            self._graphs.pop(next(iter(self._graphs)))
        captured = self._graphs[key] = _Captured(graph, inputs, (type(output), fields, cache_field))
        self.stats.captures += 1
        return captured

    def _replay(self, captured: _Captured, cache: SparseCache, kwargs: dict[str, Any]) -> Any:
        for name, buffer in captured.inputs.items():
            buffer.copy_(kwargs[name])
        cache.prepare_replay()  # a new sequence's full blocks, before a graph kept from an earlier one
        captured.graph.replay()
        cache.advance_host_length(kwargs["input_ids"].shape[1])
        self.stats.replays += 1
        output_type, fields, cache_field = captured.output
        fields = dict(fields, **{cache_field: cache})
        fields["logits"] = fields["logits"].clone()  # the graph's buffer is overwritten by the next replay
        return output_type(**fields)


@dataclass
class DecodeState:
    """What a model keeps between generate() calls for CUDA-graph decode: the static cache generate() made and
    the graphs captured over it."""

    graphs: DecodeGraphs | None = None
    cache: SparseCache | None = None


#: Each model's DecodeState, held beside the model (not in it: copies and pickles of the model stay plain).
_STATES: "weakref.WeakKeyDictionary[torch.nn.Module, DecodeState]" = weakref.WeakKeyDictionary()


def _stats_of(model: torch.nn.Module) -> GraphStats:
    stats = model.__dict__.get(_STATS_ATTR)
    if stats is None:
        stats = model.__dict__[_STATS_ATTR] = GraphStats()
    return stats


def install(model: torch.nn.Module) -> DecodeGraphs:
    """Wrap ``model.forward`` in the model's :class:`DecodeGraphs` (an instance attribute; once; undone by
    :func:`uninstall`); graphs kept from earlier calls are replayed when their cache comes back."""
    current = model.__dict__.get("forward")
    if isinstance(current, DecodeGraphs):
        return current
    state = _STATES.setdefault(model, DecodeState())
    if state.graphs is None:
        state.graphs = DecodeGraphs(model, _stats_of(model))
    wrapper = state.graphs
    wrapper.attach(model.forward, current)
    model.__dict__["forward"] = wrapper
    return wrapper


def uninstall(model: torch.nn.Module) -> None:
    """Restore the ``forward`` :func:`install` replaced (the captured graphs stay with the model's state)."""
    wrapper = model.__dict__.get("forward")
    if not isinstance(wrapper, DecodeGraphs):
        return
    if wrapper.previous is None:
        del model.__dict__["forward"]
    else:
        model.__dict__["forward"] = wrapper.previous
    wrapper.detach()


def reusable_cache(model: torch.nn.Module, max_cache_len: int, batch: int | None, block_size: int,
                   kv_dtype: str) -> SparseCache | None:
    """The static cache an earlier generate() of ``model`` made, reset, when it fits this call (same batch,
    block size, K/V dtype, and the model's dtype and device; room for ``max_cache_len`` tokens, and at most twice
    that or 8192 more: a far larger cache would make the short call's decode read a long storage). Else None, and
    the kept cache and graphs are let go first, so that the new cache does not sit beside the old one."""
    state = _STATES.get(model)
    cache = state.cache if state is not None else None
    if cache is None:
        return None
    layer = cache.layers[0] if cache.layers else None
    storage = getattr(layer, "key_storage", None)
    fits = (storage is not None and cache.block_size == block_size and cache.kv_dtype == kv_dtype
            and layer.dtype == getattr(model, "dtype", None) and layer.device == getattr(model, "device", None)
            and batch is not None and storage.shape[0] == batch
            and max_cache_len <= layer.capacity <= max(2 * max_cache_len, max_cache_len + 8192))
    if not fits:
        release(model)
        return None
    cache.reset()
    return cache


def keep_cache(model: torch.nn.Module, cache: SparseCache) -> None:
    """Keep ``cache`` (a static cache generate() made) for the model's next generate() call."""
    _STATES.setdefault(model, DecodeState()).cache = cache


def release(model: torch.nn.Module) -> None:
    """Free what CUDA-graph decode keeps between ``model``'s generate() calls: the static cache and the captured
    graphs (their memory returns to PyTorch's allocator)."""
    state = _STATES.pop(model, None)
    if state is not None and state.graphs is not None:
        state.graphs._forget()


def stats(model: torch.nn.Module) -> GraphStats | None:
    """What CUDA-graph decode did over ``model``'s generate() calls so far (None if it never applied)."""
    return model.__dict__.get(_STATS_ATTR)
