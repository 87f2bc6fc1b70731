"""How well gates predict where dense attention goes: per layer KL and top-1 of the block distribution, and the
recall of the blocks a PLAS selection keeps (:func:`evaluate_gates`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from ..gates import gate_spec, model_plas_config
from ..kernels.reference import block_summaries
from .gate_objective import (
    attention_scale,
    log_predictions,
    pooled_logits,
    refuse_tensor_parallel,
    choosable_blocks,
)
from .probe import probe_layers


# -- evaluation -----------------------------------------------------------------------------------------------
@dataclass
class GateMetrics:
    """Agreement of block scores with dense attention for one set of gates (means over layers, heads and queries).

    Over the blocks the gate ranks (causal blocks minus the first block and the query's own, which PLAS always
    attends; queries with at least two such blocks): ``kl`` = KL(max-pooled dense block distribution ||
    predicted distribution), ``top1`` = the predicted best block is the target's best block. ``kl_all`` and
    ``top1_all``: the same over every causal block. ``recall``: dense attention mass inside the selected blocks,
    where each query selects ``ceil(density * causal blocks)`` blocks, the forced ones first and then the best
    scored (so both gate sets run at equal density); ``oracle_recall``: the same count chosen by true block mass.
    ``density``: the fraction of causal blocks selected.
    """

    kl: float
    top1: float
    kl_all: float
    top1_all: float
    recall: float
    oracle_recall: float
    density: float
    per_layer: dict[int, dict[str, float]] = field(default_factory=dict)


def _select(scores: torch.Tensor, available: torch.Tensor, keep: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """Boolean selection of ``keep`` blocks per query: forced ones first, then by descending score."""
    ranked = scores.masked_fill(~available, float("-inf")).masked_fill(forced & available, float("inf"))
    order = ranked.argsort(dim=-1, descending=True, stable=True)
    rank = order.argsort(dim=-1)
    return (rank < keep[..., None]) & available


@torch.no_grad()
def evaluate_gates(
    model: Any,
    input_ids: torch.Tensor,
    gates: Mapping[int, torch.Tensor] | None,
    *,
    density: float = 0.25,
    layers: Sequence[int] | None = None,
    block_size: int | None = None,
    query_chunk: int = 512,
) -> GateMetrics:
    """:class:`GateMetrics` of ``gates`` (layer -> weight; ``None`` or a missing layer = mean pooling, exactly
    as inference) on ``input_ids`` ``[B, S]`` (unpadded), over ``layers`` (default: the model's gated layers)."""
    refuse_tensor_parallel(model, "evaluate_gates")
    spec = gate_spec(model, block_size)
    sink_blocks = model_plas_config(model).sink_blocks
    layers = list(layers if layers is not None else spec.gated_layers)
    scale = attention_scale(model, spec.head_dim)
    per_layer: dict[int, dict[str, float]] = {}

    def on_layer(layer: int, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor) -> None:
        gate = None if gates is None else gates.get(layer)
        per_layer[layer] = layer_metrics(query, key, gate, spec.block_size, scale, density, sink_blocks, query_chunk)

    probe_layers(model, input_ids, layers, on_layer)
    names = ("kl", "top1", "kl_all", "top1_all", "recall", "oracle_recall", "density")
    means = {name: sum(m[name] for m in per_layer.values()) / len(per_layer) for name in names}
    return GateMetrics(**means, per_layer=per_layer)


def _kl_top1(target: torch.Tensor, log_pred: torch.Tensor, rows: torch.Tensor) -> tuple[float, float, int]:
    target = target / target.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    kl = torch.where(target > 0, target * (target.clamp_min(1e-30).log() - log_pred), torch.zeros_like(target)).sum(-1)
    agree = (target.argmax(-1) == log_pred.argmax(-1)).float()
    rows = rows[:, None].expand_as(kl)
    return float((kl * rows).sum()), float((agree * rows).sum()), int(rows.sum())


@torch.no_grad()
def layer_metrics(query: torch.Tensor, key: torch.Tensor, gate: torch.Tensor | None, block_size: int, scale: float,
                  density: float, sink_blocks: int = 1, query_chunk: int = 512) -> dict[str, float]:
    """One layer's :class:`GateMetrics` fields from its post-RoPE ``query``/``key`` (unpadded rows)."""
    batch, q_heads, length, _ = query.shape
    kv_start = torch.zeros(batch, dtype=torch.long, device=query.device)
    summaries = block_summaries(key, None if gate is None else gate.to(key.device), kv_start, block_size)
    num_blocks = summaries.shape[2]
    sums = dict(kl=0.0, top1=0.0, kl_all=0.0, top1_all=0.0, recall=0.0, oracle_recall=0.0, density=0.0)
    ranked_count = all_count = 0
    for q0 in range(min(block_size, length), length, query_chunk):
        q1 = min(length, q0 + query_chunk)
        # Each block's largest attention probability and its mass: pooled logits less the row's normaliser.
        log_mass = pooled_logits(query[:, :, q0:q1], key[:, :, :q1], q0, scale, block_size, num_blocks, "sum")
        lse = torch.logsumexp(log_mass, -1, keepdim=True)
        mass = (log_mass - lse).exp()
        peak = (pooled_logits(query[:, :, q0:q1], key[:, :, :q1], q0, scale, block_size, num_blocks, "max") - lse).exp()
        available = choosable_blocks(q1 - q0, num_blocks, q0, block_size, length, batch, query.device, None)
        choosable = choosable_blocks(q1 - q0, num_blocks, q0, block_size, length, batch, query.device, sink_blocks)
        log_all = log_predictions(query[:, :, q0:q1], summaries, available, scale)
        log_ranked = log_predictions(query[:, :, q0:q1], summaries, choosable, scale)
        kl, top1, rows = _kl_top1(peak * choosable[:, None], log_ranked, choosable.sum(-1) >= 2)
        sums["kl"] += kl
        sums["top1"] += top1
        ranked_count += rows
        kl, top1, rows = _kl_top1(peak, log_all, torch.ones_like(available[..., 0]))
        sums["kl_all"] += kl
        sums["top1_all"] += top1
        all_count += rows
        n_available = available.sum(-1)[:, None]  # [B, 1, c]
        keep = torch.ceil(density * n_available).long().clamp_min(1)
        forced = (available & ~choosable)[:, None]
        chosen = _select(log_all, available[:, None], keep, forced)
        best = _select(mass, available[:, None], keep, forced)
        sums["recall"] += float((mass * chosen).sum())
        sums["oracle_recall"] += float((mass * best).sum())
        sums["density"] += float((chosen.sum(-1) / n_available).sum())
    metrics = {}
    for name, value in sums.items():
        metrics[name] = value / max(ranked_count if name in ("kl", "top1") else all_count, 1)
    return metrics
