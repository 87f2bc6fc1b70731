"""Which path an attention call takes, and why: every rule in one place, in order.

An attention call of "plas" or "xattn" runs one of three paths:

* ``DENSE``: what ``attn_implementation="sdpa"`` computes (eager's math where the model passes softcapping or
  sinks), with int8 K/V dequantised and logN scaling applied where configured: exact;
* ``ALL_BLOCKS``: every valid key block of a static cache through the decode kernel, the lengths read on the
  device: a dense decode step that a CUDA graph can replay (sdpa would take the host's length);
* ``SPARSE``: the method selects key blocks (``methods/``), the sparse kernels attend to them.

:func:`plan_call` applies :data:`RULES` in order; the first that applies decides, and the :class:`Plan` names it.
A call's K/V are int8 only where they are an int8 cache's storage (:attr:`Call.quantized`): a layer's first
prefill gets the states it has in hand, in the compute dtype, and every path runs on them as over a float cache.
Two rules need the selection itself and are applied while the sparse path runs (on CUDA only, where dense attention
is faster than the sparse kernel at high density): :func:`after_probe` and :func:`after_selection`. Star Attention's
phases have their own rules, :func:`plan_star`.

**Rows.** A batch's rows may hold sequences of different lengths (left padding). Every row runs what it would run
alone: where the longest row is sparse but some rows would run dense alone (shorter than ``dense_below``, or on CUDA
at or above the density threshold), the sparse call gives those rows every causal block (``Plan.full_rows``), which
is dense attention up to rounding.

**Packed requests.** transformers' continuous batching packs its requests along the sequence of one row (prefills,
prefill chunks and decode tokens together, ``cu_seq_lens_q`` / ``cu_seq_lens_k``, no mask): rule ``packed`` splits
the call into its requests (:func:`packed_requests`), and each runs these rules as a call of that request alone.

**Forwards.** A prompt that runs dense in its first layer for a reason that holds for every layer (``length``,
``floor``: shapes and configuration alone) runs dense in all of them: the first layer remembers the decision
(:func:`remember_forward`) and the later layers of the same forward look it up (:func:`forward_dense`) in a few
host steps: a prompt of a few thousand tokens is bound by the host's time per layer.
"""
from __future__ import annotations

import contextvars
import functools
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import density, kernels
from .cache import DECODE_MAX_QUERY
from .config import config_value, stored_config
from .log import warn_once
from .methods import METHODS
from .methods.star import StarMethod
from .padding import holds_no_padding, row_layout
from .recording import recording
from .selection import RowLayout

logger = logging.getLogger(__name__)

DENSE, ALL_BLOCKS, SPARSE = "dense", "all_blocks", "sparse"

#: The rules of :func:`plan_call`, in the order they apply, with what each decides. Each has a test that names it
#: (tests/test_plan.py).
RULES = (
    ("packed", "requests packed along the sequence by transformers' continuous batching (cu_seq_lens_q / "
               "cu_seq_lens_k, no mask): each request runs these rules alone, over its own keys"),
    ("forward", "a later layer of a forward whose first layer ran dense by `length` or `floor`: DENSE"),
    ("inputs", "an input the method cannot take: a clear error (dtype, features it does not compute, non-causal "
               "attention); output_attentions=True is warned about once and returns no weights, as sdpa"),
    ("mask", "a 4D mask (custom, or one transformers built for packed sequences or mask overlays): DENSE"),
    ("window", "a sliding-window layer: DENSE inside its window"),
    ("dense_layer", "one of the configuration's dense_layers: DENSE (ALL_BLOCKS in a static decode step)"),
    ("length", "every row shorter than dense_below: DENSE (ALL_BLOCKS in a static decode step)"),
    ("padding", "a mask that is not left padding (right padding): DENSE, warned about once"),
    ("dropout", "attention dropout (a model in training mode): DENSE"),
    ("floor", "CUDA prefill: the sparsest selection already keeps the density threshold: DENSE"),
    ("remembered", "CUDA prefill: this layer's decision for this length bucket, taken by an earlier call"),
    ("sparse", "SPARSE; rows that alone would run dense get every causal block"),
    ("probe", "(after_probe) CUDA prefill of >= 4 x PROBE_QUERIES queries: the probe's density reaches the "
              "threshold in every row: DENSE; in some rows: those rows get every causal block"),
    ("measured", "(after_selection) CUDA prefill: the selection's density reaches dense_above_density in every "
                 "row: DENSE; in some rows: those rows get every causal block"),
)

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: What models pass through the attention interface that only some implementations compute, by argument name.
FEATURES = {"softcap": "attention logit softcapping", "s_aux": "attention sinks", "position_bias": "a position bias"}
#: The FEATURES the "plas" and "xattn" attention compute (Gemma 2's softcapping, GPT-OSS's sinks).
SPARSE_FEATURES = ("softcap", "s_aux")
#: Keyword arguments that keep a call off the forward-wide dense decision (a feature to compute or refuse).
_UNUSUAL_KWARGS = frozenset(FEATURES) | {"output_attentions", "sliding_window"}
#: :func:`forward_dense` reasons that hold for every layer of a forward (shapes and configuration alone).
FORWARD_WIDE = ("length", "floor")


