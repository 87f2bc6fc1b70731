"""A/B of versions of the PLAS selection kernel file (`hf_sparse/kernels/select_blocks.py`), interleaved in one run.

Each ``--variant NAME=PATH`` is a full copy of that file (e.g. ``git show HEAD~1:hf_sparse/kernels/select_blocks.py``),
imported beside it as a module; "current" is the package's own. Every variant must give the current kernel's
selection (indices and counts equal). Inputs: the benchmark's structured q/k (`bench_attention.structured_qkv`),
Llama-3-8B attention shape, PLAS prefill defaults (block 128, top-k 50..60, tiles of 128 queries, one sink).

Decode (``--decode``): one query per sequence, top-k 100..120 per head united over the GQA group, batch 1 and 8,
timed as CUDA-graph replays (the way decode runs).

Run on a GPU:  python benchmarks/ab_select.py --variant before=old_select_blocks.py [--lengths 32768 131072] [--decode]
"""
from __future__ import annotations

import argparse
import importlib
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bench_attention import (BLOCK, DECODE_TOP_K, HEAD_DIM, PREFILL_TOP_K, graph_ms, median_ms,  # noqa: E402
                             structured_qkv)

from hf_sparse import kernels  # noqa: E402
from hf_sparse.kernels import reference as ref  # noqa: E402
current = importlib.import_module("hf_sparse.kernels.select_blocks")

PACKAGE = pathlib.Path(current.__file__).parent


def load(name: str, path: str):
    """The kernel file at ``path`` as a module of ``hf_sparse.kernels`` (its relative imports resolve there)."""
    module_name = "_ab_" + "".join(c if c.isalnum() else "_" for c in name)
    (PACKAGE / f"{module_name}.py").write_text(pathlib.Path(path).read_text())
    return importlib.import_module(f"hf_sparse.kernels.{module_name}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=PATH")
    parser.add_argument("--decode", action="store_true", help="time the decode selection instead of prefill")
    args = parser.parse_args()
    modules = {"current": current}
    try:
        for spec in args.variant:
            name, path = spec.split("=", 1)
            modules[name] = load(name, path)
        if args.decode:
            run_decode(modules, args.lengths, args.rounds)
        else:
            run(modules, args.lengths, args.rounds)
    finally:
        for path in PACKAGE.glob("_ab_*.py"):
            path.unlink()


def compare(modules: dict, select, label: str, rounds: int, timer, unit: str) -> None:
    """Check every variant's selection against the current kernel's, then time them, interleaved, ``rounds`` times."""
    base = select(current)
    for name, module in modules.items():
        got = select(module)
        same = torch.equal(got.indices, base.indices) and torch.equal(got.counts, base.counts)
        print(f"{label} {name}: selection equal to current: {same}")
    times = {name: [] for name in modules}
    for _ in range(rounds):
        for name, module in modules.items():
            times[name].append(timer(lambda: select(module)))
    for name, values in times.items():
        print(f"{label} {name}: " + " / ".join(f"{v:.2f}" for v in values) + f" {unit}")


def run(modules: dict, lengths: list[int], rounds: int) -> None:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for length in lengths:
        query, key, _ = structured_qkv(1, length, length, structured=True)
        kv_start = ref.note_range(torch.zeros(1, dtype=torch.int64, device="cuda"), 0, 0)
        summ = kernels.block_summaries(key, None, kv_start, BLOCK)

        def select(module, steps=16):
            return module.select_blocks(query, summ, scale=HEAD_DIM ** -0.5, q_offset=0, kv_start=kv_start,
                                        block_size=BLOCK, top_k=PREFILL_TOP_K, query_tile=BLOCK, head_union=False,
                                        sink_blocks=1, search_steps=steps)

        compare(modules, select, str(length), rounds, median_ms, "ms")
        print(f"{length} current, search skipped: {median_ms(lambda: select(current, 0)):.2f} ms")
        del query, key, summ
        torch.cuda.empty_cache()


def run_decode(modules: dict, lengths: list[int], rounds: int) -> None:
    print(f"# decode, {torch.cuda.get_device_name()}, torch {torch.__version__}; us, CUDA-graph replays")
    for length in lengths:
        for batch in (1, 8):
            query, key, _ = structured_qkv(batch, 1, length, structured=True)
            kv_start = ref.note_range(torch.zeros(batch, dtype=torch.int64, device="cuda"), 0, 0)
            summ = kernels.block_summaries(key, None, kv_start, BLOCK)

            def select(module):
                return module.select_blocks(query, summ, scale=HEAD_DIM ** -0.5, q_offset=length - 1,
                                            kv_start=kv_start, block_size=BLOCK, top_k=DECODE_TOP_K, query_tile=1,
                                            head_union=True, sink_blocks=1)

            compare(modules, select, f"{length} batch {batch}", rounds, lambda fn: 1000 * graph_ms(fn), "us")
            del query, key, summ
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
