"""How much of the true attention mass block selections keep, per layer and head, against XAttention's threshold.

Runs the embedded SmolLM2-135M-Instruct densely on the standard library's source text (``--tokens`` tokens),
captures every layer's post-rotary queries and keys, and for each layer and query head computes each query's true
attention probabilities summed per key block. Against those it scores selections made from the same queries and
keys (no error carried between layers), all with XAttention's forced sink and diagonal blocks:

* ``mean@T`` / ``max@T``: XAttention's antidiagonal estimate (``--stride``, ``pool="mean"``, the paper's, or
  ``"max"``) and its cumulative threshold ``T`` per query tile;
* ``lse@T``: the antidiagonal products pooled by log-sum-exp (their summed exponentials: an unbiased sample of
  the group's attention numerator), a prototype here only;
* ``exact@T``: the threshold rule on the exact block masses (the tile's true probabilities summed per block):
  what the threshold keeps with a perfect estimate;
* ``groups@T``: the threshold per query group of ``stride`` queries (max pooling), united over the tile's groups;
* ``plas[k]`` / ``plas-tile[k]``: PLAS's mean-pooled threshold top-k (``prefill_top_k=k``, query tiles of
  ``--block-size``) united per tile as PLAS does, and the tile-budget prototype: the tile's block probabilities
  pooled over its queries, blocks kept in descending pooled mass until they hold what the queries' own top-k
  held.

Per selection: density (attended / causal blocks) and each query's kept mass (mean, 5% quantile, attention KL
``mean(-log kept)``), per head; with ``--union`` XAttention's selections are united over each GQA group's heads
first (``gqa_reduce="any"``, what the kernels attend). Prints one line per layer and a summary table; ``--json``
keeps the per-head numbers.

    PYTHONPATH=. python benchmarks/xattn_mass.py --tokens 8192 --thresholds 0.8 0.9 --union
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
PLAS_TOP_K = [(2, 3), (4, 5), (8, 10)]


def capture(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's (query, key) of one dense forward, float32 on the CPU."""
    layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def keep(module, query, key, value, attention_mask):
        layers.append((query.detach().float().cpu(), key.detach().float().cpu()))

    with attention_probe(model, keep), torch.no_grad():
        model(ids)
    return layers


