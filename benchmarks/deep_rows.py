"""How often PLAS's threshold search has to reach deep: per layer, the share of prefill queries (the last
``--queries`` of a held-out prose window, every query head) whose ``top_k[0]``-th best block scores more than
``search_steps * log 2`` under their best block (the deepest cut that halving f reaches: such rows bisect the cut
itself, ``hf_sparse.kernels.reference.threshold_topk``), and the share of query tiles holding at least one. Mean
pooled block summaries of SmolLM2-135M-Instruct, dense attention (no GPU needed; on CPU float32).

    python benchmarks/deep_rows.py --length 16384 --json docs/runs/deep_rows_cpu.json
"""
from __future__ import annotations

import argparse
import math

import torch

from hf_sparse import PLASConfig
from hf_sparse.default_model import load_default_model
from hf_sparse.eval import held_out_sequences
from hf_sparse.kernels import reference
from hf_sparse.training import probe_layers

from _common import environment, header, table, write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--queries", type=int, default=1024, help="the window's last queries (a multiple of the tile)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json")
    args = parser.parse_args()
    config = PLASConfig()
    block, tile, (left, _), steps = config.block_size, config.query_union, config.prefill_top_k, config.search_steps
    if args.queries % tile or args.queries > args.length:
        raise SystemExit(f"--queries must be a multiple of the query tile {tile} and at most --length")
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model, tokenizer = load_default_model(dtype=dtype, device=args.device)
    ids = held_out_sequences(tokenizer, args.length, 1).to(args.device)
    depth = steps * math.log(2.0)
    rows = []

    def on_layer(layer, module, query, key):
        kv_start = torch.zeros(1, dtype=torch.long, device=key.device)
        summaries = reference.block_summaries(key, None, kv_start, block)
        q0 = args.length - args.queries
        available = reference.block_availability(args.queries, summaries.shape[2], q0, kv_start, block, args.length)
        logits = reference.block_logits(query[:, :, q0:], summaries, module.scaling, available)
        gap = logits.amax(-1) - logits.topk(left, -1).values[..., -1]
        deep = gap > depth  # [1, Hq, queries]
        tiles = deep.view(1, deep.shape[1], -1, tile).any(-1)
        rows.append({"layer": layer, "rows": deep.float().mean().item(), "tiles": tiles.float().mean().item()})

    probe_layers(model, ids, [i for i in range(model.config.num_hidden_layers - 1)], on_layer)
    mean = {key: sum(r[key] for r in rows) / len(rows) for key in ("rows", "tiles")}
    print(header(environment()))
    print(f"deep rows: SmolLM2-135M-Instruct, {args.length} tokens of held-out prose, last {args.queries} queries, "
          f"block {block}, top_k[0] {left}, depth {depth:.2f} nats")
    print(table([("layer", lambda r: str(r["layer"])), ("deep rows", lambda r: f"{r['rows']:.3f}"),
                 ("tiles with one", lambda r: f"{r['tiles']:.3f}")], rows + [{"layer": "mean", **mean}]))
    if args.json:
        write_json(args.json, {"environment": environment(), "args": vars(args), "rows": rows, "mean": mean})


if __name__ == "__main__":
    main()