def call_phase(num_queries: int, key_length: int) -> str:
    """``"decode"`` for a call of at most :data:`DECODE_MAX_QUERY` queries with a past, else ``"prefill"``."""
    return "decode" if num_queries <= DECODE_MAX_QUERY and key_length > num_queries else "prefill"


def asks_more_than_sdpa(kwargs: dict[str, Any]) -> bool:
    """Whether a call's keyword arguments set any of :data:`_UNUSUAL_KWARGS`. Most calls pass none: one set test."""
    return not _UNUSUAL_KWARGS.isdisjoint(kwargs) and any(kwargs.get(name) is not None for name in _UNUSUAL_KWARGS)


def check_inputs(kwargs: dict[str, Any], query: torch.Tensor, computed: tuple[str, ...] = (),
                 implementation: str = "hf_sparse", causal: bool = True) -> None:
    """The ``inputs`` rule: raise a clear error for what ``implementation`` cannot take (a dtype, arguments of
    :data:`FEATURES` not in ``computed``, non-causal attention); warn once about ``output_attentions``, whose
    weights no hf_sparse path returns (as sdpa returns none)."""
    if query.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"hf_sparse attention supports float32/float16/bfloat16, got {query.dtype}")
    if not causal:
        raise NotImplementedError(f"{implementation} attention supports causal (decoder) attention only")
    if kwargs.get("output_attentions"):
        warn_once("output_attentions", "hf_sparse attention (%s) returns no attention weights: output_attentions=True "
                  "gives None attentions, as sdpa does; load the model with attn_implementation='eager' to inspect "
                  "attention", implementation)
    for name, feature in FEATURES.items():
        if name not in computed and kwargs.get(name) is not None:
            others = "; attn_implementation='plas' and 'xattn' compute it" if name in SPARSE_FEATURES else ""
            raise NotImplementedError(f"{implementation} attention does not support `{name}` ({feature}), which this "
                                      f"model passes{others}")


# -- packed requests (continuous batching) -------------------------------------------------------------------------
#: Keyword arguments of transformers' continuous batching that describe the packed batch as a whole: a request run
#: alone (:func:`packed_requests`) gets none of them (``position_ids``: its own slice).
PACKED_KWARGS = frozenset(("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "max_seqlen_q",
                           "max_seqlen_k", "read_index", "write_index", "block_table", "cache", "logits_indices",
                           "logits_processor_args", "is_causal", "use_cache"))


@dataclass(frozen=True)
class PackedRequest:
    """One request of a packed batch: its queries' and its keys' positions along the packed sequence. Its queries
    are the last of its keys (a prefill chunk or a decode token after the request's earlier tokens)."""

    queries: slice
    keys: slice


