"""The gate distillation objective, shared by training (:mod:`.gate_training`) and evaluation (:mod:`.gate_eval`).

Per query, the target is the dense attention probabilities max-pooled (``target="max"``) or summed (``"sum"``: each
block's attention mass) over each key block and renormalised over the causal blocks; the prediction is
``softmax_j(q . Kc_j * scale)`` over the same blocks, with ``Kc`` the gate-compressed keys
(:func:`hf_sparse.kernels.reference.block_summaries`, the inference code path).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ..distributed import tensor_parallel_rank_and_size
from ..gates import attention_modules
from ..kernels import backend_for, pooled_block_logits
from ..kernels.reference import block_availability, block_summaries

#: Most bytes of one float32 ``[B, Hq, queries, blocks]`` tensor of the loss on the Triton path (it sets the queries
#: per chunk there; a few such tensors and their gradients are live at once).
TARGET_CHUNK_BYTES = 256 * 1024 * 1024


#: Stands for "not choosable" in the ranking objective's logits: finite, so no gradient turns NaN.
EXCLUDED_LOGIT = -1e4


# -- the distillation objective -------------------------------------------------------------------------------
def pooled_logits(query: torch.Tensor, key: torch.Tensor, q0: int, scale: float, block_size: int, num_blocks: int,
            pool: str) -> torch.Tensor:
    """:func:`hf_sparse.kernels.pooled_block_logits` of queries ``q0..`` over ``key[:, :, :q1]``, padded with
    ``-inf`` to ``num_blocks`` blocks (those past the chunk's keys are never visible)."""
    pooled = pooled_block_logits(query, key, block_size, scale, q0, pool)
    missing = num_blocks - pooled.shape[-1]
    return torch.nn.functional.pad(pooled, (0, missing), value=float("-inf")) if missing else pooled


def distillation_target(query: torch.Tensor, key: torch.Tensor, q0: int, scale: float, block_size: int,
                         choosable: torch.Tensor, pool: str = "max") -> torch.Tensor:
    """The dense attention probabilities max-pooled (or summed) over each block and renormalised over the
    ``choosable`` blocks (``[B, Hq, c, nb]``; rows with no choosable block are 0).

    A block's largest probability is ``exp(max logit - lse)``, its mass ``exp(logsumexp of its logits - lse)``;
    the row's ``lse`` cancels in the renormalisation, so the target is the softmax over the choosable blocks of
    the pooled logits (:func:`hf_sparse.kernels.pooled_block_logits`: on the GPU no logit matrix is written)."""
    peak = pooled_logits(query, key, q0, scale, block_size, choosable.shape[-1], pool)
    return torch.softmax(peak.masked_fill_(~choosable[:, None], float("-inf")), dim=-1).nan_to_num_(0.0)


def _prediction_logits(query: torch.Tensor, summaries: torch.Tensor, available: torch.Tensor, scale: float,
                       excluded: float) -> torch.Tensor:
    """``q . Kc_j * scale`` over the available blocks (``excluded`` elsewhere)."""
    group = query.shape[1] // summaries.shape[1]
    logits = torch.matmul(query.float(), summaries.repeat_interleave(group, dim=1).transpose(-1, -2)) * scale
    return logits.masked_fill(~available[:, None], excluded)


def log_predictions(query: torch.Tensor, summaries: torch.Tensor, available: torch.Tensor, scale: float) -> torch.Tensor:
    """``log_softmax_j(q . Kc_j * scale)`` over the available blocks (``-inf`` elsewhere)."""
    return torch.log_softmax(_prediction_logits(query, summaries, available, scale, float("-inf")), dim=-1)


def _ranking_terms(target: torch.Tensor, logits: torch.Tensor, choosable: torch.Tensor,
                   top_k: int) -> torch.Tensor:
    """Per query ``[B, Hq, c]``: ``sum_r (logsumexp of the logits of the blocks not yet placed - logit of the
    target's r-th best)`` over the target's first ``min(top_k, choosable)`` blocks (Plackett-Luce)."""
    k = min(top_k, target.shape[-1])
    order = target.topk(k, dim=-1).indices  # the target's best blocks, best first
    placed = logits.gather(-1, order)
    rest = torch.logsumexp(logits.scatter(-1, order, EXCLUDED_LOGIT), dim=-1, keepdim=True)
    remaining = torch.cat([placed, rest], -1).flip(-1).logcumsumexp(-1).flip(-1)[..., :k]
    valid = torch.arange(k, device=target.device) < choosable.sum(-1)[:, None, :, None]
    return ((remaining - placed) * valid).sum(-1)


def choosable_blocks(num_queries: int, num_blocks: int, q0: int, block_size: int, length: int, batch: int,
                     device: torch.device, sink_blocks: int | None) -> torch.Tensor:
    """Boolean ``[B, c, nb]``: causal blocks of queries ``q0..q0+c-1`` (unpadded rows), without the blocks PLAS
    always attends (the first ``sink_blocks`` and the query's own) unless ``sink_blocks`` is ``None``."""
    kv_start = torch.zeros(batch, dtype=torch.long, device=device)
    available = block_availability(num_queries, num_blocks, q0, kv_start, block_size, length)
    if sink_blocks is None:
        return available
    block_ids = torch.arange(num_blocks, device=device)
    own = torch.arange(q0, q0 + num_queries, device=device) // block_size
    forced = (block_ids[None, :] == own[:, None]) | (block_ids[None, :] < sink_blocks)
    return available & ~forced[None]


def gate_distillation_loss(
    query: torch.Tensor, key: torch.Tensor, gate: torch.Tensor | None, block_size: int, scale: float,
    query_chunk: int = 1024, sink_blocks: int | None = 1, pool: str = "max", objective: str = "kl",
    ranking_top_k: int = 8,
) -> torch.Tensor:
    """Mean of ``KL(target || prediction)`` (or, with ``objective="ranking"``, of the Plackett-Luce loss of the
    target's ``ranking_top_k`` best blocks) over heads and the queries that have at least two blocks to rank.

    ``query`` ``[B, Hq, S, D]`` and ``key`` ``[B, Hkv, S, D]`` are one unpadded causal sequence per row; ``gate``
    ``[Hkv, block_size, D]`` (``None`` = mean pooling). Both distributions run over the query's causal blocks
    minus the ones PLAS always attends (first ``sink_blocks`` and the query's own block); ``sink_blocks=None``
    keeps every causal block; ``pool`` is how the target pools the dense probabilities over a block ("max" or "sum").
    Differentiable in ``gate``; the target is not.
    """
    batch, q_heads, length, _ = query.shape
    kv_start = torch.zeros(batch, dtype=torch.long, device=query.device)
    summaries = block_summaries(key, gate, kv_start, block_size)
    num_blocks = summaries.shape[2]
    total = query.new_zeros((), dtype=torch.float32)
    count = query.new_zeros((), dtype=torch.float32)
    # The Triton target writes [c, blocks] per head (chunks bounded by TARGET_CHUNK_BYTES: at 8K one holds every
    # query); the PyTorch one materialises the [c, S] logits and goes query_chunk queries at a time. No host reads:
    # rows with fewer than two blocks to rank are weighted 0.
    if backend_for(query) == "triton":
        chunk = max(block_size, TARGET_CHUNK_BYTES // (4 * batch * q_heads * num_blocks))
    else:
        chunk = query_chunk
    for q0 in range(min(block_size, length), length, chunk):
        q1 = min(length, q0 + chunk)
        choosable = choosable_blocks(q1 - q0, num_blocks, q0, block_size, length, batch, query.device, sink_blocks)
        ranked = choosable.sum(-1) >= 2  # [B, c]: queries with something to rank
        with torch.no_grad():
            target = distillation_target(query[:, :, q0:q1], key[:, :, :q1], q0, scale, block_size, choosable, pool)
        if objective == "ranking":
            logits = _prediction_logits(query[:, :, q0:q1], summaries, choosable, scale, EXCLUDED_LOGIT)
            terms = _ranking_terms(target, logits, choosable, ranking_top_k)
        else:
            log_pred = log_predictions(query[:, :, q0:q1], summaries, choosable, scale)
            terms = torch.where(target > 0, target * (target.clamp_min(1e-30).log() - log_pred),
                                torch.zeros_like(target)).sum(-1)
        total = total + (terms * ranked[:, None]).sum()
        count = count + ranked.sum() * q_heads
    return total / count.clamp_min(1)


def attention_scale(model: Any, head_dim: int) -> float:
    """The scale of the model's attention scores: its attention module's ``scaling``, else ``head_dim ** -0.5``."""
    module = next(iter(attention_modules(model).values()))
    scaling = getattr(module, "scaling", None)
    return float(scaling) if scaling is not None else 1.0 / math.sqrt(head_dim)


def refuse_tensor_parallel(model: Any, what: str) -> None:
    """Gate training and evaluation read every KV head of each layer; a model split by tensor parallelism holds
    some of them per rank."""

    size = tensor_parallel_rank_and_size(model)[1]
    if size > 1:
        raise ValueError(f"{what} needs the whole model on one device; this one is split by tensor parallelism "
                         f"(tp_size {size}): train or evaluate gates on a model loaded without tp_plan / "
                         "distributed_config, then load the gate file on the split one")
