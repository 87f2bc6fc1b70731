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

A model whose decoder layers sit on several GPUs (``device_map``) captures one graph per run of consecutive layers
on one device (:class:`_Segment`; a CUDA graph holds one device's work): its decode steps run the embedding, the
hand-over between devices and the head eagerly, and replay each device's layers. Its layers run unfused.

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

    graph: torch.cuda.CUDAGraph | None
    inputs: dict[str, torch.Tensor]
    output: tuple[type, dict[str, Any], str] | None
    segments: list[_Segment] | None = None  # a model spread over devices: one graph per segment instead


@dataclass
class _Segment:
    """Consecutive decoder layers on one device, captured as one graph in a model spread over several devices: the
    layers, and once captured the graph, its inputs (the first layer's arguments, copied to this device) and its
    output (the last layer's)."""

    device: torch.device
    layers: list[torch.nn.Module]
    graph: torch.cuda.CUDAGraph | None = None
    inputs: Any = None
    output: Any = None


def device_segments(model: torch.nn.Module) -> list[tuple[torch.device, list[torch.nn.Module]]] | None:
    """(device, decoder layers) for each run of consecutive decoder layers on one CUDA device,
    in layer order; None when the layers sit on one device. A decoder layer is a module holding an attention child
    that knows its ``layer_idx`` (transformers' decoder models)."""
    layers: list[tuple[int, torch.device, torch.nn.Module]] = []
    for module in model.modules():
        index = next((getattr(child, "layer_idx", None) for child in module._modules.values()
                      if isinstance(getattr(child, "layer_idx", None), int)), None)
        weight = next(module.parameters(), None)
        if index is not None and weight is not None:
            layers.append((index, weight.device, module))
    return consecutive_runs(layers)


def consecutive_runs(layers: list[tuple[int, torch.device, Any]]) -> list[tuple[torch.device, list]] | None:
    """(device, modules) per run of consecutive ``(layer index, device, module)`` entries on one CUDA device, in
    index order; None for fewer than two devices or any device not CUDA."""
    layers = sorted(layers, key=lambda entry: entry[0])
    if len({device for _, device, _ in layers}) < 2 or any(device.type != "cuda" for _, device, _ in layers):
        return None
    segments: list[tuple[torch.device, list]] = []
    for _, device, module in layers:
        if not segments or segments[-1][0] != device:
            segments.append((device, []))
        segments[-1][1].append(module)
    return segments


def _to_static(value: Any, device: torch.device) -> Any:
    """A captured graph's input buffer for ``value`` (tensors copied to ``device``; tuples, lists and dicts walked)."""
    if isinstance(value, torch.Tensor):
        return value.to(device, copy=True)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_static(item, device) for item in value)
    if isinstance(value, dict):
        return {name: _to_static(item, device) for name, item in value.items()}
    return value


def _copy_into(buffer: Any, value: Any) -> None:
    """Copy ``value`` into the input buffer :func:`_to_static` made from a value of its structure."""
    if isinstance(buffer, torch.Tensor):
        buffer.copy_(value)
    elif isinstance(buffer, (tuple, list)):
        for item_buffer, item in zip(buffer, value):
            _copy_into(item_buffer, item)
    elif isinstance(buffer, dict):
        for name, item_buffer in buffer.items():
            _copy_into(item_buffer, value[name])


class _LayerStep:
    """A decoder layer's ``forward`` while a decode step of a model spread over devices replays: the first layer of
    a segment replays (or captures) the segment's graph, the others hand the hidden states on; inside a capture the
    layer's own forward runs."""

    def __init__(self, segment: _Segment, position: int, original: Any) -> None:
        self.segment, self.position, self.original = segment, position, original
        self.capturing = False

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        segment = self.segment
        if self.capturing:
            return self.original(hidden_states, *args, **kwargs)
        if self.position:
            return hidden_states if not isinstance(segment.output, tuple) else (hidden_states,)
        if segment.graph is None:
            _capture_segment(segment, (hidden_states, args, kwargs))
        _copy_into(segment.inputs, (hidden_states, args, kwargs))
        with torch.cuda.device(segment.device):
            segment.graph.replay()
        return segment.output


