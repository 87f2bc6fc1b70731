"""Where a first generate()'s peak memory goes, and what transformers' chunked prefill does to it (CUDA only).

Two diagnostics on the SmolLM2-135M shape with random weights (memory and, below 32K where every method's prefill
runs dense, time do not depend on the weights; ``--model smollm2`` takes the trained model):

* ``breakdown``: each method's first generate() (3 new tokens) under ``torch.cuda.memory._record_memory_history``;
  the allocations alive at the moment the most memory was live, summed per allocating site (the innermost
  hf_sparse / transformers frames), beside ``max_memory_allocated`` and what was allocated before the call (the
  weights, and cuBLAS's workspace once a matmul ran); and the memory allocated in that call when the prefill's
  last decoder layer calls its attention's output projection. The whole cache is written by then; for SmolLM2
  (Llama's decoder layer) what else is alive there is transformers' own (the hidden states the model and the layer
  hold, the attention's query, key and value) and the attention's output, which any attention makes
  (docs/features.md lists them), so a method's peak cannot go below it by changing its feed-forward blocks or its
  attention.
* ``prefill-chunks``: PLAS with and without the int8 K/V cache, with and without ``generate(prefill_chunk_size=N)``
  (transformers' chunked prefill): the first call's peak against sdpa's, and TTFT (median of ``--rounds``
  rounds, every variant once per round in a rotating order) against bf16 PLAS's.

Quoted in docs/benchmarks.md ("First call") and docs/features.md ("int8's first call at 8K has a floor above
0.75x"). From the repository root, on a GPU:

    python studies/first_call_memory.py breakdown --length 8192 --methods sdpa plas plas-int8
    python studies/first_call_memory.py prefill-chunks --lengths 8192 16384 32768
"""
from __future__ import annotations

import argparse
import collections
import gc
import statistics
import sys
from pathlib import Path
from typing import Any, Iterable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

#: (method, prefill_chunk_size) variants of ``prefill-chunks``.
CHUNK_VARIANTS = [("sdpa", None), ("plas", None), ("plas-int8", None), ("plas-int8", 4096), ("plas-int8", 2048),
                  ("plas", 4096)]


def site(frames: list[dict[str, Any]], depth: int = 3) -> str:
    """An allocation's site: its innermost ``depth`` frames in hf_sparse or transformers (else its innermost
    frame), as ``file:line:function`` joined by " < "."""
    kept = [frame for frame in frames if "hf_sparse" in frame["filename"] or "transformers" in frame["filename"]]
    kept = kept or frames[:1]
    return " < ".join(f'{Path(f["filename"]).name}:{f["line"]}:{f["name"]}' for f in kept[:depth])


def live_at_peak(trace: Iterable[dict[str, Any]]) -> tuple[int, dict[int, dict[str, Any]]]:
    """Replay an allocator trace (``_snapshot()["device_traces"][i]``): the most bytes alive at once, from the
    allocations the trace saw, and those allocations (by address) at that moment."""
    live: dict[int, dict[str, Any]] = {}
    current = best = 0
    best_live: dict[int, dict[str, Any]] = {}
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            current += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"])["size"]
        if current > best:
            best, best_live = current, dict(live)
    return best, best_live


def by_site(allocations: Iterable[dict[str, Any]]) -> list[tuple[str, int]]:
    """Bytes per :func:`site`, largest first."""
    totals: collections.Counter = collections.Counter()
    for event in allocations:
        totals[site(event["frames"])] += event["size"]
    return totals.most_common()


def _load(name: str):
    import _common

    args = argparse.Namespace(model=name, layers=None, gguf=None, long_context=False, parallel="none",
                              checkpoint=None)
    return _common.load_model(args)


def _fresh(model) -> None:
    import torch

    from hf_sparse import graphs

    graphs.release(model)
    gc.collect()
    torch.cuda.empty_cache()


def last_output_projection(model) -> Any:
    """The output projection (``o_proj``) of ``model``'s last attention module."""
    projections = [module for name, module in model.named_modules() if name.rsplit(".", 1)[-1] == "o_proj"]
    if not projections:
        raise SystemExit(f"{type(model).__name__} has no attention output projection named o_proj")
    return projections[-1]


