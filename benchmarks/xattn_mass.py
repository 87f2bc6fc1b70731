"""How much of the true attention mass a block selection keeps, per layer and head, against XAttention's threshold.

Runs the embedded SmolLM2-135M-Instruct densely on the standard library's source text (``--tokens`` tokens),
captures every layer's post-rotary queries and keys, and for each layer and query head computes each query's true
attention probabilities summed per key block. Against those it scores selections made from the same queries and
keys (no error carried between layers):

* ``xattn``: XAttention's antidiagonal estimate (``--stride``) and cumulative threshold, per query head;
* ``exact``: the same threshold rule on the exact block masses (the tile's true probabilities summed per block),
  i.e. what the threshold would keep with a perfect estimate;
* ``plas``: PLAS's mean-pooled threshold top-k (its default config, query tiles of ``--block-size``).

For each it reports the density (attended / causal blocks) and the kept mass per query (mean, the 5% quantile, and
the attention KL ``mean(-log kept)``) per head, before the GQA union (``gqa_reduce`` is applied after: the union
only adds blocks), and writes the per-head numbers as JSON.

    PYTHONPATH=. python benchmarks/xattn_mass.py --tokens 8192 --thresholds 0.8 0.9 0.95
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from hf_sparse.config import PLASConfig, XAttnConfig
from hf_sparse.default_model import load_default_model
from hf_sparse.eval import stdlib_text
from hf_sparse.integration import attention_probe
from hf_sparse.kernels import reference
from hf_sparse.methods.plas import PLASMethod
from hf_sparse.methods.xattn import XAttnMethod
from hf_sparse.selection import RowLayout

_QUERY_CHUNK = 512


def capture(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's (query, key) of one dense forward, float32 on the CPU."""
    layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def keep(module, query, key, value, attention_mask):
        layers.append((query.detach().float().cpu(), key.detach().float().cpu()))

    with attention_probe(model, keep), torch.no_grad():
        model(ids)
    return layers


