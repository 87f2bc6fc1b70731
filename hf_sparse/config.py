"""Configuration dataclasses, one per method, validated on creation and stored as plain dicts in ``model.config``."""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

#: Key under which the method configuration is stored in ``PretrainedConfig`` (and so in config.json).
CONFIG_KEY = "hf_sparse"


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def _as_range(name: str, value: Any) -> tuple[int, int]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"{name} must be a pair (top_k_left, top_k_right), got {value!r}")
    left, right = (_as_int(name, v) for v in value)
    if left < 1:
        raise ValueError(f"{name}: top_k_left must be >= 1, got {left}")
    if left > right:
        raise ValueError(f"{name}: top_k_left ({left}) must not exceed top_k_right ({right})")
    return left, right


def _as_layers(value: Any) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)):
        raise ValueError(f"dense_layers must be a tuple of layer indices, got {value!r}")
    return tuple(_as_int("dense_layers", i) for i in value)


def _as_dense_below(value: Any, pair_allowed: bool = True) -> int | tuple[int, int] | None:
    if value is None:
        return None
    if isinstance(value, (tuple, list)) and pair_allowed:
        if len(value) != 2:
            raise ValueError(f"dense_below must be an int, a (prefill, decode) pair or None, got {value!r}")
        value = tuple(_as_int("dense_below", v) for v in value)
        values = value
    else:
        values = (_as_int("dense_below", value),)
    if min(values) < 0:
        raise ValueError(f"dense_below must be >= 0, got {value!r}")
    return value


