"""Every touch of transformers internals: registration, mask function, generate() cache hook, continuous
batching's name check, probes.

All patches are idempotent and reversible (:func:`unpatch`).
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import inspect
import logging
from typing import Any, Callable, Iterator

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.generation.utils import GenerationMixin
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import feed_forward, graphs, kernels
from .attention import dense_attention, method_config, sparse_attention_forward
from .plan import LAST_LAYER_ROWS, ReadRows
from .rope_scaling import check_context_length
from .cache import CACHE_KWARG, SparseCache, block_size_for, kv_dtype_for
from .config import CONFIG_CLASSES, CONFIG_KEY, PLASConfig
from .gate_files import autoload_gates, save_gates_alongside
from .star_attention import star_attention_forward

try:  # continuous batching (transformers' generate_batch, init_continuous_batching, `transformers serve`)
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
except ImportError:  # a release without it
    ContinuousBatchingManager = PagedAttentionCache = None

logger = logging.getLogger(__name__)

#: Attention function of each implementation this package provides.
ATTENTION_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "plas": functools.partial(sparse_attention_forward, method="plas"),
    "xattn": functools.partial(sparse_attention_forward, method="xattn"),
    "star": star_attention_forward,
}
METHODS = tuple(ATTENTION_FUNCTIONS)
#: The implementations whose configs have ``trim_last_layer``.
TRIMMED = ("plas", "xattn")
_PROBE_NAME = "hf_sparse_probe"

#: The implementations continuous batching runs (each packed request through the plan alone: rule `packed`). Star
#: is refused: its context / query split is a property of one prompt, which a packed batch of prefill chunks and
#: decode tokens does not have.
PACKED_METHODS = ("plas", "xattn")
#: Whether continuous batching hands the attention function the new K/V and its PagedAttentionCache to update
#: (transformers 5.17: ``cache`` / ``read_index`` / ``write_index`` kwargs, under the name ``paged|<impl>``) rather
#: than updating the cache in the attention module and passing every request's K/V gathered (5.25).
_CB_UPDATES_IN_FUNCTION = (PagedAttentionCache is not None and hasattr(PagedAttentionCache, "update")
                           and "read_index" in inspect.signature(PagedAttentionCache.update).parameters)
_PAGED = "paged|"


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                 mask_function: Callable | None = None, attention_mask: torch.Tensor | None = None,
                 allow_is_causal_skip: bool = True, **kwargs: Any) -> torch.Tensor | None:
    """Mask function for our implementations: for causal attention with (or without) padding, the 2D padding mask
    ``[B, kv_length]`` (or None when the caller passed none); for anything else, sdpa's own 4D mask, with which the
    attention runs dense (``hf_sparse.plan``'s ``mask`` rule).

    No dense ``[B, 1, S, S]`` mask is built for causal attention; causality is applied inside the attention
    function. The mask is returned even when it holds no padding: checking that would read it on the host every
    step. transformers turns ``allow_is_causal_skip`` off where the mask is more than causal plus padding:
    packed sequences (``position_ids`` restarting inside a row), mask overlays (``or_mask_function`` /
    ``and_mask_function``, block-wise overlays) and the decode step of a compileable cache (a SparseCache is not
    one: its CUDA-graph decode replaces transformers' compiled one).
    """
    if isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset + q_length != kv_offset + kv_length:
        raise ValueError(
            f"hf_sparse attention needs the keys to end at the last query, but this cache holds {kv_length} key slots "
            f"for queries at positions {q_offset}..{q_offset + q_length - 1}: preallocated caches such as "
            "transformers' StaticCache are not supported. Pass hf_sparse.SparseCache(model.config, max_cache_len=N) "
            "(static storage; CUDA-graph decode on CUDA), or let generate() create its cache (cache_implementation="
            "'static' is mapped to a static SparseCache)."
        )
    if not allow_is_causal_skip and mask_function is not None:
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                         allow_is_causal_skip=False, **kwargs)
    if attention_mask is None:
        return None
    return attention_mask[:, -kv_length:]


_ORIGINAL: dict[str, Any] = {}

_WINDOW_NOTED: list[bool] = []

#: A static cache generate() makes holds its tokens rounded up to a multiple of this, so that later calls with a
#: few more new tokens (or a slightly longer prompt) reuse it and its CUDA graphs (graphs.reusable_cache); shorter
#: calls round to less (:func:`static_cache_tokens`).
STATIC_CACHE_STEP = 256


def static_cache_tokens(length: int, block_size: int) -> int:
    """The tokens a static cache for ``length`` tokens holds: ``length`` rounded up to a step of
    :data:`STATIC_CACHE_STEP`, or for calls shorter than 16 such steps to the largest power of two of at most
    ``length / 16`` (and at least ``block_size``). The room beyond ``length`` then stays under a sixteenth of it:
    less than the feed-forward activation that :mod:`hf_sparse.feed_forward` saves in the prefill (SmolLM2, 1,024
    tokens and 64 new ones at block 128: 64 slots, 1.4 MiB, against 3 MiB; a 256-token step left 192 slots, 4.2 MiB,
    and a peak over sdpa-static's)."""
    step = max(block_size, min(STATIC_CACHE_STEP, 1 << max(0, (length // 16).bit_length() - 1)))
    return -(-length // step) * step


try:  # cache_implementation values that make generate() preallocate its cache
    from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS as _STATIC_CACHES
except ImportError:  # releases without the constant
    _STATIC_CACHES = ("static", "offloaded_static")


def _static_cache_length(generation_config: Any, args: tuple, kwargs: dict) -> int:
    """Tokens a static cache for this ``generate()`` call holds (transformers' own sizing)."""
    length = args[2] if len(args) > 2 else kwargs.get("max_cache_length")
    wanted = generation_config.max_length
    return max(int(length), wanted) if isinstance(length, int) and length > 0 else wanted


def _graph_cache_length(model: PreTrainedModel, generation_config: Any, args: tuple, kwargs: dict) -> int | None:
    """Tokens a static cache must hold for CUDA-graph decode of this ``generate()`` call, or None when graphs
    do not apply (not one of graphs.GRAPH_METHODS, turned off, not CUDA with the Triton kernels)."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in graphs.GRAPH_METHODS:
        return None
    config = method_config(model.config, implementation)
    weight = next(model.parameters(), None)  # a tensor on the model's device (no allocation per call)
    if not config.decode_cuda_graph or weight is None or weight.device.type != "cuda":
        return None
    if graphs.window_layers(model.config):
        if not _WINDOW_NOTED:
            _WINDOW_NOTED.append(True)
            logger.info("hf_sparse: %s has sliding-window layers (dense inside their window, on the host's length): "
                        "generate() decodes without CUDA graphs", type(model).__name__)
        return None
    if kernels.backend_for(weight) != "triton":
        return None
    return _static_cache_length(generation_config, args, kwargs)


def _default_dynamic_cache(model: PreTrainedModel, generation_config: Any, model_kwargs: dict,
                           implementation: str | None) -> bool:
    """Whether transformers' cache preparation would make a new, empty DynamicCache for this generate() call of one
    of our implementations (no cache passed, caching on, no cache_implementation, a decoder-only model that takes
    Cache objects, not an assistant's): the cache :func:`_prepare_cache_for_generation` replaces."""
    return (implementation in METHODS and model_kwargs.get(CACHE_KWARG) is None
            and generation_config.use_cache is not False and generation_config.cache_implementation is None
            and not getattr(generation_config, "is_assistant", False)
            and not getattr(model.config, "is_encoder_decoder", False)
            and "mamba" not in type(model).__name__.lower()
            and getattr(model, "_supports_default_dynamic_cache", lambda: False)())


def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
    """Default ``generate()`` cache: a SparseCache for our implementations when the user passed none (static,
    with the forward wrapped for CUDA-graph decode, where :mod:`hf_sparse.graphs` applies). A static
    ``cache_implementation`` (e.g. ``"static"``) gets a static SparseCache of transformers' size: our attention
    needs keys that end at the last query, which transformers' preallocated caches do not give."""
    implementation = getattr(self.config, "_attn_implementation", None)
    static_asked = (implementation in METHODS and generation_config.cache_implementation in _STATIC_CACHES
                    and model_kwargs.get(CACHE_KWARG) is None)
    if static_asked:  # let transformers make (and allocate) no preallocated cache; the caller's config unchanged
        generation_config = copy.copy(generation_config)
        generation_config.cache_implementation = None
    if _default_dynamic_cache(self, generation_config, model_kwargs, implementation):
        # transformers would make a DynamicCache (one object per layer) only for it to be replaced below: skip it
        # (a short prompt's generate() is bound by the host's time)
        result, replace = None, True
    else:
        result = _ORIGINAL["prepare_cache"](self, generation_config, model_kwargs, *args, **kwargs)
        cache = model_kwargs.get(CACHE_KWARG)
        replace = (implementation in METHODS and generation_config.cache_implementation is None
                   and cache is not None and type(cache).__name__ == "DynamicCache"
                   and not getattr(cache, "_is_user_defined", False) and cache.get_seq_length() == 0)
    if replace:
        length = _graph_cache_length(self, generation_config, args, kwargs)
        if length is None and static_asked:
            length = _static_cache_length(generation_config, args, kwargs)
        cache = None
        if length is not None:
            # Static storage in steps of up to STATIC_CACHE_STEP tokens, kept for the next call that fits (graphs.py).
            block_size = block_size_for(self.config)
            length = static_cache_tokens(length, block_size)
            batch = args[1] if len(args) > 1 else kwargs.get("batch_size")
            cache = graphs.reusable_cache(self, length, batch if isinstance(batch, int) else None, block_size,
                                          kv_dtype_for(self.config))
        if cache is None:
            cache = SparseCache(self.config, max_cache_len=length)
            if length is not None:
                graphs.keep_cache(self, cache)
        model_kwargs[CACHE_KWARG] = cache
    if isinstance(cache, SparseCache) and cache.static_length is not None and implementation in graphs.GRAPH_METHODS:
        graphs.install(self)
    return result


#: Forward arguments (or config fields) that ask for more of the last layer than the kept positions' logits.
_READ_MORE = ("output_hidden_states", "output_attentions", "output_router_logits")


def _watch_prefill(model: PreTrainedModel, trim: bool, slices: feed_forward.Slices | None) -> list[Any]:
    """Hooks around ``model``'s forwards, their handles. While a forward runs: with ``trim``,
    :data:`~hf_sparse.attention.LAST_LAYER_ROWS` holds the forward's ``logits_to_keep`` (a positive int) where the
    call asks for no hidden states, attentions or router logits (what would read the last layer's other rows); with
    ``slices``, its feed-forward blocks run through :func:`hf_sparse.feed_forward.lean_forward`. The
    hooks remove themselves at the first forward of no more positions than it keeps (or of one position): a decode
    step, the prompt is done, and the steps' time is spared the hooks."""
    state: list[tuple[contextvars.Token | None, list[torch.nn.Module]]] = []
    handles: list[Any] = []

    def before(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        keep = kwargs.get("logits_to_keep")
        keep = keep if type(keep) is int and keep > 0 else None
        inputs = kwargs.get("input_ids")
        inputs = kwargs.get("inputs_embeds") if inputs is None else inputs
        inputs = args[0] if inputs is None and args else inputs
        positions = inputs.shape[1] if isinstance(inputs, torch.Tensor) and inputs.dim() >= 2 else None
        if positions is not None and positions <= (keep or 1):
            for handle in handles:
                handle.remove()
            return
        token = None
        if trim:
            asked = ({name: getattr(module.config, name, False) for name in _READ_MORE}
                     | {name: kwargs[name] for name in _READ_MORE if kwargs.get(name) is not None})
            read = ReadRows(keep) if keep is not None and not args and not any(asked.values()) else None
            token = LAST_LAYER_ROWS.set(read)
        lean = slices is not None and positions is not None
        state.append((token, feed_forward.swap_in(model, slices) if lean else []))

    def after(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if state:
            token, blocks = state.pop()
            if token is not None:
                LAST_LAYER_ROWS.reset(token)
            feed_forward.swap_out(blocks)

    handles += [model.register_forward_pre_hook(before, with_kwargs=True),
                model.register_forward_hook(after, with_kwargs=True, always_call=True)]
    return handles


def _generate(self, *args: Any, **kwargs: Any) -> Any:
    """``generate()`` of our implementations with the prefill's forwards watched (:func:`_watch_prefill`: the rows
    they read, their feed-forward blocks), after which the CUDA-graph wrapper the cache hook may have installed is
    removed."""
    check_context_length(self, kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else
                                                                  kwargs.get("inputs_embeds"))))
    implementation = getattr(self.config, "_attn_implementation", None)
    handles = []
    if implementation in METHODS:
        config = method_config(self.config, implementation)
        handles = _watch_prefill(self, implementation in TRIMMED, feed_forward.slices_for(config))
    try:
        return _ORIGINAL["generate"](self, *args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
        graphs.uninstall(self)


def _from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
    """``from_pretrained``, then, for attn_implementation="plas", the gate file from the model's folder or repo."""
    result = _ORIGINAL["from_pretrained"](cls, *args, **kwargs)
    model = result[0] if isinstance(result, tuple) else result
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == "plas":
        autoload_gates(model, revision=kwargs.get("revision"))
    return result


def _save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
    """``save_pretrained``, then the attached PLAS gates (if any) into the same folder (on the main process; under
    tensor parallelism every rank takes part in gathering their heads)."""
    result = _ORIGINAL["save_pretrained"](self, save_directory, *args, **kwargs)
    is_main_process = args[0] if args else kwargs.get("is_main_process", True)  # save_pretrained's second parameter
    save_gates_alongside(self, save_directory, is_main_process=bool(is_main_process))
    return result


def _cb_friendly_attn(self, model: PreTrainedModel, *args: Any, **kwargs: Any) -> None:
    """``ContinuousBatchingManager.switch_to_cb_friendly_attn`` that keeps "plas" and "xattn" (transformers' own
    refuses every name but eager, sdpa and flash ones, 5.25, or swaps in flash attention where it is installed) and
    refuses "star" with the reason; other implementations go to transformers' own. On 5.17 our implementations run
    under ``paged|<name>`` (:func:`_paged_forward`), restored by the manager's ``stop()``."""
    implementation = model.config._attn_implementation
    name = implementation.removeprefix(_PAGED)
    if name == "star":
        raise NotImplementedError(
            "hf_sparse: attn_implementation='star' does not run under continuous batching: Star's split of one "
            "prompt into context and query has no meaning in a packed batch of prefill chunks and decode tokens. "
            "Use 'plas' or 'xattn', or generate() for Star.")
    if name not in PACKED_METHODS:
        return _ORIGINAL["cb_attn"](self, model, *args, **kwargs)
    if _CB_UPDATES_IN_FUNCTION and implementation == name:
        model.set_attn_implementation(_PAGED + name)
        self._original_attn_impl = name
    return None


def _paged_forward(function: Callable[..., Any]) -> Callable[..., Any]:
    """The attention function registered as ``paged|<name>`` for transformers releases whose continuous batching
    leaves the cache update to the function (5.17): write the new K/V into the PagedAttentionCache, read every
    request's K/V back (``[total_k, Hkv, D]``, as transformers' ``paged|sdpa`` does), then ``function`` on them."""

    def forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        cache = kwargs.pop("cache", None)
        if cache is None:
            raise ValueError(f"{module.config._attn_implementation} was called without continuous batching's paged "
                             "cache; load the model with the name without 'paged|'")
        key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                                  read_index=kwargs["read_index"], write_index=kwargs["write_index"])
        key, value = key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0)
        return function(module, query, key, value, attention_mask, *args, **kwargs)

    return forward


def patch() -> None:
    """Register our attention/mask functions and install the generate() (cache, CUDA-graph wrapper),
    from_pretrained() and save_pretrained() hooks and continuous batching's name check (idempotent)."""
    for name, function in ATTENTION_FUNCTIONS.items():
        AttentionInterface.register(name, function)
    for name in METHODS + (_PROBE_NAME,):
        AttentionMaskInterface.register(name, padding_mask)
    if _CB_UPDATES_IN_FUNCTION:
        for name in PACKED_METHODS:
            AttentionInterface.register(_PAGED + name, _paged_forward(ATTENTION_FUNCTIONS[name]))
    if (ContinuousBatchingManager is not None and hasattr(ContinuousBatchingManager, "switch_to_cb_friendly_attn")
            and "cb_attn" not in _ORIGINAL):
        _ORIGINAL["cb_attn"] = ContinuousBatchingManager.switch_to_cb_friendly_attn
        ContinuousBatchingManager.switch_to_cb_friendly_attn = _cb_friendly_attn
    if "prepare_cache" not in _ORIGINAL:
        _ORIGINAL["prepare_cache"] = GenerationMixin._prepare_cache_for_generation
        GenerationMixin._prepare_cache_for_generation = _prepare_cache_for_generation
    if "generate" not in _ORIGINAL:
        _ORIGINAL["generate"] = GenerationMixin.generate
        GenerationMixin.generate = functools.wraps(_ORIGINAL["generate"])(_generate)
    if "from_pretrained" not in _ORIGINAL:
        _ORIGINAL["from_pretrained"] = PreTrainedModel.from_pretrained.__func__
        PreTrainedModel.from_pretrained = classmethod(_from_pretrained)
    if "save_pretrained" not in _ORIGINAL:
        _ORIGINAL["save_pretrained"] = PreTrainedModel.save_pretrained
        PreTrainedModel.save_pretrained = _save_pretrained


def unpatch() -> None:
    """Undo :func:`patch`'s hooks (registered names stay, as transformers cannot unregister)."""
    if "prepare_cache" in _ORIGINAL:
        GenerationMixin._prepare_cache_for_generation = _ORIGINAL.pop("prepare_cache")
    if "generate" in _ORIGINAL:
        GenerationMixin.generate = _ORIGINAL.pop("generate")
    if "from_pretrained" in _ORIGINAL:
        PreTrainedModel.from_pretrained = classmethod(_ORIGINAL.pop("from_pretrained"))
    if "save_pretrained" in _ORIGINAL:
        PreTrainedModel.save_pretrained = _ORIGINAL.pop("save_pretrained")
    if "cb_attn" in _ORIGINAL:
        ContinuousBatchingManager.switch_to_cb_friendly_attn = _ORIGINAL.pop("cb_attn")


def _check_model(model: PreTrainedModel) -> None:
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"expected a transformers PreTrainedModel, got {type(model).__name__}")
    if not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface, "
            "so hf_sparse cannot replace its attention"
        )


def configure(model: PreTrainedModel, config: Any = None) -> PreTrainedModel:
    """Attach a method configuration (PLASConfig, XAttnConfig or StarConfig; default PLASConfig()) to ``model``,
    stored in ``model.config``, and switch its attention to that method."""
    _check_model(model)
    config = config if config is not None else PLASConfig()
    if not isinstance(config, tuple(CONFIG_CLASSES.values())):
        names = ", ".join(cls.__name__ for cls in CONFIG_CLASSES.values())
        raise TypeError(f"configure() takes one of {names}; got {type(config).__name__}")
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