def _capture_segment(segment: _Segment, arguments: tuple) -> None:
    """Capture ``segment``'s layers over copies of the first layer's ``arguments`` on its device's capture stream."""
    device = segment.device
    segment.inputs = _to_static(arguments, device)
    hidden, args, kwargs = segment.inputs
    steps = [layer.__dict__["forward"] for layer in segment.layers]
    graph = torch.cuda.CUDAGraph()
    stream = capture_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    for step in steps:
        step.capturing = True
    try:
        with torch.cuda.device(device), torch.cuda.graph(graph, stream=stream):
            output = hidden
            for layer in segment.layers:
                output = layer(output[0] if isinstance(output, tuple) else output, *args, **kwargs)
    finally:
        for step in steps:
            step.capturing = False
    segment.graph, segment.output = graph, output


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
    layouts: dict[torch.device, Any] = {}  # one per device (a model spread over GPUs keeps layers on each)
    for layer in layers:
        rows = layouts.get(layer.device)
        if rows is None:
            rows = layouts[layer.device] = padding_layout(attention_mask, batch, layers[0].length + steps,
                                                          layer.device, validate=False)
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
        several = graphed and torch.cuda.is_available() and torch.cuda.device_count() > 1
        self._segments = device_segments(model) if several else None

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
            if self._segments is not None:  # captured segment by segment inside the step
                segments = [_Segment(device, layers) for device, layers in self._segments]
                return self._segmented_step(self._keep(key, _Captured(None, {}, None, segments)), cache, kwargs)
            try:
                captured = self._capture(cache, kwargs, key)
            except Exception as error:  # noqa: BLE001 - any capture failure: decode eagerly from now on
                self.stats.disabled_reason = f"CUDA graph capture failed ({type(error).__name__}: {error})"
                logger.warning("hf_sparse: %s; decoding eagerly", self.stats.disabled_reason)
                self._forget()
                return self.forward(**kwargs)
        if captured.segments is not None:
            return self._segmented_step(captured, cache, kwargs)
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
        """An eager step on the capture stream (of each device the layers sit on): what capture needs then exists
        (compiled kernels, buffers)."""
        devices = ([kwargs["input_ids"].device] if self._segments is None
                   else list(dict.fromkeys(device for device, _ in self._segments)))
        with contextlib.ExitStack() as streams:
            for device in devices:
                stream = capture_stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))
                streams.enter_context(torch.cuda.stream(stream))
            if self._segments is None:
                streams.enter_context(self._fused())
            output = self.forward(**self._call_arguments(kwargs, {}))
        for device in devices:
            torch.cuda.current_stream(device).wait_stream(capture_stream(device))
        return output

    def _keep(self, key: tuple, captured: _Captured) -> _Captured:
        """Keep ``captured`` under ``key`` (at most :data:`MAX_GRAPHS`, the oldest let go first)."""
        while len(self._graphs) >= MAX_GRAPHS:
            self._graphs.pop(next(iter(self._graphs)))
        self._graphs[key] = captured
        return captured

    def _segmented_step(self, captured: _Captured, cache: SparseCache, kwargs: dict[str, Any]) -> Any:
        """A decode step of a model spread over devices: the model's forward runs eagerly, each segment's first
        layer replays the segment's graph (capturing it first where this key has none yet), the segment's other
        layers hand the hidden states on (:class:`_LayerStep`)."""
        segments = captured.segments
        capturing = any(segment.graph is None for segment in segments)
        lengths = [layer.length for layer in cache.layers] if capturing else None
        cache.prepare_replay()
        installed = []
        for segment in segments:
            for position, layer in enumerate(segment.layers):
                installed.append((layer, "forward" in layer.__dict__, layer.__dict__.get("forward")))
                layer.__dict__["forward"] = _LayerStep(segment, position, layer.forward)
        try:
            output = self.forward(**self._call_arguments(kwargs, {}))
        except Exception as error:  # noqa: BLE001 - a failed capture: decode eagerly from now on
            if not capturing:
                raise
            output = None
            self.stats.disabled_reason = f"CUDA graph capture failed ({type(error).__name__}: {error})"
            logger.warning("hf_sparse: %s; decoding eagerly", self.stats.disabled_reason)
        finally:
            for layer, had, previous in installed:
                if had:
                    layer.__dict__["forward"] = previous
                else:
                    layer.__dict__.pop("forward", None)
        if capturing:  # capture ran the Python side of the captured layers (host lengths advanced): undo it
            for layer, length in zip(cache.layers, lengths):
                layer.length = length
                layer._views()
        if output is None:
            self._forget()
            return self.forward(**kwargs)
        self.stats.captures += sum(1 for segment in segments if segment.graph is not None) if capturing else 0
        cache.advance_host_length(kwargs["input_ids"].shape[1])
        self.stats.replays += 1
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
        captured = self._keep(key, _Captured(graph, inputs, (type(output), fields, cache_field)))
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