class _MethodConfig:
    """Shared behaviour of the method dataclasses: dense-layer lookup and the dict form kept in ``model.config``."""

    dense_layers: tuple[int, ...]

    def is_dense_layer(self, layer_idx: int, num_layers: int) -> bool:
        """Whether ``layer_idx`` is listed in ``dense_layers`` (negative entries count from the end)."""
        return any(layer_idx == (i if i >= 0 else num_layers + i) for i in self.dense_layers)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (the form stored in ``model.config``)."""
        data = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in data.items()}

    #: Fields of the first version of the config, in every stored configuration (``to_dict`` writes every field).
    STORED_FIELDS = frozenset()
    #: Fields added later whose default changed what a config does, with the value an earlier version ran with: a
    #: stored dict holding :data:`STORED_FIELDS` but not such a field (``save_pretrained`` of an earlier version)
    #: gets that value, not the new default.
    EARLIER_VALUES = {}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Any:
        """Inverse of :meth:`to_dict`; unknown keys raise. A dict stored by an earlier version keeps what it ran
        with (:data:`EARLIER_VALUES`); a partial dict gets the defaults."""
        data = dict(data)
        if cls.STORED_FIELDS and cls.STORED_FIELDS <= set(data):
            data = {**{name: value for name, value in cls.EARLIER_VALUES.items() if name not in data}, **data}
        expected = cls.__dataclass_fields__["method"].default
        method = data.pop("method", expected)
        if method != expected:
            raise ValueError(f"not a {cls.__name__} configuration: method={method!r}")
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} field(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def _check_flags(config: Any, *names: str) -> None:
    """Validate boolean fields."""
    for name in names:
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"{name} must be True or False, got {getattr(config, name)!r}")


def _check_logn(config: Any) -> None:
    """Validate the logN scaling fields shared by the method configs."""
    _check_flags(config, "logn_scaling")
    if config.logn_base is not None and _as_int("logn_base", config.logn_base) < 2:
        raise ValueError(f"logn_base (the training length) must be None or >= 2, got {config.logn_base}")
    if config.logn_base is not None and not config.logn_scaling:
        raise ValueError("logn_base is set but logn_scaling is False: set logn_scaling=True to scale queries")


#: K/V storage dtypes of the SparseCache (``kv_cache_dtype``): ``"auto"`` (the states' own dtype) or ``"int8"``.
KV_CACHE_DTYPES = ("auto", "int8")


def _check_dense_above_density(config: Any) -> None:
    """Validate the ``dense_above_density`` field shared by the method configs."""
    value = config.dense_above_density
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"dense_above_density must be a number in (0, 1] or None, got {value!r}")
    config.dense_above_density = float(value)


def _check_prefill_mlp_chunk(config: Any) -> None:
    """Validate the ``prefill_mlp_chunk`` and ``prefill_silu_rows`` fields shared by the method configs."""
    if config.prefill_mlp_chunk is not None and _as_int("prefill_mlp_chunk", config.prefill_mlp_chunk) < 1:
        raise ValueError(f"prefill_mlp_chunk must be None or >= 1, got {config.prefill_mlp_chunk}")
    rows = config.prefill_silu_rows
    auto = isinstance(rows, str) and rows == "auto"
    if rows is not None and not auto and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
        raise ValueError(f"prefill_silu_rows must be 'auto', None or an int >= 1, got {rows!r}")


def _check_kv_cache_dtype(config: Any) -> None:
    """Validate the ``kv_cache_dtype`` field shared by the PLAS and XAttention configs."""
    if config.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be 'auto' or 'int8', got {config.kv_cache_dtype!r}")


@dataclass
class PLASConfig(_MethodConfig):
    """PLAS sparse attention settings.

    Attributes:
        block_size: tokens per KV block (a power of two, >= 16).
        prefill_top_k: (left, right) range for the number of blocks each query selects in prefill, for keys of
            up to ``prefill_top_k_length`` tokens.
        prefill_top_k_length: a prefill call with more keys than this selects proportionally more blocks, each
            end of the range ``ceil(top_k * keys / prefill_top_k_length)``: the share of the blocks a query keeps
            stays what it is at this length. ``None``: ``prefill_top_k`` at every length (FastDeploy's rule).
            Chosen under the quality budget of docs/quality.md on the long-context default model (PPL <= 1.01x
            dense, top-1 agreement >= 0.97): fixed counts (55, 66) keep top-1 0.964 at 64K and 0.951 at 128K;
            scaled from 32K, (110, 132) at 64K keeps 0.973 and (220, 264) at 128K 0.975.
        decode_top_k: (left, right) range for the number of blocks each query head selects in decode.
        query_union: consecutive prefill queries whose selections are united (one attention tile).
        query_stride: in prefill only every ``query_stride``-th query of a tile (and its last) runs the threshold
            top-k; the others add only their own block. 1: every query (FastDeploy's selection); at least
            ``query_union``: the tile's last query only. The default 4 selects about 4x faster, and with
            ``prefill_top_k`` 10% above stride 1's (50, 60) it keeps about stride 1's density and next-token KL:
            SmolLM2 ``generate()`` TTFT at 128K 2.37x -> 2.92x of sdpa's at fixed counts (H100,
            docs/runs/gen_defaults_64k_128k_h100.json). The density probe's selection-cost estimate does not count
            it (it errs to dense).
        dense_layers: layer indices that always run dense; negative values count from the end (-1 = last).
        dense_below: sequences shorter than this many tokens run dense (bit-equal to sdpa). ``None`` means
            ``prefill_top_k[0] * block_size`` for prefill, as FastDeploy, and ``DECODE_DENSE_FACTOR *
            decode_top_k[0] * block_size`` for decode (102,400 tokens at the defaults: below it the union of a
            GQA group's selections keeps most blocks, 0.69-0.94 of them at 32K on Llama-3-8B and SmolLM2; on the
            long-context default model reading every block is faster at 64K (TPOT 1.66 against 2.02 ms), as fast
            at 128K, and at 96K it finds the pass keys dense attention finds where the sparse decode at 4x
            finds none, docs/quality.md); ``0`` forces the sparse path; a pair sets (prefill, decode)
            separately.
        sink_blocks: leading (non-padding) blocks every query always attends, besides its own block.
        search_steps: binary-search steps of the threshold top-k.
        logn_scaling: Qwen-style logN scaling: the query at row position ``n`` (1-based) is scaled by
            ``max(1, log(n) / log(m))``, on the sparse and the dense path alike.
        logn_base: the training length ``m``; ``None`` = the model config's ``max_position_embeddings``.
        kv_cache_dtype: K/V storage of the :class:`~hf_sparse.SparseCache` that ``generate()`` creates:
            ``"auto"`` (the model's dtype) or ``"int8"`` (per-token scales, dequantised inside the kernels).
        dense_above_density: on CUDA, a prefill call whose selection keeps at least this fraction of the
            causal blocks runs dense (sdpa) instead, where the sparse kernel would be slower; ``None`` never.
            Costs one device-to-host read per sparse prefill call; decode never falls back. Prompts of at least
            4096 tokens are probed first: if the selection of their last 1024 queries (a cheap estimate of the
            call's density) keeps this fraction less the share of dense time the rest of the selection would
            take (``attention.probe_threshold``: e.g. PLAS at head dim 64 and 32K tokens about 0.43, at 128K
            0.67), the call runs dense (exact) without selecting for the rest. Before any of that, a call whose
            sparsest possible selection (every query of a tile choosing the same blocks, as many as the left end of
            the prefill range at the call's length,
            ``PLASMethod.density_floor``) already reaches that threshold runs dense with no selection at all.
        density_memory: the dense-or-sparse decision of a layer's prefill is taken once per configuration and
            length bucket (half an octave of key length and of query count) and reused by later calls of that
            layer and bucket: no probe, no selection density read back to the host. ``False`` decides on every
            call. ``hf_sparse.density.forget_decisions(model)`` clears what a model remembers.
        decode_cuda_graph: on CUDA with the Triton kernels, ``generate()`` keeps K/V in a static
            :class:`~hf_sparse.SparseCache` (sized for the prompt plus ``max_new_tokens``, kept for the next call
            that fits it) and replays each decode step from a captured CUDA graph, below ``dense_below`` over all
            blocks (:mod:`hf_sparse.graphs`); ``False`` decodes eagerly.
        decode_compile: the CUDA-graph decode step holds the model's norms and dense MLPs compiled by
            ``torch.compile`` (fused: fewer, larger kernels per layer; :mod:`hf_sparse.fusion`), compiled once per
            process at the first decode step; ``False`` captures them as transformers runs them.
        decode_fused_layers: with ``decode_compile``, the captured step runs Llama-style decoder layers (Llama,
            Mistral, Qwen2) through :func:`hf_sparse.fusion.fused_layer_forward`: four launches of
            :func:`hf_sparse.kernels.decode_linear` for the layer's norms, weight products, rotary embedding,
            activation and residual adds (16 launches per layer otherwise; the 32K decode step of SmolLM2 1.7 ->
            1.6 ms on the H100). They round where transformers' ops round, but sum the products in another order
            than cuBLAS (last-bit differences; on SmolLM2 at 4K the greedy continuation equals eager sdpa's for
            256 tokens, docs/benchmarks.md); ``False`` keeps transformers' own layers (compiled norms and MLPs) in
            the step.
        trim_last_layer: in a ``generate()`` forward that keeps the logits of its last positions only (the
            prefill: the first new token) and returns no hidden states, the last decoder layer, where it runs
            dense after an earlier layer of the forward ran sparse, attends for those positions only: its other
            rows feed nothing the call returns (the cache keeps its keys and values, which come from its input)
            and are zero. A forward that runs dense throughout computes every row (outputs equal to sdpa's);
            ``False`` computes every row always.
        prefill_mlp_chunk: in a ``generate()`` prefill each decoder layer's dense feed-forward block holds fewer
            activations at once (:mod:`hf_sparse.feed_forward`): a SiLU-gated MLP (Llama, Qwen, Mistral, ...)
            computes its gate in place (same values and launches), other blocks run over slices of this many
            tokens (batch x positions) when the prefill has more. This keeps the prefill's peak memory under
            dense attention's (the sparse cache holds block summaries besides the K/V). ``None`` runs each block
            as transformers does.
        prefill_silu_rows: while ``prefill_mlp_chunk`` is not None, a SiLU-gated MLP whose prefill input has more
            tokens (batch x positions) than this runs over slices of this many rows of its ``[tokens, hidden]``
            input, all three projections per slice (fewer activations alive; equal to the whole MLP to rounding).
            ``"auto"``: 8192 with ``kv_cache_dtype="int8"`` (the memory-first cache), else whole: slices cost
            TTFT (about 3% at 8K x 4, where the prefill runs dense); ``None``: whole.
    """

    block_size: int = 128
    prefill_top_k: tuple[int, int] = (55, 66)
    prefill_top_k_length: int | None = 32768
    decode_top_k: tuple[int, int] = (100, 120)
    query_union: int = 128
    query_stride: int = 4
    dense_layers: tuple[int, ...] = (-1,)
    dense_below: int | tuple[int, int] | None = None
    sink_blocks: int = 1
    search_steps: int = 16
    logn_scaling: bool = False
    logn_base: int | None = None
    kv_cache_dtype: str = "auto"
    dense_above_density: float | None = 0.75
    density_memory: bool = True
    decode_cuda_graph: bool = True
    decode_compile: bool = True
    decode_fused_layers: bool = True
    trim_last_layer: bool = True
    prefill_mlp_chunk: int | None = 16384
    prefill_silu_rows: int | str | None = "auto"
    method: str = field(default="plas", init=False)

    def __post_init__(self) -> None:
        block_size = _as_int("block_size", self.block_size)
        if not _is_power_of_two(block_size) or block_size < 16:
            raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
        self.prefill_top_k = _as_range("prefill_top_k", self.prefill_top_k)
        self.decode_top_k = _as_range("decode_top_k", self.decode_top_k)
        if self.prefill_top_k_length is not None and _as_int("prefill_top_k_length", self.prefill_top_k_length) < 1:
            raise ValueError(f"prefill_top_k_length must be a positive number of tokens or None, "
                             f"got {self.prefill_top_k_length!r}")
        if _as_int("query_union", self.query_union) < 1:
            raise ValueError(f"query_union must be >= 1, got {self.query_union}")
        if _as_int("query_stride", self.query_stride) < 1:
            raise ValueError(f"query_stride must be >= 1, got {self.query_stride}")
        self.dense_layers = _as_layers(self.dense_layers)
        self.dense_below = _as_dense_below(self.dense_below)
        if _as_int("sink_blocks", self.sink_blocks) < 0:
            raise ValueError(f"sink_blocks must be >= 0, got {self.sink_blocks}")
        if not 1 <= _as_int("search_steps", self.search_steps) <= 64:
            raise ValueError(f"search_steps must be in [1, 64], got {self.search_steps}")
        _check_logn(self)
        _check_kv_cache_dtype(self)
        _check_dense_above_density(self)
        _check_prefill_mlp_chunk(self)
        _check_flags(self, "decode_cuda_graph", "decode_compile", "decode_fused_layers", "density_memory",
                     "trim_last_layer")

    STORED_FIELDS = frozenset({"block_size", "prefill_top_k", "decode_top_k", "query_union", "dense_layers",
                               "dense_below", "sink_blocks", "search_steps"})
    #: A config stored before ``prefill_top_k_length`` existed keeps the fixed counts it ran with.
    EARLIER_VALUES = {"prefill_top_k_length": None, "prefill_silu_rows": None}

    def top_k(self, phase: str, key_length: int | None = None) -> tuple[int, int]:
        """The (left, right) range of the phase, ``"prefill"`` or ``"decode"``; a prefill over ``key_length``
        keys past ``prefill_top_k_length`` scales it with the length (see the field)."""
        if phase != "prefill":
            return self.decode_top_k
        reference = self.prefill_top_k_length
        if key_length is None or reference is None or key_length <= reference:
            return self.prefill_top_k
        return tuple(-(-k * key_length // reference) for k in self.prefill_top_k)

    #: Default decode ``dense_below``, in multiples of ``decode_top_k[0]`` blocks (see the field's description).
    DECODE_DENSE_FACTOR = 8
    #: FastDeploy's prefill top-k, every query searching (``query_stride=1``); the default ``prefill_top_k`` is 10%
    #: above it for about its density with one query in 4 searching.
    FASTDEPLOY_PREFILL_TOP_K = (50, 60)

    def dense_threshold(self, phase: str) -> int:
        """Sequence length below which the phase runs dense."""
        if self.dense_below is None:
            return self.top_k(phase)[0] * self.block_size * (1 if phase == "prefill" else self.DECODE_DENSE_FACTOR)
        if isinstance(self.dense_below, tuple):
            return self.dense_below[0 if phase == "prefill" else 1]
        return self.dense_below

    @classmethod
    def from_fastdeploy(cls, options: Mapping[str, Any]) -> "PLASConfig":
        """Build from FastDeploy's ``plas_*`` keys (older ``moba_*`` names are accepted too), with FastDeploy's
        selection: every query of a tile searching (``query_stride=1``)."""
        opts = {}
        for key, value in options.items():
            if key.startswith("moba_"):
                key = "plas_" + key[len("moba_"):]
            opts[key] = value
        known = {
            "plas_block_size", "plas_encoder_top_k_left", "plas_encoder_top_k_right", "plas_decoder_top_k_left",
            "plas_decoder_top_k_right", "plas_use_encoder_seq_limit", "plas_use_decoder_seq_limit",
            "plas_max_seq_length", "plas_use_mlp",
        }
        unknown = sorted(set(opts) - known)
        if unknown:
            raise ValueError(f"unknown FastDeploy PLAS key(s): {', '.join(unknown)}")
        default = cls()
        block_size = opts.get("plas_block_size", default.block_size)
        prefill = (opts.get("plas_encoder_top_k_left", cls.FASTDEPLOY_PREFILL_TOP_K[0]),
                   opts.get("plas_encoder_top_k_right", cls.FASTDEPLOY_PREFILL_TOP_K[1]))
        decode = (opts.get("plas_decoder_top_k_left", default.decode_top_k[0]),
                  opts.get("plas_decoder_top_k_right", default.decode_top_k[1]))
        enc_limit = opts.get("plas_use_encoder_seq_limit")
        dec_limit = opts.get("plas_use_decoder_seq_limit")
        dense_below = None
        if enc_limit is not None or dec_limit is not None:
            dense_below = (
                enc_limit if enc_limit is not None else prefill[0] * block_size,
                dec_limit if dec_limit is not None else decode[0] * block_size,
            )
        return cls(block_size=block_size, prefill_top_k=prefill, prefill_top_k_length=None, decode_top_k=decode,
                   query_stride=1, dense_below=dense_below)


@dataclass
class XAttnConfig(_MethodConfig):
    """XAttention sparse attention settings (antidiagonal block scoring, cumulative-mass threshold).

    Attributes:
        block_size: tokens per KV block and per prefill query tile (a power of two, >= 16).
        stride: antidiagonal stride ``S``: scoring reads every ``S``-th antidiagonal of each ``S x S`` tile, at
            about ``1/S`` of the dense score cost (a power of two dividing ``block_size``; 1 scores exactly). 16
            (the paper: 8): on SmolLM2 at 128K the prefill runs 1.59x sdpa's speed against 1.42x at 8, with the
            last position's KL 0.003 against 0.014; at 8K and 32K, at matched density, its next-token KL is
            1.0-1.2x stride 8's and at most PLAS's (docs/xattn.md, "Stride").
        pool: how the ``S`` query-key products of one antidiagonal become the score of a (query group, key group):
            ``"mean"`` (the XAttention paper's) or ``"max"``. A mean of logits averages a single strongly attended
            key away, so per query head the mean's selection keeps less true attention mass than the exact block
            masses would at the same density and the max's keeps as much; end to end (next-token KL at matched
            density on SmolLM2) the two are within the spread between inputs, so the paper's stays the default
            (docs/xattn.md, "Where the estimate loses mass").
        threshold: per query tile (prefill) or query (decode), the smallest set of key blocks whose estimated
            attention mass reaches this fraction is kept, in (0, 1]; 1.0 keeps every causal block. 0.99: the
            lowest threshold within the quality budget of docs/quality.md at 64K on the long-context default
            model (top-1 agreement 0.980; 0.98 keeps 0.967, 0.9 0.928). Longer prefills: ``long_threshold``.
        long_threshold: ``(keys, threshold)``: a prefill call over more than ``keys`` keys selects with this
            threshold instead of ``threshold``; ``None`` = ``threshold`` at every length. (65536, 0.999): on the
            long-context default model 0.99 keeps top-1 0.966 at 96K and 0.955 at 128K, outside the budget, and
            0.999 keeps 0.979 / 0.973 (0.998: 0.983 / 0.969) at density 0.36 / 0.37 (docs/xattn.md).
        decode_threshold: the decode phase's threshold (on block-summary scores), in (0, 1]; ``None`` = ``threshold``.
            0.99 even under a lower ``threshold``: the summary softmax underestimates peaked blocks (a pass key
            in 4K tokens of SmolLM2 is lost at 0.95 and kept at 0.99, docs/xattn.md).
        chunk_size: key tokens scored at once in prefill (a multiple of ``block_size``); longer keys use a
            two-pass (log-sum-exp, then mass) softmax over key chunks.
        gqa_reduce: how the query heads of a GQA group combine their block masks: ``"any"`` keeps a block any
            head selected, ``"vote"`` keeps it when more than ``vote_ratio`` of the heads selected it.
        vote_ratio: fraction of a group's heads a block needs with ``gqa_reduce="vote"``, in [0, 1).
        keep_sink: always keep each row's first block.
        keep_diagonal: always keep the block(s) holding the tile's (or decode query's) own tokens.
        dense_last: the query tiles holding a prefill's last ``dense_last`` queries attend to every causal block
            (OpenVINO GenAI's "tri-shape"): the prompt's end, which the first generated token reads most, is then
            exact at about ``dense_last / N`` of dense attention's cost (at 8K on SmolLM2 the last position's KL
            falls 0.0065 -> 0.0010 at threshold 0.9, docs/xattn.md); ``0`` = off.
        dense_layers: layer indices that always run dense; negative values count from the end (-1 = last).
        dense_below: sequences shorter than this many tokens run dense (bit-equal to sdpa). ``None`` means
            ``8 * block_size`` in prefill (where the density decision then weighs the scoring's cost) and
            ``DECODE_DENSE_BLOCKS * block_size`` (262144 tokens at block 128) in decode: XAttention's decode
            selection (block scores, cumulative threshold, GQA union: about 40 small launches per layer) costs
            more than the K/V reads it saves below that on the models measured (SmolLM2-135M on the H100: 0.11 ms
            per layer, against 0.18 ms for all of a 128K sequence's K/V on the Llama-3-8B shape, at decode
            density 0.72), so shorter sequences decode every block through the decode kernel (CUDA graph);
            ``0`` forces the sparse path; a pair sets (prefill, decode) separately.
        prefill_chunk: query tokens scored at once in prefill (a multiple of ``block_size``; ``None`` = all),
            which bounds the scoring pass's memory; selections equal the unchunked run.
        logn_scaling: Qwen-style logN scaling: the query at row position ``n`` (1-based) is scaled by
            ``max(1, log(n) / log(m))``, on the sparse and the dense path alike.
        logn_base: the training length ``m``; ``None`` = the model config's ``max_position_embeddings``.
        kv_cache_dtype: K/V storage of the :class:`~hf_sparse.SparseCache` that ``generate()`` creates:
            ``"auto"`` (the model's dtype) or ``"int8"`` (per-token scales, dequantised inside the kernels,
            the prefill scoring included).
        dense_above_density: as :class:`PLASConfig`'s; XAttention's scoring and selection are counted as a share
            of dense attention's time that falls with the head dim and the length (``XAttnMethod.selection_share``:
            at head dim 64 about 0.76 at 32K and 0.40 at 128K; at head dim 128 0.26 and 0.17). Where that share
            leaves no density at which sparse attention would pay, the call runs dense without scoring.
        density_memory: as :class:`PLASConfig`'s.
        decode_cuda_graph: as :class:`PLASConfig`'s: CUDA-graph decode in ``generate()`` on CUDA.
        decode_compile: as :class:`PLASConfig`'s: compiled norms and MLPs in the captured decode step.
        decode_fused_layers: as :class:`PLASConfig`'s: fused Llama-style layers in the captured decode step.
        trim_last_layer: as :class:`PLASConfig`'s: a generate() prefill's last layer attends for the positions
            whose logits it keeps only.
        prefill_mlp_chunk: as :class:`PLASConfig`'s: a generate() prefill's feed-forward blocks hold fewer
            activations.
        prefill_silu_rows: as :class:`PLASConfig`'s: a generate() prefill's SiLU-gated MLPs over row slices.
    """

    block_size: int = 128
    stride: int = 16
    pool: str = "mean"
    threshold: float = 0.99
    long_threshold: tuple[int, float] | None = (65536, 0.999)
    decode_threshold: float | None = 0.99
    chunk_size: int = 16384
    gqa_reduce: str = "any"
    vote_ratio: float = 0.5
    keep_sink: bool = True
    keep_diagonal: bool = True
    dense_last: int = 128
    dense_layers: tuple[int, ...] = (-1,)
    dense_below: int | tuple[int, int] | None = None
    prefill_chunk: int | None = 16384
    logn_scaling: bool = False
    logn_base: int | None = None
    kv_cache_dtype: str = "auto"
    dense_above_density: float | None = 0.75
    density_memory: bool = True
    decode_cuda_graph: bool = True
    decode_compile: bool = True
    decode_fused_layers: bool = True
    trim_last_layer: bool = True
    prefill_mlp_chunk: int | None = 16384
    prefill_silu_rows: int | str | None = "auto"
    method: str = field(default="xattn", init=False)

    #: Default decode ``dense_below``, in blocks (see the field's description).
    DECODE_DENSE_BLOCKS = 2048

    def __post_init__(self) -> None:
        block_size = _as_int("block_size", self.block_size)
        if not _is_power_of_two(block_size) or block_size < 16:
            raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
        stride = _as_int("stride", self.stride)
        if not _is_power_of_two(stride) or stride > block_size:
            raise ValueError(f"stride must be a power of two in [1, block_size={block_size}], got {stride}")
        if self.pool not in ("mean", "max"):
            raise ValueError(f"pool must be 'mean' or 'max', got {self.pool!r}")
        for name in ("threshold", "decode_threshold"):
            value = getattr(self, name)
            if value is None and name == "decode_threshold":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")
            setattr(self, name, float(value))
        if self.long_threshold is not None:
            value = self.long_threshold
            if (not isinstance(value, (tuple, list)) or len(value) != 2 or isinstance(value[1], bool)
                    or not isinstance(value[1], (int, float)) or not 0.0 < value[1] <= 1.0):
                raise ValueError(f"long_threshold must be None or a (keys, threshold) pair with threshold in (0, 1], "
                                 f"got {value!r}")
            keys = _as_int("long_threshold's keys", value[0])
            if keys < 1:
                raise ValueError(f"long_threshold's keys must be a positive number of tokens, got {keys}")
            self.long_threshold = (keys, float(value[1]))
        chunk_size = _as_int("chunk_size", self.chunk_size)
        if chunk_size < block_size or chunk_size % block_size:
            raise ValueError(f"chunk_size must be a positive multiple of block_size={block_size}, got {chunk_size}")
        if _as_int("dense_last", self.dense_last) < 0:
            raise ValueError(f"dense_last must be an int >= 0, got {self.dense_last!r}")
        if self.gqa_reduce not in ("any", "vote"):
            raise ValueError(f"gqa_reduce must be 'any' or 'vote', got {self.gqa_reduce!r}")
        if isinstance(self.vote_ratio, bool) or not isinstance(self.vote_ratio, (int, float)) \
                or not 0.0 <= self.vote_ratio < 1.0:
            raise ValueError(f"vote_ratio must be a number in [0, 1), got {self.vote_ratio!r}")
        self.vote_ratio = float(self.vote_ratio)
        _check_flags(self, "keep_sink", "keep_diagonal", "decode_cuda_graph", "decode_compile", "decode_fused_layers",
                     "density_memory", "trim_last_layer")
        self.dense_layers = _as_layers(self.dense_layers)
        self.dense_below = _as_dense_below(self.dense_below)
        if self.prefill_chunk is not None:
            prefill_chunk = _as_int("prefill_chunk", self.prefill_chunk)
            if prefill_chunk < block_size or prefill_chunk % block_size:
                raise ValueError(
                    f"prefill_chunk must be None or a positive multiple of block_size={block_size}, got {prefill_chunk}"
                )
        _check_logn(self)
        _check_kv_cache_dtype(self)
        _check_dense_above_density(self)
        _check_prefill_mlp_chunk(self)

    def mass_threshold(self, phase: str, key_length: int | None = None) -> float:
        """The cumulative-mass threshold of the phase, ``"prefill"`` or ``"decode"``; a prefill over more than
        ``long_threshold[0]`` keys (``key_length``) takes ``long_threshold[1]`` (see the field)."""
        if phase == "decode" and self.decode_threshold is not None:
            return self.decode_threshold
        if phase == "prefill" and self.long_threshold is not None and key_length is not None:
            keys, threshold = self.long_threshold
            if key_length > keys:
                return threshold
        return self.threshold

    STORED_FIELDS = frozenset({"block_size", "stride", "threshold", "decode_threshold", "gqa_reduce",
                               "keep_sink", "keep_diagonal", "dense_layers", "dense_below"})
    #: A config stored before ``long_threshold`` existed keeps the one threshold it ran with.
    EARLIER_VALUES = {"long_threshold": None, "prefill_silu_rows": None}

    def dense_threshold(self, phase: str) -> int:
        """Sequence length below which the phase (``"prefill"`` or ``"decode"``) runs dense."""
        if self.dense_below is None:
            return (8 if phase == "prefill" else self.DECODE_DENSE_BLOCKS) * self.block_size
        if isinstance(self.dense_below, tuple):
            return self.dense_below[0 if phase == "prefill" else 1]
        return self.dense_below


@dataclass
class StarConfig(_MethodConfig):
    """Star Attention settings (two phases: blockwise context encoding with an anchor, then global attention).

    Attributes:
        block_size: context tokens per block (a multiple of 16). Block ``i`` attends causally to itself and to
            the anchor; in distributed runs whole blocks are sharded over ranks. 16384: within the quality budget
            of docs/quality.md on the long-context default model at 32K-128K (at 128K top-1 agreement 0.980,
            PPL 1.002x dense); 4096 and 8192 miss it (128K: 0.878 and 0.916, docs/star.md).
        anchor_size: leading context tokens (the anchor, with their true positions) every block attends besides
            itself; must divide ``block_size``. ``None`` means ``block_size`` (the paper's default).
        query_tokens: the rule for a plain ``generate()``/forward without a past: the last ``query_tokens`` prompt
            tokens are the query (global attention), the rest is context. ``hf_sparse.star_attention.generate`` takes the
            split explicitly and ignores this field.
        dense_layers: layer indices that always run dense (single process only); negative values count from the
            end (-1 = last).
        dense_below: contexts shorter than this many tokens run dense (bit-equal to sdpa). ``None`` means
            ``block_size``: a context of one block is exactly dense anyway.
        dense_above_density: one process only: a context whose phase-1 pattern keeps more than this fraction of
            the causal key blocks (``StarMethod.context_density``: from the context length, block and anchor
            sizes alone, no device read) runs dense (sdpa, exact), where the sparse kernel is no faster than
            dense attention. Measured on the H100 (SmolLM2-135M, docs/star.md): a pattern keeping 0.625 of the
            blocks gave 0.67-0.87x sdpa's TTFT, one keeping 0.344 gave 1.11-1.43x. ``None``: never.
        logn_scaling: Qwen-style logN scaling: the query at true position ``n`` (1-based, from the model's
            ``position_ids``, so context shards on other ranks scale by their global positions) is scaled by
            ``max(1, log(n) / log(m))`` in both phases.
        logn_base: the training length ``m``; ``None`` = the model config's ``max_position_embeddings``.
        decode_cuda_graph: as :class:`PLASConfig`'s: on CUDA ``generate()`` keeps K/V in a static SparseCache and
            replays each decode step (global attention: every block, through the decode kernel, lengths read on
            the device) from a captured CUDA graph; ``False`` decodes eagerly (sdpa over the cache).
        decode_compile: as :class:`PLASConfig`'s: compiled norms and MLPs in the captured decode step.
        decode_fused_layers: as :class:`PLASConfig`'s: fused Llama-style layers in the captured decode step.
        prefill_mlp_chunk: as :class:`PLASConfig`'s: a generate() prefill's feed-forward blocks hold fewer
            activations.
        prefill_silu_rows: as :class:`PLASConfig`'s: a generate() prefill's SiLU-gated MLPs over row slices
            (``"auto"``: whole, Star's cache being of the model's dtype).
    """

    block_size: int = 16384
    anchor_size: int | None = None
    query_tokens: int = 1
    dense_layers: tuple[int, ...] = ()
    dense_below: int | None = None
    dense_above_density: float | None = 0.4
    logn_scaling: bool = False
    logn_base: int | None = None
    decode_cuda_graph: bool = True
    decode_compile: bool = True
    decode_fused_layers: bool = True
    prefill_mlp_chunk: int | None = 16384
    prefill_silu_rows: int | str | None = "auto"
    method: str = field(default="star", init=False)

    def __post_init__(self) -> None:
        block_size = _as_int("block_size", self.block_size)
        if block_size < 16 or block_size % 16:
            raise ValueError(f"block_size must be a positive multiple of 16, got {block_size}")
        if self.anchor_size is None:
            self.anchor_size = block_size
        anchor_size = _as_int("anchor_size", self.anchor_size)
        if anchor_size < 16 or anchor_size % 16 or block_size % anchor_size:
            raise ValueError(
                f"anchor_size must be a multiple of 16 that divides block_size ({block_size}), got {anchor_size}"
            )
        if _as_int("query_tokens", self.query_tokens) < 0:
            raise ValueError(f"query_tokens must be >= 0, got {self.query_tokens}")
        self.dense_layers = _as_layers(self.dense_layers)
        self.dense_below = _as_dense_below(self.dense_below, pair_allowed=False)
        _check_logn(self)
        _check_dense_above_density(self)
        _check_prefill_mlp_chunk(self)
        _check_flags(self, "decode_cuda_graph", "decode_compile", "decode_fused_layers")

    @property
    def kernel_block_size(self) -> int:
        """Key-block granularity of the kernels: the largest power of two <= 128 dividing ``anchor_size``
        (so the anchor and every context block are whole kernel blocks)."""
        size = 128
        while self.anchor_size % size:
            size //= 2
        return size

    def dense_threshold(self, phase: str) -> int:
        """Context length below which attention runs dense (the same for every phase)."""
        return self.block_size if self.dense_below is None else self.dense_below


#: Configuration class of each method name (the attn_implementation it registers).
CONFIG_CLASSES: dict[str, type] = {"plas": PLASConfig, "xattn": XAttnConfig, "star": StarConfig}


def config_from_dict(data: Mapping[str, Any], default_method: str = "plas") -> Any:
    """The method configuration stored under :data:`CONFIG_KEY`, as its dataclass."""
    method = data.get("method", default_method)
    if method not in CONFIG_CLASSES:
        raise ValueError(f"unknown hf_sparse method {method!r} in the model configuration; known: {sorted(CONFIG_CLASSES)}")
    return CONFIG_CLASSES[method].from_dict(data)


# -- the configuration a model holds ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _parse_config(serialized: str, method: str) -> Any:
    return config_from_dict(json.loads(serialized), default_method=method)


#: Last parse per model config: (its stored dict as parsed, method, config). Every attention call asks, so
#: an unchanged dict is answered by one comparison, not a re-serialisation.
_LAST_PARSED: dict[int, tuple[dict, str, Any]] = {}


def config_value(model_config: Any, name: str, default: Any = None) -> Any:
    """``getattr(model_config, name, default)``, from the instance's own attributes when they hold it: past
    transformers' config attribute lookup, which is slow, and attention calls ask on every layer."""
    try:
        found = object.__getattribute__(model_config, "__dict__").get(name)
    except AttributeError:
        found = None
    return found if found is not None else getattr(model_config, name, default)


def stored_config(model_config: Any) -> dict | None:
    """The method configuration :func:`~hf_sparse.configure` stored in ``model_config`` (a new dict each time), None
    where none is: the instance's own attribute, read past transformers' attribute lookup."""
    try:
        return object.__getattribute__(model_config, "__dict__").get(CONFIG_KEY)
    except AttributeError:
        return None


def method_config(model_config: Any, method: str | None = "plas") -> Any:
    """The configuration of ``method`` stored in a model's config (its defaults when none, or another
    method's, is attached); ``method=None``: whichever method's is stored (PLAS's defaults when none is)."""
    stored = config_value(model_config, CONFIG_KEY) if model_config is not None else None
    if method is None:
        method = stored.get("method", "plas") if stored else "plas"
    if not stored or stored.get("method", "plas") != method:
        return _parse_config("{}", method)
    last = _LAST_PARSED.get(id(model_config))
    if last is not None and last[1] == method and last[0] == stored:
        return last[2]
    config = _parse_config(json.dumps(stored, sort_keys=True), method)
    _LAST_PARSED[id(model_config)] = (copy.deepcopy(stored), method, config)
    return config