def true_block_probs(query: torch.Tensor, key: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[Hq, Nq, nb]``: each query's causal softmax attention summed per key block (batch 1, no cached prefix)."""
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


def kept_stats(block_probs: torch.Tensor, chosen: torch.Tensor, available: torch.Tensor, tile: int) -> dict:
    """Per head: density over the causal (available) blocks, mean / 5% quantile of each query's kept mass, and
    mean -log(kept). ``chosen`` is ``[Hq, tiles, nb]`` (one row per head and query tile of ``tile`` queries)."""
    tiles = torch.arange(block_probs.shape[1]) // tile
    kept = (block_probs * chosen[:, tiles].float()).sum(-1).clamp(1e-12, 1.0)  # [Hq, Nq]
    return {
        "density": (chosen & available).sum((1, 2)).div(available.sum().clamp_min(1)).tolist(),
        "kept_mean": kept.mean(1).tolist(),
        "kept_p05": kept.quantile(0.05, dim=1).tolist(),
        "attention_kl": (-kept.log()).mean(1).tolist(),
    }


def antidiagonal_lse(query: torch.Tensor, key: torch.Tensor, block_size: int, stride: int,
                     per_group: bool = False) -> torch.Tensor:
    """Antidiagonal masses with the ``stride`` products pooled by log-sum-exp (batch 1, no padding, length a
    multiple of ``block_size``): ``[Hq, tiles, nb]``, or per query group ``[Hq, groups, nb]``."""
    _, q_heads, num_queries, dim = query.shape
    groups = num_queries // stride
    q = query[0].view(q_heads, groups, stride, dim).flip(2)
    k = key[0].repeat_interleave(q_heads // key.shape[1], 0).view(q_heads, groups, stride, dim)
    pooled = torch.logsumexp(torch.einsum("hgmd,hrmd->hgrm", q, k) * dim**-0.5, -1)
    last = torch.arange(groups) * stride + stride - 1
    visible = torch.arange(groups)[None, :] * stride <= last[:, None]
    probs = torch.softmax(pooled.masked_fill(~visible, float("-inf")), -1)
    per_block = block_size // stride
    probs = probs.view(q_heads, groups, groups // per_block, per_block).sum(3)
    return probs if per_group else probs.view(q_heads, groups // per_block, per_block, -1).sum(2)


def plas_tile_budget(query, summaries, scale, top_k, available, forced, block_size):
    """The tile-budget prototype (see the module docstring): ``[Hq, tiles, nb]``."""
    _, q_heads, num_queries, _ = query.shape
    num_blocks = summaries.shape[2]
    query_avail = reference.block_availability(num_queries, num_blocks, 0, torch.zeros(1, dtype=torch.long),
                                               block_size, num_queries)
    logits = reference.block_logits(query, summaries, scale, query_avail)[0]  # [Hq, Nq, nb]
    probs = torch.softmax(logits, -1).nan_to_num_(0.0)
    chosen = reference.threshold_topk(logits, query_avail, top_k, 16)
    tiles = torch.arange(num_queries) // block_size
    num_tiles = available.shape[0]
    pooled = torch.zeros(q_heads, num_tiles, num_blocks).index_add_(1, tiles, probs)
    budget = torch.zeros(q_heads, num_tiles).index_add_(1, tiles, (probs * chosen).sum(-1))
    share = (budget / pooled.sum(-1).clamp_min(1e-30)).clamp_max(1.0)
    out = torch.zeros(q_heads, num_tiles, num_blocks, dtype=torch.bool)
    for h in range(q_heads):
        for t in range(num_tiles):
            out[h, t] = reference.cumulative_threshold_select(pooled[h, t], available[t], forced[t], float(share[h, t]))
    return out


def analyse_layer(query, key, block_probs, thresholds, group_thresholds, block_size, stride, union) -> dict:
    """Kept mass and density per head of every selection of the module docstring on one layer."""
    _, q_heads, num_queries, dim = query.shape
    length = key.shape[2]
    layout = RowLayout.uniform(1)
    scale = dim**-0.5
    group = q_heads // key.shape[1]
    num_blocks = block_probs.shape[-1]
    num_tiles = reference.num_query_tiles(num_queries, length - num_queries, layout, block_size)
    tile_blocks = XAttnMethod(XAttnConfig(block_size=block_size, stride=stride, dense_last=0))._tile_blocks
    available, forced = (mask[0] for mask in tile_blocks(num_queries, 0, layout.starts, 0, num_tiles, num_blocks))
    kwargs = dict(scale=scale, q_offset=0, kv_start=layout, block_size=block_size, stride=stride)
    tiles = torch.arange(num_queries) // block_size
    masses = {
        "mean": reference.antidiagonal_block_scores(query, key, pool="mean", **kwargs)[0],
        "max": reference.antidiagonal_block_scores(query, key, pool="max", **kwargs)[0],
        "lse": antidiagonal_lse(query, key, block_size, stride),
        "exact": torch.zeros(q_heads, num_tiles, num_blocks).index_add_(1, tiles, block_probs),
    }
    group_masses = max_pooled_group_masses(query, key, block_size, stride)
    group_tile = torch.arange(group_masses.shape[1]) // (block_size // stride)

    def united(chosen: torch.Tensor) -> torch.Tensor:
        if not union:
            return chosen
        return chosen.view(-1, group, *chosen.shape[1:]).any(1, keepdim=True).expand(-1, group, -1, -1).reshape(
            chosen.shape)

    result: dict = {}
    for threshold in thresholds:
        for name, mass in masses.items():
            chosen = reference.cumulative_threshold_select(mass, available[None], forced[None], threshold)
            result[f"{name}@{threshold}"] = kept_stats(block_probs, united(chosen), available, block_size)
    for threshold in group_thresholds:
        chosen = reference.cumulative_threshold_select(
            group_masses, available[group_tile][None], forced[group_tile][None], threshold)
        chosen = chosen.view(q_heads, num_tiles, -1, num_blocks).any(2)
        result[f"groups@{threshold}"] = kept_stats(block_probs, united(chosen), available, block_size)
    summaries = reference.block_summaries(key, None, layout, block_size)
    for top_k in PLAS_TOP_K:
        plas = PLASMethod(PLASConfig(block_size=block_size, query_union=block_size, prefill_top_k=top_k))
        selection = plas.select_prefill(query, summaries, key, scale=scale, q_offset=0, kv_start=layout)
        result[f"plas{list(top_k)}"] = kept_stats(block_probs, selection.to_mask(num_blocks)[0], available,
                                                  block_size)
        chosen = plas_tile_budget(query, summaries, scale, top_k, available, forced, block_size)
        result[f"plas-tile{list(top_k)}"] = kept_stats(block_probs, chosen, available, block_size)
    return result


def max_pooled_group_masses(query, key, block_size, stride) -> torch.Tensor:
    """``[Hq, groups, nb]``: XAttention's max-pooled masses per query group (each group's softmax over key groups
    summed per key block), from the reference with one-group "tiles" (block_size = stride) summed back per block."""
    _, _, num_queries, dim = query.shape
    masses = reference.antidiagonal_block_scores(query, key, scale=dim**-0.5, q_offset=0,
                                                 kv_start=RowLayout.uniform(1), block_size=stride, stride=stride,
                                                 pool="max")[0]  # [Hq, groups, key groups]
    return masses.unflatten(-1, (-1, block_size // stride)).sum(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.8, 0.9])
    parser.add_argument("--group-thresholds", type=float, nargs="*", default=[0.5, 0.7],
                        help="thresholds of the per-query-group selection (united per tile, so lower)")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--stride", type=int, default=8)
    parser.add_argument("--union", action="store_true", help="XAttention selections after the GQA union ('any')")
    parser.add_argument("--json", default=None, help="write the per-head numbers here")
    args = parser.parse_args()

    model, tokenizer = load_default_model(attn_implementation="sdpa")
    ids = tokenizer(stdlib_text(6 * args.tokens), return_tensors="pt").input_ids[:, : args.tokens]
    if ids.shape[1] % args.block_size:
        raise SystemExit(f"--tokens must be a multiple of --block-size ({args.block_size})")
    start = time.perf_counter()
    layers = capture(model, ids)
    print(f"SmolLM2-135M, {ids.shape[1]} tokens, {len(layers)} layers captured in {time.perf_counter() - start:.1f} s")
    results = []
    for index, (query, key) in enumerate(layers):
        block_probs = true_block_probs(query, key, args.block_size)
        results.append(analyse_layer(query, key, block_probs, args.thresholds, args.group_thresholds,
                                     args.block_size, args.stride, args.union))
        cells = "  ".join(f"{name} d={sum(s['density']) / len(s['density']):.3f} "
                          f"k={sum(s['kept_mean']) / len(s['kept_mean']):.3f}" for name, s in results[-1].items())
        print(f"layer {index:2d}  {cells}", flush=True)
    print(f"\nmean over layers and heads ({'after' if args.union else 'before'} the GQA union)")
    print("| selection | density | kept mass (mean) | kept mass, 5% quantile (worst head, median layer) | "
          "attention KL |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in results[0]:
        def stat(key):
            return torch.tensor([r[name][key] for r in results])
        p05 = stat("kept_p05").min(1).values.median()
        print(f"| {name} | {stat('density').mean():.3f} | {stat('kept_mean').mean():.3f} | {p05:.3f} | "
              f"{stat('attention_kl').mean():.4f} |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"tokens": ids.shape[1], "block_size": args.block_size, "stride": args.stride,
                       "union": args.union, "layers": results}, handle)


if __name__ == "__main__":
    main()
