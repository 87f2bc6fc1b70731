"""Per-step decode time of a Llama-3-8B-shaped model (random weights) at one context length: "sdpa" eager,
"plas" eager (dynamic SparseCache) and "plas" with CUDA-graph decode (static SparseCache, hf_sparse.graphs);
the ``-int8`` variants use an int8 SparseCache.

    python benchmarks/profile_graph_decode.py --length 32768 --steps 32 [--variants sdpa plas-graph plas-graph-int8]

Prints the prefill time of each variant and, per decode step, the wall time (synchronised); for the graph variant
step 1 is the eager warm-up and step 2 the capture plus its replay. Medians over the steps after those.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from transformers import DynamicCache

import hf_sparse
from hf_sparse import graphs

from bench_generate import llama3_8b_model


def run(model, cache, ids, steps):
    """(prefill seconds, [decode step seconds])."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    torch.cuda.synchronize()
    prefill = time.perf_counter() - start
    token = out.logits[:, -1:].argmax(-1)
    position = torch.full((1, 1), ids.shape[1] - 1, device=ids.device)
    times = []
    for _ in range(steps):
        position = position + 1
        start = time.perf_counter()
        with torch.no_grad():
            out = model(input_ids=token, position_ids=position, past_key_values=cache, use_cache=True,
                        logits_to_keep=1)
        token = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return prefill, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--variants", nargs="+", default=["sdpa", "plas-eager", "plas-graph"],
                        choices=["sdpa", "plas-eager", "plas-graph", "plas-eager-int8", "plas-graph-int8"])
    args = parser.parse_args()
    if "sdpa" not in args.variants:
        parser.error("--variants needs sdpa (the reference of the ratios)")
    model = llama3_8b_model(args.layers)
    ids = torch.randint(0, 128256, (1, args.length), generator=torch.Generator().manual_seed(1)).cuda()
    results = {}
    for name in args.variants * 2:
        graphs.uninstall(model)
        gc.collect()  # the previous variant's cache and graph sit in reference cycles
        torch.cuda.empty_cache()
        if name == "sdpa":
            model.set_attn_implementation("sdpa")
            cache = DynamicCache(config=model.config)
        else:
            graph = name.startswith("plas-graph")
            hf_sparse.configure(model, hf_sparse.PLASConfig(decode_cuda_graph=graph))
            static = args.length + args.steps + 1 if graph else None
            cache = hf_sparse.SparseCache(model.config, max_cache_len=static,
                                          kv_dtype="int8" if name.endswith("int8") else "auto")
            if static:
                graphs.install(model)
        before = graphs.stats(model).replays if graphs.stats(model) else 0
        prefill, times = run(model, cache, ids, args.steps)
        stats = graphs.stats(model)
        steady = statistics.median(times[2:])
        results.setdefault(name, []).append((prefill, times[0], times[1], steady))
        print(f"{name:>11}: prefill {prefill:.3f} s, step1 {times[0] * 1e3:.1f} ms, step2 {times[1] * 1e3:.1f} ms, "
              f"median of steps 3..{args.steps} {steady * 1e3:.2f} ms, replays {(stats.replays if stats else 0) - before}",
              flush=True)
        del cache
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()} | {args.layers} layers | context {args.length} | medians, two rounds")
    sdpa = statistics.median(r[3] for r in results["sdpa"])
    for name, rows in results.items():
        steady = statistics.median(r[3] for r in rows)
        print(f"{name:>11} | prefill {statistics.median(r[0] for r in rows):.3f} s | step {steady * 1e3:7.2f} ms | "
              f"sdpa / this {sdpa / steady:5.2f}x")


if __name__ == "__main__":
    main()