def packed_requests(attention_mask: torch.Tensor | None, kwargs: dict[str, Any]) -> list[PackedRequest] | None:
    """The ``packed`` rule: the requests of a call that packs them along the sequence (transformers' continuous
    batching: query ``[1, H, total_q, D]``, keys ``[1, Hkv, total_k, D]``, ``cu_seq_lens_q`` / ``cu_seq_lens_k``
    cumulative lengths, no mask), those with queries; None for any other call. A call with a mask is not split: the
    mask already keeps the sequences apart (packed training sequences with a 4D mask: rule ``mask``)."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None or cu_k is None or attention_mask is not None:
        return None
    if isinstance(cu_k, dict):
        raise NotImplementedError("hf_sparse attention under continuous batching: models with several layer types "
                                  f"(per-type key lengths {sorted(cu_k)}) are not supported yet")
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    if len(starts_q) != len(starts_k):
        raise ValueError(f"cu_seq_lens_q ({len(starts_q)}) and cu_seq_lens_k ({len(starts_k)}) count different "
                         "requests")
    requests = []
    for q0, q1, k0, k1 in zip(starts_q, starts_q[1:], starts_k, starts_k[1:]):
        if q1 - q0 > k1 - k0:
            raise ValueError(f"a packed request has {q1 - q0} queries but only {k1 - k0} keys")
        if q1 > q0:
            requests.append(PackedRequest(slice(q0, q1), slice(k0, k1)))
    return requests


# -- the rows a caller reads --------------------------------------------------------------------------------------
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


def mark_sparse() -> None:
    """Tell the running forward (:data:`LAST_LAYER_ROWS`) that one of its layers attended sparsely."""
    state = LAST_LAYER_ROWS.get()
    if state is not None:
        state.sparse = True


# -- one call, and its plan ---------------------------------------------------------------------------------------
@dataclass
class Call:
    """One attention call as the rules see it: its arguments, the method's configuration and the cache layer that
    holds its keys (None without a SparseCache). Nothing here reads the device."""

    method: str
    config: Any
    module: torch.nn.Module
    query: torch.Tensor
    key: torch.Tensor
    attention_mask: torch.Tensor | None
    layer: Any
    kwargs: dict[str, Any]
    dropout: float = 0.0

    def __post_init__(self) -> None:
        self.num_queries = self.query.shape[2]
        self.key_length = self.key.shape[2]
        self.phase = call_phase(self.num_queries, self.key_length)
        self.layer_idx = getattr(self.module, "layer_idx", 0)

    @property
    def num_layers(self) -> int:
        return config_value(self.module.config, "num_hidden_layers", self.layer_idx + 1)

    @property
    def quantized(self) -> bool:
        """Whether the call's K/V are int8: an int8 SparseCache layer's storage, read with the layer's scales. An
        int8 layer's first prefill gets the states it was given, in the compute dtype (``SparseCacheLayer.append``),
        and runs as over a float cache."""
        return self.layer is not None and self.key.dtype == torch.int8

    @functools.cached_property
    def static(self) -> bool:
        """A decode step over a static SparseCache layer of the method's kernel block size on the Triton path: it
        depends on no host length, so it replays correctly under a CUDA graph (PLAS reads nothing back to the host;
        XAttention's selection is device-side torch ops plus the threshold kernel; Star's global decode and every
        dense layer attend to all blocks)."""
        layer, config = self.layer, self.config
        return (self.phase == "decode" and layer is not None and getattr(layer, "static", False)
                and layer.row_layout is not None
                and layer.block_size == getattr(config, "kernel_block_size", config.block_size)
                and self.kwargs.get("sliding_window") is None and kernels.backend_for(self.query) == "triton")

    @property
    def by_density(self) -> bool:
        """Whether the density fallback applies: a prefill on CUDA with the Triton kernels and a threshold."""
        return (self.phase == "prefill" and self.config.dense_above_density is not None
                and density.falls_back_by_density(self.query))


@dataclass(frozen=True)
class Plan:
    """What a call runs (``path``), by which rule, and how.

    Attributes:
        path: ``DENSE``, ``ALL_BLOCKS`` or ``SPARSE``.
        rule: the name of the rule of :data:`RULES` that decided.
        reason: why a call runs dense (a string, or a function making it: a short prefill is bound by the host's
            time, and a reason is formatted only where it is read).
        rows: the rows' padding layout (SPARSE).
        full_rows: bool ``[B]``: rows that get every causal block in a SPARSE call (they would run dense alone);
            None when no row does.
        probe: CUDA prefill: probe the density before selecting for every query (:func:`after_probe`).
        measure: CUDA prefill: read the selection's density (:func:`after_selection`).
        read_rows: the last rows a DENSE prefill computes (its caller reads no other; ``trim_last_layer``).
    """

    path: str
    rule: str
    reason: str | Callable[[], str] | None = None
    rows: RowLayout | None = None
    full_rows: torch.Tensor | None = None
    probe: bool = False
    measure: bool = False
    read_rows: int | None = None

    def why(self) -> str:
        """The reason as a string."""
        return self.reason() if callable(self.reason) else (self.reason or "")


def _dense(call: Call, rule: str, reason: str | Callable[[], str]) -> Plan:
    """A DENSE plan, or ALL_BLOCKS where the call is a static decode step (a CUDA graph replays it)."""
    if call.static:
        return Plan(ALL_BLOCKS, rule, reason)
    return Plan(DENSE, rule, reason, read_rows=read_rows(call.config, call.module, call.num_queries)
                if call.phase == "prefill" else None)


def plan_call(call: Call) -> Plan:
    """The plan of one "plas" / "xattn" call: :data:`RULES` in order (``forward`` is :func:`forward_dense`, looked
    up before a :class:`Call` is made)."""
    config, kwargs, phase = call.config, call.kwargs, call.phase
    # inputs
    check_inputs(kwargs, call.query, SPARSE_FEATURES, call.method, getattr(call.module, "is_causal", True))
    # mask
    mask = call.attention_mask
    if mask is not None and mask.dim() != 2:
        return Plan(DENSE, "mask", f"a {mask.dim()}D attention mask (custom or packed sequences)")
    # window
    window = kwargs.get("sliding_window")
    if window is not None:
        return Plan(DENSE, "window", f"sliding window of {window} tokens")
    # dense_layer
    if config.dense_layers and config.is_dense_layer(call.layer_idx, call.num_layers):
        return _dense(call, "dense_layer", "dense_layers")
    # length: the longest row decides for the call (shorter rows: `full_rows` below)
    threshold = config.dense_threshold(phase)
    if call.key_length < threshold:
        return _dense(call, "length", _length_reason(call.key_length, threshold))
    # padding
    rows = _rows(call)
    if rows is None:
        warn_once("padding", "hf_sparse: an attention mask with masked slots after unmasked ones (right padding) "
                  "runs dense attention (sdpa); left padding (padding_side='left') runs sparse")
        return Plan(DENSE, "padding", "not left padding")
    # dropout
    if call.dropout:
        return Plan(DENSE, "dropout", f"attention dropout {call.dropout}")
    full_rows = _short_rows(call, rows, threshold)
    if call.by_density:
        # floor
        floor, dense_from, share = density.known_floor_and_threshold(
            METHODS[call.method], config, call.num_queries, call.key_length, call.query.shape[-1])
        if floor >= dense_from:
            return Plan(DENSE, "floor", lambda: f"the sparsest selection keeps {floor:.3f} >= {dense_from:.3f} "
                        f"(dense_above_density {config.dense_above_density} less the selection, {share:.2f} of "
                        "dense attention)", read_rows=read_rows(config, call.module, call.num_queries))
        # remembered (a padded batch decides per row, from its own selection)
        if config.density_memory and rows.low == rows.high:
            known = density.recall(call.module, config, call.key_length, call.num_queries)
            if known is not None:
                if known.dense:
                    return Plan(DENSE, "remembered", f"{known.reason}; remembered for this length",
                                read_rows=read_rows(config, call.module, call.num_queries))
                return Plan(SPARSE, "sparse", rows=rows, full_rows=full_rows)
        return Plan(SPARSE, "sparse", rows=rows, full_rows=full_rows,
                    probe=call.num_queries >= 4 * density.PROBE_QUERIES, measure=True)
    return Plan(SPARSE, "sparse", rows=rows, full_rows=full_rows)


def _length_reason(key_length: int, threshold: int) -> Callable[[], str]:
    return lambda: f"length {key_length} < dense_below {threshold}"


def _rows(call: Call) -> RowLayout | None:
    """The rows' padding layout (for a decode step, the one the cache took when the sequence started); None when
    the mask is not left padding."""
    layer = call.layer
    if call.phase == "decode" and layer is not None and layer.row_layout is not None:
        return layer.row_layout
    return row_layout(call.attention_mask, call.query.shape[0], call.key_length, call.query.device)


def _short_rows(call: Call, rows: RowLayout, threshold: int) -> torch.Tensor | None:
    """bool ``[B]``: the rows shorter than ``threshold`` (which alone run dense), where some may be; else None. A
    static decode step compares on the device whenever rows differ in length: a CUDA graph captured now replays for
    later steps, and for a later sequence with the same padding layout, whose rows may be shorter than these."""
    if rows.high == 0:
        return None
    if call.static:
        return (call.layer.device_length - rows.starts) < threshold
    if call.key_length - rows.high >= threshold:
        return None
    return (call.key_length - rows.starts) < threshold


# -- the density fallback (CUDA prefill), applied while the sparse path runs --------------------------------------
def probe_threshold(call: Call) -> tuple[float, float]:
    """(density from which the probe sends a row dense, the selection's share of dense time behind it)."""
    _, threshold, share = density.known_floor_and_threshold(METHODS[call.method], call.config, call.num_queries,
                                                            call.key_length, call.query.shape[-1])
    return threshold, share


def after_probe(call: Call, plan: Plan, row_density: torch.Tensor) -> Plan:
    """The ``probe`` rule: ``row_density`` (float ``[B]``, on the host) of the probe's selection. Every row at or
    above the threshold: DENSE (remembered with ``density_memory``); some rows: those get every causal block."""
    threshold, share = probe_threshold(call)
    dense = row_density >= threshold
    if bool(dense.all()):
        value = float(row_density.min())
        reason = (f"probe density {value:.3f} ({density.PROBE_QUERIES} queries in {density.PROBE_RUNS} runs) >= "
                  f"{threshold:.3f} (dense_above_density {call.config.dense_above_density} less the selection still "
                  f"to run, {share:.2f} of dense attention)")
        _remember_density(call, plan, True, reason)
        return Plan(DENSE, "probe", reason, read_rows=read_rows(call.config, call.module, call.num_queries))
    return _with_full_rows(plan, dense, "probe")


def after_selection(call: Call, plan: Plan, row_density: torch.Tensor) -> Plan:
    """The ``measured`` rule: ``row_density`` (float ``[B]``, on the host) of the full selection. Every row at or
    above ``dense_above_density``: DENSE; some rows: those get every causal block. Remembered with
    ``density_memory``."""
    limit = call.config.dense_above_density
    dense = row_density >= limit
    all_dense = bool(dense.all())
    value = float(row_density.min())
    reason = f"density {value:.3f} >= dense_above_density {limit}" if all_dense else ""
    if all_dense or not bool(dense.any()):  # rows that decide apart: nothing to remember for the next call
        _remember_density(call, plan, all_dense, reason)
    if all_dense:
        return Plan(DENSE, "measured", reason, read_rows=read_rows(call.config, call.module, call.num_queries))
    return _with_full_rows(plan, dense, "measured")


def _remember_density(call: Call, plan: Plan, dense: bool, reason: str) -> None:
    """Keep a density decision for later calls of this layer and length bucket (unpadded batches only: a padded
    batch decides per row)."""
    if call.config.density_memory and plan.rows is not None and plan.rows.low == plan.rows.high:
        density.remember(call.module, call.config, call.key_length, call.num_queries, dense, reason)


def _with_full_rows(plan: Plan, dense: torch.Tensor, rule: str) -> Plan:
    """``plan`` with the rows of ``dense`` (bool ``[B]``) added to its full rows (where any is)."""
    if not bool(dense.any()):
        return plan
    dense = dense.to(plan.rows.starts.device)
    full = dense if plan.full_rows is None else plan.full_rows | dense
    return Plan(SPARSE, rule, rows=plan.rows, full_rows=full, probe=False, measure=plan.measure and rule == "probe")


# -- forward-wide decisions -----------------------------------------------------------------------------------------
#: The forward whose layers all run dense (a FORWARD_WIDE decision of its first layer), one tuple replaced whole:
#: (weak reference to the forward's :func:`_forward_marker`; the model config; the method configuration dict it
#: holds; the query shape; the key length; whether sdpa takes the call without a mask, i.e. no padding).
_DENSE_FORWARD: list[tuple] = []


def _forward_marker(attention_mask: torch.Tensor | None, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The tensor that tells one forward's layers from another forward's: its 2D mask, or without a mask its
    ``position_ids`` (transformers makes each once per forward and hands it to every layer); None for anything
    else (a 4D mask, no ``position_ids``)."""
    if attention_mask is not None:
        return attention_mask if attention_mask.dim() == 2 else None
    position_ids = kwargs.get("position_ids")
    return position_ids if isinstance(position_ids, torch.Tensor) else None


def forward_dense(module: torch.nn.Module, query: torch.Tensor, key_length: int,
                  attention_mask: torch.Tensor | None, kwargs: dict[str, Any]) -> bool | None:
    """The ``forward`` rule: for a later layer of a forward whose first layer ran dense for the whole forward
    (:func:`remember_forward`), whether sdpa takes the call without a mask (True: no padding) or with it (False);
    None for any other call (another forward's: its marker, model config, method configuration or shapes differ),
    and while recording (which names each layer's reason)."""
    entry = _DENSE_FORWARD[0] if _DENSE_FORWARD else None
    if entry is None:
        return None
    marker = _forward_marker(attention_mask, kwargs)
    config = module.config
    if (marker is None or entry[0]() is not marker or entry[1] is not config or entry[3] != query.shape
            or entry[4] != key_length or entry[2] is not stored_config(config) or recording()
            or asks_more_than_sdpa(kwargs)):
        return None
    return entry[5]


def remember_forward(call: Call, plan: Plan) -> None:
    """Keep a first layer's plan for the forward's later layers (:func:`forward_dense`) where it holds for all of
    them: a prefill, a :data:`FORWARD_WIDE` rule, nothing beyond sdpa (no logN, no int8 K/V, none of :data:`_UNUSUAL_KWARGS`),
    every row read, and a :func:`_forward_marker`."""
    marker = _forward_marker(call.attention_mask, call.kwargs)
    if (plan.path != DENSE or plan.rule not in FORWARD_WIDE or call.phase != "prefill" or plan.read_rows is not None
            or marker is None
            or getattr(call.config, "logn_scaling", False) or call.quantized or asks_more_than_sdpa(call.kwargs)
            or torch.compiler.is_compiling()):
        _DENSE_FORWARD.clear()
        return
    mask = call.attention_mask
    unmasked = mask is None or (call.num_queries == call.key_length
                                and holds_no_padding(mask, call.key_length, call.query.device))
    _DENSE_FORWARD[:] = [(weakref.ref(marker), call.module.config, stored_config(call.module.config),
                          call.query.shape, call.key_length, unmasked)]


# -- Star Attention -----------------------------------------------------------------------------------------------
#: Star's phase names: context encoding and query / generation.
CONTEXT_PHASE, QUERY_PHASE = "context", "query"
GLOBAL = "global attention (query phase)"


@dataclass(frozen=True)
class StarPlan:
    """What a Star call runs: ``path`` ``DENSE`` (global attention: every query over every key), ``ALL_BLOCKS`` (a
    static decode step), or ``SPARSE`` (the first ``context_queries`` queries through the context pattern, with
    ``full_rows`` given every causal block; the rest global). ``rows``: the padding layout, where the mask is left
    padding."""

    path: str
    rule: str
    phase: str
    reason: str | None = None
    context_queries: int = 0
    rows: RowLayout | None = None
    full_rows: torch.Tensor | None = None


def plan_star(call: Call, run: Any) -> StarPlan:
    """Star's rules, in order: ``inputs`` (and sliding windows longer than the window: refused); ``static``
    (generation over a static cache: every block, lengths on the device); ``query`` (a call without context queries:
    global attention); ``dense_layer``; ``length`` (a context shorter than dense_below); ``pattern`` (one process:
    the pattern keeps more than dense_above_density of the causal blocks); ``mask`` (a 4D mask), ``padding`` (not
    left padding), ``dropout``: DENSE; else ``context`` (SPARSE; rows whose own context is shorter than dense_below
    get every causal block). ``run`` is :func:`hf_sparse.star_attention.generate`'s state of the forward (None for
    a plain generate(), whose prompt's last ``query_tokens`` tokens are the query)."""
    config = call.config
    check_inputs(call.kwargs, call.query, (), "star", getattr(call.module, "is_causal", True))
    window = call.kwargs.get("sliding_window")
    if window is not None and call.key_length > window:
        raise NotImplementedError(f"Star attention does not support sliding-window layers (window {window} < "
                                  f"{call.key_length} tokens)")
    if run is None and not call.dropout and call.static:
        return StarPlan(ALL_BLOCKS, "static", QUERY_PHASE, GLOBAL)
    if run is not None:
        context_queries = call.num_queries if run.phase == CONTEXT_PHASE else 0
        context_length = run.context_length
    else:
        prompt = call.key_length == call.num_queries
        context_queries = max(0, call.num_queries - config.query_tokens) if prompt else 0
        context_length = context_queries
    if context_queries == 0:
        return StarPlan(DENSE, "query", QUERY_PHASE, GLOBAL)
    if config.is_dense_layer(call.layer_idx, call.num_layers):
        return StarPlan(DENSE, "dense_layer", CONTEXT_PHASE, "dense_layers", context_queries)
    threshold = config.dense_threshold(CONTEXT_PHASE)
    if context_length < threshold:
        return StarPlan(DENSE, "length", CONTEXT_PHASE, f"context {context_length} < dense_below {threshold}",
                        context_queries)
    if config.dense_above_density is not None and not (run is not None and run.sharded):
        kept = StarMethod(config).context_density(context_queries)
        if kept > config.dense_above_density:
            return StarPlan(DENSE, "pattern", CONTEXT_PHASE, f"the pattern keeps {kept:.3f} of the causal blocks > "
                            f"dense_above_density {config.dense_above_density}", context_queries)
    mask = call.attention_mask
    if mask is not None and mask.dim() != 2:
        return StarPlan(DENSE, "mask", CONTEXT_PHASE, f"a {mask.dim()}D attention mask", context_queries)
    rows = row_layout(mask, call.query.shape[0], call.key_length, call.query.device)
    if rows is None:
        warn_once("padding", "hf_sparse: an attention mask with masked slots after unmasked ones (right padding) "
                  "runs dense attention (sdpa); left padding (padding_side='left') runs sparse")
        return StarPlan(DENSE, "padding", CONTEXT_PHASE, "not left padding", context_queries)
    if call.dropout:
        return StarPlan(DENSE, "dropout", CONTEXT_PHASE, f"attention dropout {call.dropout}", context_queries)
    full_rows = None
    if rows.high and context_queries - rows.high < threshold:  # rows whose own context runs dense alone
        full_rows = (context_queries - rows.starts) < threshold
    return StarPlan(SPARSE, "context", CONTEXT_PHASE, None, context_queries, rows, full_rows)