def record_at_last_output_projection(model, held: list) -> Any:
    """A forward pre-hook on ``model``'s last attention output projection that appends the bytes allocated when it
    is first called (the prefill's last layer) to ``held`` and removes itself (before any decode step, whose path
    looks for hooks); its handle."""
    import torch

    def record(module, inputs) -> None:
        held.append(torch.cuda.memory_allocated())
        handle.remove()

    handle = last_output_projection(model).register_forward_pre_hook(record)
    return handle


def breakdown(args: argparse.Namespace) -> None:
    import torch

    import _common
    from bench_generate import timed_generate

    loaded = _load(args.model)
    ids = loaded.prompt(args.length)
    peaks: dict[str, int] = {}
    for method in args.methods:
        _fresh(loaded.model)
        _common.use_method(loaded.model, method)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        held: list[int] = []
        handle = record_at_last_output_projection(loaded.model, held)
        torch.cuda.memory._record_memory_history(max_entries=2_000_000)
        try:
            with torch.no_grad():
                timed_generate(loaded.model, ids, 3)
        finally:
            handle.remove()
        if not held:
            raise SystemExit(f"{method}'s first call never reached the last layer's output projection")
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        traced, alive = live_at_peak(snapshot["device_traces"][torch.cuda.current_device()])
        peak = torch.cuda.max_memory_allocated()
        peaks[method] = peak
        dense = peaks.get("sdpa")
        print(f"== {method} at {args.length} tokens: peak {peak / 2**20:.1f} MiB"
              + (f" ({peak / dense:.3f}x sdpa's)" if dense else "")
              + f", {before / 2**20:.1f} MiB before the call, {traced / 2**20:.1f} MiB allocated by it at its peak; "
              f"{held[0] / 2**20:.1f} MiB allocated when the prefill's last layer enters its output projection"
              + (f" ({held[0] / dense:.3f}x sdpa's peak)" if dense else ""))
        for where, size in by_site(alive.values())[:args.top]:
            print(f"  {size / 2**20:8.1f} MiB  {where}")


def prefill_chunks(args: argparse.Namespace) -> None:
    import torch

    import _common
    from bench_generate import timed_generate

    loaded = _load(args.model)
    model = loaded.model
    for length in args.lengths:
        ids = loaded.prompt(length)
        peaks, times = {}, collections.defaultdict(list)
        for method, chunk in CHUNK_VARIANTS:
            _fresh(model)
            _common.use_method(model, method)
            torch.cuda.reset_peak_memory_stats()
            with torch.no_grad():
                timed_generate(model, ids, 3, prefill_chunk_size=chunk)
                peaks[method, chunk] = torch.cuda.max_memory_allocated() / 2**20
                timed_generate(model, ids, 1, prefill_chunk_size=chunk)
        for round_ in range(args.rounds):
            shift = round_ % len(CHUNK_VARIANTS)
            for method, chunk in CHUNK_VARIANTS[shift:] + CHUNK_VARIANTS[:shift]:
                _common.use_method(model, method)
                with torch.no_grad():
                    times[method, chunk].append(timed_generate(model, ids, 1, prefill_chunk_size=chunk)[0])
        dense, plas = peaks["sdpa", None], statistics.median(times["plas", None])
        for key in CHUNK_VARIANTS:
            seconds = statistics.median(times[key])
            print(f"{length:7d} {key[0]:10s} prefill_chunk_size={str(key[1]):5s} first call {peaks[key]:8.1f} MiB "
                  f"({peaks[key] / dense:.3f}x sdpa's)  TTFT {seconds * 1e3:8.2f} ms ({plas / seconds:.3f}x bf16 "
                  "plas's speed)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("breakdown", help="the allocations alive at each method's first-call peak")
    one.add_argument("--length", type=int, default=8192)
    one.add_argument("--methods", nargs="+", default=["sdpa", "plas", "plas-int8"])
    one.add_argument("--top", type=int, default=14, help="sites listed per method")
    chunks = commands.add_parser("prefill-chunks", help="int8 K/V and transformers' prefill_chunk_size")
    chunks.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    chunks.add_argument("--rounds", type=int, default=7)
    for sub in (one, chunks):
        sub.add_argument("--model", choices=("smollm2-random", "smollm2"), default="smollm2-random")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("first_call_memory.py measures CUDA memory: it needs a GPU")
    (breakdown if args.command == "breakdown" else prefill_chunks)(args)


if __name__ == "__main__":
    main()