def true_block_probs(query: torch.Tensor, key: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[Hq, Nq, nb]``: each query's causal softmax attention summed per key block (batch 1, queries last)."""
    _, q_heads, num_queries, dim = query.shape
    length = key.shape[2]
    keys = key[0].repeat_interleave(q_heads // key.shape[1], dim=0)
    num_blocks = -(-length // block_size)
    out = torch.zeros(q_heads, num_queries, num_blocks)
    slots = torch.arange(length)
    for q0 in range(0, num_queries, _QUERY_CHUNK):
        q1 = min(num_queries, q0 + _QUERY_CHUNK)
        q_slot = length - num_queries + torch.arange(q0, q1)
        scores = torch.matmul(query[0, :, q0:q1], keys.transpose(-1, -2)) / dim**0.5
        probs = torch.softmax(scores.masked_fill(slots[None, None, :] > q_slot[None, :, None], float("-inf")), -1)
        padded = torch.nn.functional.pad(probs, (0, num_blocks * block_size - length))
        out[:, q0:q1] = padded.view(q_heads, q1 - q0, num_blocks, block_size).sum(-1)
    return out


def kept_stats(block_probs: torch.Tensor, chosen: torch.Tensor, tile: int) -> dict[str, list[float]]:
    """Per head: density over causal blocks, mean / 5% quantile of each query's kept mass, mean -log(kept).

    ``chosen`` is ``[Hq, tiles, nb]`` (one row per head and query tile of ``tile`` queries)."""
    num_queries = block_probs.shape[1]
    tiles = torch.arange(num_queries) // tile
    kept = (block_probs * chosen[:, tiles].float()).sum(-1).clamp(1e-12, 1.0)  # [Hq, Nq]
    return {
        "kept_mean": kept.mean(1).tolist(),
        "kept_p05": kept.quantile(0.05, dim=1).tolist(),
        "attention_kl": (-kept.log()).mean(1).tolist(),
    }


def antidiagonal_masses(query: torch.Tensor, key: torch.Tensor, block_size: int, stride: int, pool: str,
                        per_group: bool = False) -> torch.Tensor:
    """``[Hq, tiles, nb]`` antidiagonal block masses (batch 1, no padding) with the ``stride`` products of each
    antidiagonal pooled by ``pool``: "mean" of the logits (XAttention's) or "lse" (log-sum-exp: the group's
    score is the log of the summed exponentials, so a single large product is not averaged away)."""
    _, q_heads, num_queries, dim = query.shape
    length = key.shape[2]
    assert num_queries == length and length % block_size == 0
    groups = length // stride
    q = query[0].view(q_heads, groups, stride, dim).flip(2)
    k = key[0].repeat_interleave(q_heads // key.shape[1], 0).view(q_heads, groups, stride, dim)
    logits = torch.einsum("hgmd,hrmd->hgrm", q, k) * dim**-0.5
    if pool == "mean":
        pooled = logits.mean(-1)
    elif pool == "max":
        pooled = logits.amax(-1)
    else:
        pooled = torch.logsumexp(logits, -1)
    last = torch.arange(groups) * stride + stride - 1
    visible = torch.arange(groups)[None, :] * stride <= last[:, None]
    probs = torch.softmax(pooled.masked_fill(~visible, float("-inf")), -1)
    per_block = block_size // stride
    if per_group:
        return probs.view(q_heads, groups, groups // per_block, per_block).sum(3)  # [Hq, G, nb]
    return probs.view(q_heads, groups // per_block, per_block, groups // per_block, per_block).sum((2, 4))


def density(chosen: torch.Tensor, available: torch.Tensor) -> list[float]:
    """Per head: attended / causal (available) blocks."""
    return (chosen & available).sum((1, 2)).div(available.sum((1, 2)).clamp_min(1)).tolist()


def analyse_layer(query, key, block_probs, thresholds, block_size, stride, union) -> dict:
    """Kept mass and density per head for XAttention (estimate and exact masses) and PLAS on one layer."""
    _, q_heads, num_queries, dim = query.shape
    length = key.shape[2]
    layout = RowLayout.uniform(1)
    scale = dim**-0.5
    xattn = XAttnMethod(XAttnConfig(block_size=block_size, stride=stride))
    num_tiles = reference.num_query_tiles(num_queries, length - num_queries, layout, block_size)
    num_blocks = block_probs.shape[-1]
    available, forced = xattn._tile_blocks(num_queries, length - num_queries, layout.starts, 0, num_tiles, num_blocks)
    available, forced = available[0], forced[0]  # [tiles, nb]
    estimate = reference.antidiagonal_block_scores(
        query, key, scale=scale, q_offset=length - num_queries, kv_start=layout, block_size=block_size, stride=stride,
    )[0]  # [Hq, tiles, nb]
    lse = antidiagonal_masses(query, key, block_size, stride, "lse")
    pooled_max = antidiagonal_masses(query, key, block_size, stride, "max")
    mean = antidiagonal_masses(query, key, block_size, stride, "mean")
    print("mean prototype vs reference", float((mean - estimate).abs().max()))
    tiles = torch.arange(num_queries) // block_size
    exact = torch.zeros(q_heads, num_tiles, num_blocks).index_add_(1, tiles, block_probs)
    result: dict = {}
    group_mass = antidiagonal_masses(query, key, block_size, stride, "max", per_group=True)  # [Hq, G, nb]
    per_block = block_size // stride
    group_tile = torch.arange(group_mass.shape[1]) // per_block
    for threshold in GROUP_THRESHOLDS:
        chosen_groups = reference.cumulative_threshold_select(
            group_mass, available[group_tile][None], forced[group_tile][None], threshold)
        chosen = chosen_groups.view(q_heads, num_tiles, per_block, num_blocks).any(2)
        if union:
            group = q_heads // key.shape[1]
            chosen = chosen.view(-1, group, *chosen.shape[1:]).any(1, keepdim=True).expand(
                -1, group, -1, -1).reshape(chosen.shape)
        stats = kept_stats(block_probs, chosen, block_size)
        stats["density"] = density(chosen, available[None].expand_as(chosen))
        result[f"groupunion@{threshold}"] = stats
    for threshold in thresholds:
        for name, mass in (("xattn", estimate), ("lse", lse), ("max", pooled_max), ("exact", exact)):
            chosen = reference.cumulative_threshold_select(mass, available[None], forced[None], threshold)
            if union:  # gqa_reduce="any": each head attends to what any head of its group chose
                group = q_heads // key.shape[1]
                chosen = chosen.view(-1, group, *chosen.shape[1:]).any(1, keepdim=True).expand(
                    -1, group, -1, -1).reshape(chosen.shape)
            stats = kept_stats(block_probs, chosen, block_size)
            stats["density"] = density(chosen, available[None].expand_as(chosen))
            result[f"{name}@{threshold}"] = stats
    summaries = reference.block_summaries(key, None, layout, block_size)
    for top_k in PLAS_TOP_K:
        plas = PLASMethod(PLASConfig(block_size=block_size, query_union=block_size, prefill_top_k=top_k))
        selection = plas.select_prefill(query, summaries, key, scale=scale, q_offset=length - num_queries,
                                        kv_start=layout)
        chosen = selection.to_mask(num_blocks)[0]
        stats = kept_stats(block_probs, chosen, block_size)
        stats["density"] = density(chosen, available[None].expand_as(chosen))
        result[f"plas{list(top_k)}"] = stats
        chosen = plas_tile_budget(query, summaries, scale, top_k, available, forced, block_size)
        stats = kept_stats(block_probs, chosen, block_size)
        stats["density"] = density(chosen, available[None].expand_as(chosen))
        result[f"plas-tile{list(top_k)}"] = stats
    return result


PLAS_TOP_K = [(4, 5), (8, 10), (16, 20)]
GROUP_THRESHOLDS = [0.3, 0.5, 0.7]


def plas_tile_budget(query, summaries, scale, top_k, available, forced, block_size):
    """Prototype: per tile, the summary probabilities pooled over its queries; blocks kept in descending pooled
    mass until they hold the pooled mass that the queries' own top-k selections hold."""
    _, q_heads, num_queries, _ = query.shape
    num_blocks = summaries.shape[2]
    query_avail = reference.block_availability(num_queries, num_blocks, 0, torch.zeros(1, dtype=torch.long),
                                               block_size, num_queries)
    probs = reference.block_scores(query, summaries, scale, query_avail)[0]  # [Hq, Nq, nb]
    chosen = reference.threshold_topk(probs, query_avail, top_k, 16)
    tiles = torch.arange(num_queries) // block_size
    num_tiles = available.shape[0]
    pooled = torch.zeros(q_heads, num_tiles, num_blocks).index_add_(1, tiles, probs)
    budget = torch.zeros(q_heads, num_tiles).index_add_(1, tiles, (probs * chosen).sum(-1))
    total = pooled.sum(-1)
    out = torch.zeros(q_heads, num_tiles, num_blocks, dtype=torch.bool)
    for h in range(q_heads):
        for t in range(num_tiles):
            frac = float(budget[h, t] / total[h, t].clamp_min(1e-30))
            out[h, t] = reference.cumulative_threshold_select(pooled[h, t], available[t], forced[t], min(frac, 1.0))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.8, 0.9, 0.95])
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--stride", type=int, default=8)
    parser.add_argument("--union", action="store_true", help="XAttention selections after the GQA union ('any')")
    parser.add_argument("--json", default=None, help="write the per-head numbers here")
    args = parser.parse_args()

    torch.manual_seed(0)
    model, tokenizer = load_default_model(attn_implementation="sdpa")
    ids = tokenizer(stdlib_text(6 * args.tokens), return_tensors="pt").input_ids[:, : args.tokens]
    start = time.perf_counter()
    layers = capture(model, ids)
    print(f"SmolLM2-135M, {ids.shape[1]} tokens, {len(layers)} layers captured in {time.perf_counter() - start:.1f} s")
    results = []
    for index, (query, key) in enumerate(layers):
        block_probs = true_block_probs(query, key, args.block_size)
        results.append(analyse_layer(query, key, block_probs, args.thresholds, args.block_size, args.stride,
                                     args.union))
        row = results[-1]
        cells = "  ".join(
            f"{name} d={sum(s['density']) / len(s['density']):.3f} k={sum(s['kept_mean']) / len(s['kept_mean']):.3f}"
            f" p05={min(s['kept_p05']):.3f}" for name, s in row.items()
        )
        print(f"layer {index:2d}  {cells}", flush=True)
    print("\nmean over layers and heads")
    print("| selection | density | kept mass (mean) | kept mass (worst head's 5% quantile, median layer) | attention KL |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in results[0]:
        dens = torch.tensor([r[name]["density"] for r in results])
        kept = torch.tensor([r[name]["kept_mean"] for r in results])
        p05 = torch.tensor([r[name]["kept_p05"] for r in results]).min(1).values.median()
        akl = torch.tensor([r[name]["attention_kl"] for r in results])
        print(f"| {name} | {dens.mean():.3f} | {kept.mean():.3f} | {p05:.3f} | {akl.mean():.4f} |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"tokens": ids.shape[1], "block_size": args.block_size, "stride": args.stride,
                       "layers": results}, handle)


if __name__ == "__main__":
    main()
