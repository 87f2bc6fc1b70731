"""CUDA-graph decode inside ``generate()``: each decode step of a static SparseCache replays one captured forward.

Eager decode is bound by the host: a 32-layer model launches hundreds of kernels per token from Python. Over a
static :class:`~hf_sparse.SparseCache` the PLAS and XAttention decode paths read every length on the device
(:func:`hf_sparse.attention.static_decode`), so one captured forward is valid for every later step of the same
sequence. :class:`DecodeGraphs` wraps a model's ``forward`` for the length of one ``generate()`` call
(:func:`install` from the cache hook, :func:`uninstall` when generate() returns): the first qualifying decode call
runs eagerly (on the capture stream: kernels compile, per-stream buffers are made), the second is captured and
replayed, and later ones copy their inputs into the captured buffers and replay. Any other call runs the model's
forward unchanged. A new cache, a re-allocated or reordered one, or a new batch or step width captures again.
:func:`stats` tells what happened (replays, captures, and why graphs were turned off, if they were).
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from .attention import DECODE_MAX_QUERY, method_config
from .recording import recording
from .cache import CACHE_KWARGS, SparseCache

logger = logging.getLogger(__name__)

#: Attention implementations whose decode over a static SparseCache reads no host length
#: (:func:`hf_sparse.attention.static_decode`), so one captured step replays for every later one.
GRAPH_METHODS = ("plas", "xattn")

#: Keyword arguments a captured forward takes; a call with any other runs eagerly.
_ACCEPTED = {"input_ids", "position_ids", "attention_mask", "use_cache", "return_dict", "logits_to_keep",
             "cache_position", "output_attentions", "output_hidden_states", *CACHE_KWARGS}


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


@dataclass
class GraphStats:
    """Counts over a model's generate() calls: decode steps replayed, graphs captured, and the reason graphs were
    turned off for this model (a failed capture), if any."""

    replays: int = 0
    captures: int = 0
    disabled_reason: str | None = None


class DecodeGraphs:
    """A model's ``forward`` whose decode calls over a static SparseCache run as CUDA-graph replays."""

    def __init__(self, model: torch.nn.Module, forward: Any, previous: Any, stats: GraphStats) -> None:
        self._model = model
        self.forward = forward
        self.previous = previous  # the instance attribute `forward` replaced (e.g. accelerate's hook), if any
        self.stats = stats
        self.__wrapped__ = forward  # inspect.signature(model.forward) still sees the model's arguments
        self.__doc__ = getattr(forward, "__doc__", None)
        self._stream: torch.cuda.Stream | None = None
        self._forget()

    def _forget(self) -> None:
        self._cache: weakref.ref | None = None
        self._key: tuple | None = None
        self._warm = False
        self._graph: torch.cuda.CUDAGraph | None = None
        self._inputs: dict[str, torch.Tensor] = {}
        self._output: tuple[type, dict[str, Any], str] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = None if args else self._graph_key(kwargs)
        if key is None:
            return self.forward(*args, **kwargs)
        cache = _cache_of(kwargs)
        if self._cache is None or self._cache() is not cache or self._key != key:
            self._forget()
            self._cache, self._key = weakref.ref(cache), key
        if self._graph is None:
            if not self._warm:
                self._warm = True
                return self._on_capture_stream(kwargs)
            try:
                self._capture(cache, kwargs)
            except Exception as error:  # noqa: BLE001 - any capture failure: decode eagerly from now on
                self.stats.disabled_reason = f"CUDA graph capture failed ({type(error).__name__}: {error})"
                logger.warning("hf_sparse: %s; decoding eagerly", self.stats.disabled_reason)
                self._forget()
                return self.forward(**kwargs)
        return self._replay(cache, kwargs)

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
        implementation = getattr(self._model.config, "_attn_implementation", None)
        if implementation not in GRAPH_METHODS:
            return None
        config = method_config(self._model.config, implementation)
        if not config.decode_cuda_graph or not cache.layers:
            return None
        steps = input_ids.shape[1]
        for layer in cache.layers:
            if (not getattr(layer, "static", False) or layer.key_storage is None
                    or layer.row_layout is None or layer.length + steps > layer.capacity):
                return None
        if cache.layers[0].length < config.dense_threshold("decode"):
            return None  # short sequences decode dense (sdpa, bit-equal), on the host's length
        tensors = tuple((name, tuple(value.shape), value.dtype) for name, value in sorted(kwargs.items())
                        if isinstance(value, torch.Tensor) and name != "attention_mask")
        others = tuple((name, value) for name, value in sorted(kwargs.items())
                       if not isinstance(value, torch.Tensor) and name not in CACHE_KWARGS)
        return tensors + others + (cache.layout_version,)

    # -- capture and replay ------------------------------------------------------------------------------
    def _capture_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _call_arguments(self, kwargs: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        # The decode path takes padding from the cache, not from the mask, so the mask stays out of the graph.
        call = {name: value for name, value in kwargs.items() if name != "attention_mask"}
        call.update(tensors)
        return call

    def _on_capture_stream(self, kwargs: dict[str, Any]) -> Any:
        """An eager step on the capture stream: what capture needs then exists (compiled kernels, buffers)."""
        device = kwargs["input_ids"].device
        stream = self._capture_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            output = self.forward(**self._call_arguments(kwargs, {}))
        torch.cuda.current_stream(device).wait_stream(stream)
        return output

    def _capture(self, cache: SparseCache, kwargs: dict[str, Any]) -> None:
        device = kwargs["input_ids"].device
        inputs = {name: value.clone() for name, value in kwargs.items()
                  if isinstance(value, torch.Tensor) and name != "attention_mask"}
        lengths = [layer.length for layer in cache.layers]
        graph = torch.cuda.CUDAGraph()
        stream = self._capture_stream(device)
        try:
            with torch.cuda.graph(graph, stream=stream):
                output = self.forward(**self._call_arguments(kwargs, inputs))
        finally:
            # Capture ran the Python side of a step (host lengths advanced) but no device work: undo it.
            for layer, length in zip(cache.layers, lengths):
                layer.length = length
                layer._views()
        # Keep the output's buffers, not its cache: the cache must be freed when generate() lets it go.
        fields = {name: value for name, value in output.items() if name not in CACHE_KWARGS}
        cache_field = next((name for name in CACHE_KWARGS if name in output.keys()), CACHE_KWARGS[0])
        self._graph, self._inputs, self._output = graph, inputs, (type(output), fields, cache_field)
        self.stats.captures += 1

    def _replay(self, cache: SparseCache, kwargs: dict[str, Any]) -> Any:
        for name, buffer in self._inputs.items():
            buffer.copy_(kwargs[name])
        self._graph.replay()
        cache.advance_host_length(kwargs["input_ids"].shape[1])
        self.stats.replays += 1
        output_type, fields, cache_field = self._output
        fields = dict(fields, **{cache_field: cache})
        fields["logits"] = fields["logits"].clone()  # the graph's buffer is overwritten by the next replay
        return output_type(**fields)


def install(model: torch.nn.Module) -> DecodeGraphs:
    """Wrap ``model.forward`` in :class:`DecodeGraphs` (an instance attribute; once; undone by :func:`uninstall`)."""
    current = model.__dict__.get("forward")
    if isinstance(current, DecodeGraphs):
        return current
    stats = model.__dict__.get(_STATS_ATTR)
    if stats is None:
        stats = GraphStats()
        model.__dict__[_STATS_ATTR] = stats
    wrapper = DecodeGraphs(model, model.forward, current, stats)
    model.__dict__["forward"] = wrapper
    return wrapper


def uninstall(model: torch.nn.Module) -> None:
    """Restore the ``forward`` :func:`install` replaced and free the captured graph."""
    wrapper = model.__dict__.get("forward")
    if not isinstance(wrapper, DecodeGraphs):
        return
    if wrapper.previous is None:
        del model.__dict__["forward"]
    else:
        model.__dict__["forward"] = wrapper.previous
    wrapper._forget()


def stats(model: torch.nn.Module) -> GraphStats | None:
    """What CUDA-graph decode did over ``model``'s generate() calls so far (None if it never applied)."""
    return model.__dict__.get(_STATS_ATTR)
