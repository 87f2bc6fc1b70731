"""Where the time of a prefill or of a decode step goes, on a whole model (``--model``: a Llama-3-8B- or
SmolLM2-135M-shaped model with random weights, or the trained SmolLM2-135M-Instruct on real text). A diagnostic
(its findings in docs/benchmarks.md and docs/kernels.md), not a tool; from the repository root (it imports
benchmarks/_common.py):

    python studies/profile_model.py prefill [--length 32768] [--methods sdpa plas plas-noprobe] [--host-diff 20]
    python studies/profile_model.py decode [--length 32768] [--layers 8] [--methods plas xattn] [--eager]
    python studies/profile_model.py graph [--length 32768] [--steps 32] [--variants sdpa plas-eager plas-graph]
    python studies/profile_model.py layers [--length 131072] [--methods plas xattn] [--only 0 12]

prefill: one forward (``--generate``: ``generate(max_new_tokens=1)``, TTFT) over ``--length`` prompt tokens with an
  all-ones 2D attention mask (default model: the
  SmolLM2-135M shape, whose small layers show host time). Per method: the median wall time of ``--repeats``
  forwards (rounds in which the methods take turns, all before any profiling) against the GPU busy time (its
  kernels' union, torch.profiler): what the host adds; the GPU time by kernel; the synchronising CUDA calls of
  one forward, by the Python line that made them
  (torch.cuda.set_sync_debug_mode); ``--host-diff N``: each method's host time by Python function against the first
  method's (cProfile over N calls). "plas-noprobe": dense_above_density=None, the sparse kernels at any density.
decode: a prefill of ``--length`` tokens into a static SparseCache, then ``--steps`` decode steps under
  torch.profiler, replayed from a CUDA graph (hf_sparse.graphs, as generate() runs them) or, with ``--eager``,
  launched from Python (the same kernels). Per method: GPU time per step by kernel, kernels per step, the GPU's
  idle time between kernels (launch gaps) and the step's span (first kernel start to last kernel end), and the
  bytes a step must read from HBM: the K/V of the blocks each layer attends (counted from one recorded step,
  hf_sparse.record_sparsity; dense layers: every token), the block summaries and the weights; each divided by
  ``--bandwidth`` (default 3.35e12 B/s, the H100 SXM's) is a floor, printed beside the span and their ratio.
layers: each layer of one prefill, in isolation: the layer's post-rotary queries, keys and values kept from one sdpa
  forward over ``--length`` tokens, then per layer the fastest dense SDPA (its backend named), and per ``--methods``
  entry the layer's full prefill selection (wall time, synchronised: what the prefill waits for), the sparse attention
  over it (do_bench) and its density (attended / causal blocks), with (selection + attention) / dense: where a sparse
  layer pays and where it does not, whatever the density probe would have decided.
memory: per method, the peak of two generate(max_new_tokens=``--new-tokens``) calls over ``--length`` prompt tokens
  (the first compiles, captures and allocates what later calls reuse), the memory held between calls (weights,
  kept caches and graphs), and what is held and what is live at the highest point, grouped by the innermost
  hf_sparse or transformers line that allocated it (torch.cuda.memory._record_memory_history).
graph: the wall time per decode step (synchronised) of "sdpa" (eager, dynamic cache) and of PLAS / XAttention
  eager (dynamic SparseCache) or from a CUDA graph (static SparseCache); "-int8": an int8 cache. Step 1 of a
  graph variant is its eager warm-up and step 2 the capture and first replay: medians over the later steps,
  ``--rounds`` rounds of every variant.

Each sub-command's --help lists its options. Tables on stdout, the header holding device, versions and date.
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import re
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

# benchmarks/_common.py: the helpers the benchmark scripts share
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _common import (add_model_arguments, cache_kwarg, environment, graph_counts, header, load_model,  # noqa: E402
                     interleaved, method_name, progress, require_cuda, speedup, table, use_method)

GPU_ACTIVITY = ("kernel", "gpu_memcpy", "gpu_memset")  # trace categories of work on the GPU


def command_help(command: str) -> str:
    """The module docstring's paragraph on ``command`` (its indented lines continue it)."""
    return re.split(r"\n(?! )", __doc__.split(f"\n{command}: ", 1)[1], maxsplit=1)[0]


def sparse_variants(options: tuple[str, ...]) -> list[str]:
    """"plas" and "xattn" with each combination of ``options`` (:data:`_common.METHOD_OPTIONS`), in that order."""
    names = []
    for base in ("plas", "xattn"):
        names.append(base)
        for option in options:
            names += [f"{name}-{option}" for name in names if name.startswith(base)]
    return names


# -- torch.profiler -----------------------------------------------------------------------------------------------


def kernel_table(prof, per: int, rows: int) -> str:
    """The ``rows`` kernels of most GPU time, per ``per`` (forwards or steps)."""
    events = sorted((e for e in prof.key_averages() if e.device_time_total > 0), key=lambda e: -e.device_time_total)
    return table([("us", lambda e: f"{e.device_time_total / per:.1f}"), ("calls", lambda e: f"{e.count / per:g}"),
                  ("kernel", lambda e: e.key[:110])], events[:rows])


def gpu_intervals(prof) -> list[tuple[float, float]]:
    """(start, end) in us of every kernel, copy and memset of the profile, by start (the profiler's device-side
    events; the chrome trace's categories when the profiler does not list its events)."""
    try:
        events = prof.profiler.kineto_results.events()
        return sorted((e.start_ns() / 1e3, e.end_ns() / 1e3) for e in events
                      if e.device_type() == torch.autograd.DeviceType.CUDA)
    except AttributeError:
        pass
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/trace.json"
        prof.export_chrome_trace(path)
        with open(path) as trace:
            events = json.load(trace)
    events = events["traceEvents"] if isinstance(events, dict) else events
    return sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                  if e.get("ph") == "X" and e.get("cat", "").lower() in GPU_ACTIVITY)


def timeline(intervals: list[tuple[float, float]]) -> dict:
    """Busy time (the union of the intervals), span (first start to last end) and idle gaps, in us."""
    busy, end = 0.0, None
    for start, stop in intervals:
        if end is None or start >= end:
            busy += stop - start
        elif stop > end:
            busy += stop - end
        end = stop if end is None else max(end, stop)
    span = end - intervals[0][0] if intervals else 0.0
    return {"launches": len(intervals), "busy_us": busy, "span_us": span, "idle_us": span - busy}


# -- prefill --------------------------------------------------------------------------------------------------


def forward(model, ids: torch.Tensor) -> None:
    model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=1)


def first_token(model, ids: torch.Tensor) -> None:
    """``generate(max_new_tokens=1)``: the prefill as generate() runs it (its cache, hooks and sampling)."""
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, pad_token_id=0)


def sync_sites(model, ids: torch.Tensor, forward=forward) -> collections.Counter:
    """Synchronising CUDA calls of one forward, counted by the innermost ``file:line`` of hf_sparse (else of
    transformers) on the Python stack that made them."""
    sites = collections.Counter()
    shown = warnings.showwarning

    def record(message, *args, **kwargs):
        if "synchroniz" not in str(message):
            return
        frames = traceback.extract_stack()[:-1]
        ours = [f for f in frames if "/hf_sparse/" in f.filename] or [f for f in frames if "transformers" in f.filename]
        frame = (ours or frames)[-1]
        sites[f"{frame.filename.split('/')[-1]}:{frame.lineno} {frame.name}"] += 1

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            forward(model, ids)
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = shown
    return sites


def host_profile(model, ids: torch.Tensor, forward, rows: int) -> str:
    """cProfile of one synchronised call: the ``rows`` functions of most own time, then of most cumulative time
    (where the host spends what the GPU does not need; a blocking CUDA call shows as the own time of its caller)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    forward(model, ids)
    torch.cuda.synchronize()
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        forward(model, ids)
        torch.cuda.synchronize()
    ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    return "\n".join(line for line in out.getvalue().splitlines() if line.strip()) + "\nhost time by op:\n" + ops


def own_times(model, ids: torch.Tensor, forward, calls: int) -> dict[str, tuple[float, float]]:
    """Per Python function (``file:line(name)``, paths from the package folder on), its calls and own time in ms per
    call of ``forward``, from cProfile over ``calls`` synchronised calls."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    for _ in range(calls):
        forward(model, ids)
    torch.cuda.synchronize()
    profiler.disable()
    times = {}
    for (path, line, name), (_, count, own, _, _) in pstats.Stats(profiler).stats.items():
        where = re.sub(r"^.*/(site-packages|hf_sparse|studies|benchmarks)/", r"\1/", path)
        times[f"{where}:{line}({name})"] = (count / calls, own / calls * 1e3)
    return times


def host_differences(times: dict[str, dict[str, tuple[float, float]]], rows: int, calls: int) -> str:
    """Each method's own host time per call against the first method's: the total, then the ``rows`` functions that
    add the most and the ``rows`` that save the most (calls per call before -> after; a swapped call, e.g. a copy for
    a concatenation, shows on both sides)."""
    first, *others = times
    lines = [f"host time by Python function (cProfile over {calls} calls, own time per call, ms; each method "
             f"against {first})"]
    for method in others:
        base, mine = times[first], times[method]
        total = sum(own for _, own in mine.values()) - sum(own for _, own in base.values())
        lines.append(f"{method}: {sum(own for _, own in mine.values()):.2f} against {first}'s "
                     f"{sum(own for _, own in base.values()):.2f} ({total:+.2f})")
        gains = sorted(((mine.get(key, (0, 0))[1] - base.get(key, (0, 0))[1], key) for key in set(base) | set(mine)),
                       reverse=True)
        for heading, part in (("adds", gains[:rows]), ("saves", sorted(gains[-rows:])[:rows])):
            lines.append(f" {heading}:")
            for gain, key in part:
                if (gain > 0) == (heading == "adds") and gain:
                    lines.append(f"  {gain:+7.3f}  {base.get(key, (0, 0))[0]:6.0f} -> {mine.get(key, (0, 0))[0]:6.0f} "
                                 f"calls  {key[-90:]}")
    return "\n".join(lines)


@torch.no_grad()
def prefill(args, loaded) -> None:
    from torch.profiler import ProfilerActivity, profile

    model, ids = loaded.model, loaded.prompt(args.length)
    layers = model.config.num_hidden_layers
    forward = first_token if args.generate else globals()["forward"]
    methods = list(dict.fromkeys(args.methods))
    for method in methods:  # warm-up: kernel compilation
        use_method(model, method)
        forward(model, ids)

    def timed(method: str) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        forward(model, ids)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    # Every timed call before any profiling, the methods taking turns in balanced rounds: a method's profiling
    # (torch.profiler, the sync check, cProfile) slowed the host's later calls (timed one method after another, the
    # first ran at 26 ms and the later ones at 34-51 ms; generate(), 2K tokens, H100).
    walls = interleaved(model, methods, args.repeats, timed)
    rows, details = [], []
    for method in methods:
        use_method(model, method)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            forward(model, ids)
            torch.cuda.synchronize()
        sites = sync_sites(model, ids, forward)
        hot = host_profile(model, ids, forward, args.cprofile) if args.cprofile else ""
        row = {"method": method, "wall_ms": statistics.median(walls[method]), "syncs": sum(sites.values())}
        row["gpu_ms"] = timeline(gpu_intervals(prof))["busy_us"] / 1e3
        rows.append(row)
        details.append((method, kernel_table(prof, 1, args.rows), sites, hot))
        progress(json.dumps(row))
    what = "generate(max_new_tokens=1)" if args.generate else "one forward"
    print(f"\n{header(environment())}\n{loaded.description}; {what} of {args.length} tokens, all-ones 2D mask; "
          f"wall = median of {args.repeats} balanced rounds, GPU busy = union of its kernels (torch.profiler)")
    print(table([("method", lambda r: r["method"]), ("wall ms", lambda r: f"{r['wall_ms']:.1f}"),
                 ("GPU busy ms", lambda r: f"{r['gpu_ms']:.1f}"),
                 ("host-bound gap ms", lambda r: f"{r['wall_ms'] - r['gpu_ms']:.1f}"),
                 ("per layer", lambda r: f"{(r['wall_ms'] - r['gpu_ms']) / layers:.2f}"),
                 ("syncs per forward", lambda r: str(r["syncs"]))], rows))
    if args.host_diff:
        times = {}
        for method in methods:
            use_method(model, method)
            times[method] = own_times(model, ids, forward, args.host_diff)
        print("\n" + host_differences(times, args.rows, args.host_diff))
    for method, kernels, sites, hot in details:
        print(f"\n{method}: GPU time by kernel, one forward\n{kernels}")
        print(f"{method}: synchronising calls by call site")
        for site, count in sites.most_common(args.rows):
            print(f"  {count:>4}  {site}")
        if hot:
            print(f"{method}: host time of one call by Python function (cProfile; own time, then cumulative)\n{hot}")


# -- memory ---------------------------------------------------------------------------------------------------


def _site(frames: list[dict]) -> str:
    """The innermost hf_sparse or transformers frame of an allocation's stack (else torch's, else any), as
    ``file:line name``; hf_sparse's wrappers of a whole forward (graphs.py, integration.py) count as transformers'
    callers, so a model's own activations are named by its modeling line."""
    def ours(name: str) -> bool:
        return "/hf_sparse/" in name and not name.endswith(("graphs.py", "integration.py"))

    for test in (lambda n: ours(n) or "/transformers/" in n, lambda n: "/hf_sparse/" in n,
                 lambda n: "/torch/" in n, lambda n: True):
        for frame in frames:
            if test(frame.get("filename", "")):
                return f"{frame['filename'].split('/')[-1]}:{frame.get('line')} {frame.get('name')}"
    return "?"


def replay(events: list[dict]) -> tuple[dict, int, dict]:
    """Replay a memory trace: (allocations live at its end, the peak of live bytes, the allocations live then),
    each allocation ``addr: (bytes, site)``; allocations made before the recording are not in it."""
    live, total, peak, at_peak = {}, 0, -1, {}
    for event in events:
        action, addr = event["action"], event["addr"]
        if action == "alloc":
            live[addr] = (event["size"], _site(event.get("frames", [])))
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action == "free_completed" and addr in live:
            total -= live.pop(addr)[0]
    return live, peak, at_peak


def by_site(allocations: dict) -> collections.Counter:
    sites = collections.Counter()
    for size, site in allocations.values():
        sites[site] += size
    return sites


@torch.no_grad()
def memory(args, loaded) -> None:
    from hf_sparse import graphs

    model, ids = loaded.model, loaded.prompt(args.length)
    rows, details = [], []
    for method in args.methods:
        graphs.release(model)
        gc.collect()
        torch.cuda.empty_cache()
        use_method(model, method)
        extra = {"cache_implementation": "static"} if method == "sdpa-static" else {}

        def call(tokens: int) -> None:
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                           do_sample=False, pad_token_id=0, **extra)
            gc.collect()
            torch.cuda.synchronize()

        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=500000)
        try:
            call(args.new_tokens)  # the first call: kernel compilation, graph captures, the caches it keeps
            row = {"method": method, "peak_first": torch.cuda.max_memory_allocated(),
                   "held": torch.cuda.memory_allocated()}
            torch.cuda.reset_peak_memory_stats()
            call(args.new_tokens)
            row["peak_later"] = torch.cuda.max_memory_allocated()
            snapshot = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        live, _, at_peak = replay(snapshot["device_traces"][torch.cuda.current_device()])
        rows.append(row)
        details.append((method, base, by_site(live), by_site(at_peak)))
        progress(json.dumps(row))
    mib = lambda value: f"{value / 2**20:.1f}"
    sdpa = next((r for r in rows if r["method"] == "sdpa"), rows[0])
    print(f"\n{header(environment())}\n{loaded.description}; generate(max_new_tokens={args.new_tokens}) of "
          f"{args.length} prompt tokens, twice; MiB (max_memory_allocated); held = memory_allocated after the first "
          f"call (weights, kept caches and graphs)")
    print(table([("method", lambda r: r["method"]), ("peak, first call", lambda r: mib(r["peak_first"])),
                 ("peak, later call", lambda r: mib(r["peak_later"])),
                 ("later vs sdpa", lambda r: speedup(r["peak_later"] / sdpa["peak_later"])),
                 ("held between calls", lambda r: mib(r["held"]))], rows))
    for method, base, held, peak in details:
        print(f"\n{method}: held after the calls beyond the {mib(base)} MiB before them, MiB, by allocation site")
        for site, size in held.most_common(args.rows):
            print(f"  {mib(size):>8}  {site}")
        print(f"{method}: live at the highest point of both calls beyond those {mib(base)} MiB, MiB, by site")
        for site, size in peak.most_common(args.rows):
            print(f"  {mib(size):>8}  {site}")


# -- decode ---------------------------------------------------------------------------------------------------


class Decoder:
    """Greedy decode steps of ``model`` over ``cache`` after a prefill of ``ids``."""

    def __init__(self, model, cache, ids: torch.Tensor) -> None:
        self.model, self.cache_args = model, {cache_kwarg(model): cache}
        start = time.perf_counter()
        logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **self.cache_args).logits
        self.token = logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        self.prefill_s = time.perf_counter() - start
        self.position = torch.full((1, 1), ids.shape[1], device=ids.device)

    def step(self) -> None:
        logits = self.model(input_ids=self.token, position_ids=self.position, use_cache=True, logits_to_keep=1,
                            **self.cache_args).logits
        self.token = logits[:, -1:].argmax(-1)
        self.position = self.position + 1


def weight_bytes(model) -> int:
    """Bytes of the weights a batch-1 decode step reads: all but the input embedding, of which it reads one row
    (unless the LM head shares it)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    if head is None or head.weight.data_ptr() != embedding.data_ptr():
        total -= embedding.numel() * embedding.element_size()
    return total


def step_bytes(model, cache, decoder: Decoder) -> dict:
    """Bytes one decode step reads from HBM, from one recorded (eager) step: the K/V of the attended blocks of
    the sparse layers (a block counted once per selection row: per KV head), every token's K/V in the dense
    layers, the block summaries (float32) of the sparse layers, and the weights."""
    from hf_sparse import record_sparsity

    config = model.config
    kv_heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layer_token_bytes = cache.memory_per_token() / len(cache.layers)  # K and V (and int8 scales) of one layer
    with record_sparsity() as recorder:
        decoder.step()
    length = cache.get_seq_length()
    counts = {"kv": 0.0, "dense_kv": 0.0, "summaries": 0.0, "sparse_layers": 0, "dense_layers": 0}
    for record in (r for r in recorder.records if r.phase == "decode"):
        if record.dense_reason is None:
            counts["sparse_layers"] += 1
            counts["kv"] += float(record.attended_blocks) * cache.block_size * layer_token_bytes / kv_heads
            counts["summaries"] += -(-length // cache.block_size) * kv_heads * head_dim * 4
        else:
            counts["dense_layers"] += 1
            counts["dense_kv"] += length * layer_token_bytes
    counts["weights"] = weight_bytes(model)
    counts["density"] = recorder.density("decode")
    return counts


@torch.no_grad()
def decode(args, loaded) -> None:
    from torch.profiler import ProfilerActivity, profile

    from hf_sparse import SparseCache, graphs

    model, ids = loaded.model, loaded.prompt(args.length)
    rows, details = [], []
    for method in args.methods:
        config = use_method(model, method + ("-eager" if args.eager else ""))
        cache = SparseCache(model.config, max_cache_len=args.length + 2 * args.steps + 8)
        if config.decode_cuda_graph:
            graphs.install(model)
        decoder = Decoder(model, cache, ids)
        counts = step_bytes(model, cache, decoder)
        for _ in range(args.steps):  # warm-up: kernel compilation; graph: warm step, capture, replays
            decoder.step()
        torch.cuda.synchronize()
        replays = graph_counts(model)[1]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                decoder.step()
            torch.cuda.synchronize()
        replays = graph_counts(model)[1] - replays
        stats = graphs.stats(model)
        graphs.uninstall(model)
        if not config.decode_cuda_graph:
            state = "off (--eager)"
        elif stats is not None and stats.disabled_reason:
            state = f"off: {stats.disabled_reason}"
        else:
            state = f"{replays} of {args.steps} steps replayed"
        line = timeline(gpu_intervals(prof))
        row = {"method": method, **counts, **{key: value / args.steps for key, value in line.items()}}
        kv_bytes = counts["kv"] + counts["dense_kv"]
        row["kv_floor_us"] = kv_bytes / args.bandwidth * 1e6
        row["floor_us"] = (kv_bytes + counts["summaries"] + counts["weights"]) / args.bandwidth * 1e6
        row["graph"] = state
        rows.append(row)
        details.append((method, kernel_table(prof, args.steps, args.rows)))
        progress(json.dumps(row))
        del cache, decoder, prof
        gc.collect()
        torch.cuda.empty_cache()
    mode = "launched from Python (--eager)" if args.eager else "replayed from a CUDA graph"
    print(f"\n{header(environment())}\n{loaded.description}; static SparseCache, {args.length} tokens prefilled, "
          f"{args.steps} profiled decode steps {mode}; per step. Floors: bytes / {args.bandwidth:.3g} B/s")
    gb = 1e9
    print(table([("method", lambda r: r["method"]), ("graph", lambda r: r["graph"]),
                 ("decode density", lambda r: f"{r['density']:.3f}"),
                 ("sparse / dense layers", lambda r: f"{r['sparse_layers']} / {r['dense_layers']}"),
                 ("kernels", lambda r: f"{r['launches']:.0f}"), ("GPU busy us", lambda r: f"{r['busy_us']:.0f}"),
                 ("idle between kernels us", lambda r: f"{r['idle_us']:.0f}"),
                 ("span us", lambda r: f"{r['span_us']:.0f}"),
                 ("K/V GB (sparse + dense)", lambda r: f"{r['kv'] / gb:.3f} + {r['dense_kv'] / gb:.3f}"),
                 ("summaries GB", lambda r: f"{r['summaries'] / gb:.3f}"),
                 ("weights GB", lambda r: f"{r['weights'] / gb:.3f}"),
                 ("K/V floor us", lambda r: f"{r['kv_floor_us']:.0f}"),
                 ("all-bytes floor us", lambda r: f"{r['floor_us']:.0f}"),
                 ("span / floor", lambda r: f"{r['span_us'] / r['floor_us']:.2f}")], rows))
    for method, kernels in details:
        print(f"\n{method}: GPU time by kernel, per step\n{kernels}")


# -- graph ----------------------------------------------------------------------------------------------------


@torch.no_grad()
def graph(args, loaded) -> None:
    from transformers import DynamicCache

    from hf_sparse import SparseCache, graphs

    model, ids = loaded.model, loaded.prompt(args.length)
    results = collections.defaultdict(list)
    for _ in range(args.rounds):
        for name in args.variants:
            gc.collect()  # the previous variant's cache and graph sit in reference cycles
            torch.cuda.empty_cache()
            config = use_method(model, name)
            if config is None:
                cache = DynamicCache(config=model.config)
            elif config.decode_cuda_graph:
                cache = SparseCache(model.config, max_cache_len=args.length + args.steps + 1)
                graphs.install(model)
            else:
                cache = SparseCache(model.config)
            before = graph_counts(model)
            decoder = Decoder(model, cache, ids)
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                decoder.step()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - start) * 1e3)
            after = graph_counts(model)
            graphs.uninstall(model)
            row = {"prefill_s": decoder.prefill_s, "step1_ms": times[0], "step2_ms": times[1],
                   "step_ms": statistics.median(times[2:]), "captures": after[0] - before[0],
                   "replays": after[1] - before[1]}
            results[name].append(row)
            progress(f"{name}: {json.dumps(row)}")
            del cache, decoder
    rows = [{"variant": name, **{key: statistics.median(r[key] for r in runs) for key in runs[0]}}
            for name, runs in results.items()]
    sdpa = next((row["step_ms"] for row in rows if row["variant"] == "sdpa"), None)
    print(f"\n{header(environment())}\n{loaded.description}; context {args.length}, {args.steps} steps, batch 1; "
          f"medians over {args.rounds} rounds; step = median of steps 3..{args.steps} (wall, synchronised)")
    print(table([("variant", lambda r: r["variant"]), ("prefill s", lambda r: f"{r['prefill_s']:.3f}"),
                 ("step 1 ms", lambda r: f"{r['step1_ms']:.1f}"), ("step 2 ms", lambda r: f"{r['step2_ms']:.1f}"),
                 ("step ms", lambda r: f"{r['step_ms']:.2f}"), ("captures", lambda r: f"{r['captures']:g}"),
                 ("replays", lambda r: f"{r['replays']:g}"),
                 ("sdpa / this", lambda r: speedup(sdpa / r["step_ms"] if sdpa else None))], rows))


# -- layers ------------------------------------------------------------------------------------------------------


def layers(args, loaded) -> None:
    from hf_sparse import attention_probe, kernels
    from hf_sparse.methods import METHODS
    from hf_sparse.selection import RowLayout

    from _common import best_sdpa, median_ms, sparse_config, write_json

    methods = {name: sparse_config(name) for name in args.methods}
    others = [name for name, config in methods.items() if config is None or config.method not in ("plas", "xattn")]
    if others:
        raise SystemExit(f"layers: --methods takes plas and xattn variants (their block selections), not {others}")
    ids = loaded.prompt(args.length)
    kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    with attention_probe(loaded.model, lambda module, q, k, v, mask: kept.append((q, k, v))), torch.no_grad():
        loaded.model(input_ids=ids, logits_to_keep=1)
    kv_start = RowLayout.uniform(1, "cuda")
    rows = []
    for layer, (query, key, value) in enumerate(kept):
        if args.only and layer not in args.only:
            continue
        dense_ms, backend = best_sdpa(query, key, value, causal=True)
        row = {"layer": layer, "dense_ms": dense_ms, "backend": backend}
        scale = query.shape[-1] ** -0.5
        for name, config in methods.items():
            method = METHODS[config.method](config)
            # PLAS scores blocks by their summaries; XAttention scores the keys themselves
            summaries = None
            if config.method == "plas":
                summaries = kernels.block_summaries(key, None, kv_start, config.block_size)

            def select(method=method, summaries=summaries):
                return method.select_prefill(query, summaries, key, scale=scale, q_offset=0, kv_start=kv_start)

            times = []
            for _ in range(args.repeats + 1):
                torch.cuda.synchronize()
                start = time.perf_counter()
                selection = select()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - start) * 1e3)
            select_ms = statistics.median(times[1:])
            attend_ms = median_ms(lambda chosen=selection: kernels.sparse_attention(
                query, key, value, chosen, scale=scale, q_offset=0, kv_start=kv_start), min_reps=5)
            tiles = selection.num_query_tiles
            density = float(selection.counts.float().mean()) / ((tiles + 1) / 2)
            row[name] = {"select_ms": select_ms, "attend_ms": attend_ms, "density": density,
                         "vs_dense": (select_ms + attend_ms) / dense_ms}
        rows.append(row)
        progress(json.dumps(row))
    print(header(environment()))
    print(f"{loaded.description}; one prefill of {args.length} tokens, each layer in isolation on its own queries, "
          "keys and values (kept from an sdpa forward); dense: the fastest SDPA backend (do_bench); select: wall "
          f"time, synchronised, median of {args.repeats}; attend: the sparse kernel (do_bench); density: attended / "
          "causal blocks")
    columns = [("layer", lambda r: str(r["layer"])), ("dense ms", lambda r: f"{r['dense_ms']:.2f}")]
    for name in methods:
        columns += [(f"{name} density", lambda r, n=name: f"{r[n]['density']:.3f}"),
                    ("select ms", lambda r, n=name: f"{r[n]['select_ms']:.2f}"),
                    ("attend ms", lambda r, n=name: f"{r[n]['attend_ms']:.2f}"),
                    ("total / dense", lambda r, n=name: f"{r[n]['vs_dense']:.2f}")]
    print(table(columns, rows))
    if rows:
        dense_ms = sum(r["dense_ms"] for r in rows)
        for name in methods:
            select_ms = sum(r[name]["select_ms"] for r in rows)
            attend_ms = sum(r[name]["attend_ms"] for r in rows)
            best = sum(min(r["dense_ms"], r[name]["select_ms"] + r[name]["attend_ms"]) for r in rows)
            print(f"{name}: every layer sparse {select_ms + attend_ms:.1f} ms (select {select_ms:.1f}, attend "
                  f"{attend_ms:.1f}) vs dense {dense_ms:.1f} ms; each layer its faster path: {best:.1f} ms")
    if args.json:
        write_json(args.json, {"environment": environment(), "model": loaded.description, "length": args.length,
                               "methods": args.methods, "rows": rows})


# -- main -------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{prefill,decode,layers,memory,graph}")


    sub = commands.add_parser("prefill", help="wall vs GPU time, GPU time by kernel and host syncs of one prefill",
                              description=command_help("prefill"))
    add_model_arguments(sub, default="smollm2-random")
    sub.add_argument("--length", type=int, default=32768, help="prompt tokens (default: %(default)s)")
    sub.add_argument("--repeats", type=int, default=5, help="timed forwards (default: %(default)s)")
    choices = ["sdpa"] + sparse_variants(("noprobe", "int8"))
    sub.add_argument("--methods", nargs="+", default=["sdpa", "plas", "plas-noprobe"], type=method_name,
                     metavar="METHOD", help=f"{', '.join(choices)}; -int8: an int8 K/V cache (default: %(default)s)")
    sub.add_argument("--rows", type=int, default=12, help="kernels and call sites listed (default: %(default)s)")
    sub.add_argument("--generate", action="store_true",
                     help="time generate(max_new_tokens=1) (TTFT: the cache generate() makes, its hooks) instead of a "
                          "forward")
    sub.add_argument("--cprofile", type=int, default=0, metavar="ROWS",
                     help="also list the host's time of one call by Python function, ROWS rows (cProfile)")
    sub.add_argument("--host-diff", type=int, default=0, metavar="CALLS",
                     help="also each method's host time per Python function against the first method's, cProfile over "
                          "CALLS calls (--rows functions that add the most)")
    sub.set_defaults(run=prefill)

    sub = commands.add_parser("decode", help="GPU time by kernel, launch gaps and the bandwidth floor of a decode step",
                              description=command_help("decode"))
    add_model_arguments(sub, default="llama3-8b-random", layers=8)
    sub.add_argument("--length", type=int, default=32768, help="tokens prefilled (default: %(default)s)")
    sub.add_argument("--steps", type=int, default=8, help="decode steps profiled (default: %(default)s)")
    choices = sparse_variants(("int8",))
    sub.add_argument("--methods", nargs="+", default=["plas", "xattn"], choices=choices, metavar="METHOD",
                     help=f"{', '.join(choices)}; -int8: an int8 K/V cache (default: %(default)s)")
    sub.add_argument("--eager", action="store_true", help="launch the steps from Python instead of a CUDA graph")
    sub.add_argument("--bandwidth", type=float, default=3.35e12,
                     help="HBM bytes per second of the floor (default: %(default)g, H100 SXM; H200: 4.8e12)")
    sub.add_argument("--rows", type=int, default=25, help="kernels listed (default: %(default)s)")
    sub.set_defaults(run=decode)

    sub = commands.add_parser("layers", help="each prefill layer alone: dense vs selection + sparse attention",
                              description=command_help("layers"))
    add_model_arguments(sub, default="smollm2")
    sub.add_argument("--length", type=int, default=131072, help="prompt tokens (default: %(default)s)")
    sub.add_argument("--methods", nargs="+", default=["plas", "xattn"], type=method_name, metavar="METHOD",
                     help="plas, xattn and their variants, e.g. xattn-stride=16 (default: %(default)s)")
    sub.add_argument("--only", type=int, nargs="+", metavar="LAYER", help="only these layers (default: all)")
    sub.add_argument("--repeats", type=int, default=3, help="timed selections per layer (default: %(default)s)")
    sub.add_argument("--json", help="write every number to this file")
    sub.set_defaults(run=layers)

    sub = commands.add_parser("memory", help="peak memory of generate() and what is live at its peak",
                              description=command_help("memory"))
    add_model_arguments(sub, default="smollm2-random")
    sub.add_argument("--length", type=int, default=4096, help="prompt tokens (default: %(default)s)")
    sub.add_argument("--new-tokens", type=int, default=256, help="tokens generated (default: %(default)s)")
    sub.add_argument("--methods", nargs="+", default=["sdpa", "sdpa-static", "plas", "xattn"], type=method_name,
                     metavar="METHOD", help="sdpa, sdpa-static, plas, xattn and their variants (default: %(default)s)")
    sub.add_argument("--rows", type=int, default=12, help="allocation sites listed (default: %(default)s)")
    sub.set_defaults(run=memory)

    sub = commands.add_parser("graph", help="per-step wall time of decode, eager vs CUDA graph",
                              description=command_help("graph"))
    add_model_arguments(sub, default="llama3-8b-random")
    sub.add_argument("--length", type=int, default=32768, help="tokens prefilled (default: %(default)s)")
    sub.add_argument("--steps", type=int, default=32, help="decode steps timed (default: %(default)s)")
    sub.add_argument("--rounds", type=int, default=2, help="rounds of every variant (default: %(default)s)")
    choices = ["sdpa"] + [name for name in sparse_variants(("eager", "graph", "int8"))
                          if ("eager" in name) != ("graph" in name)]
    sub.add_argument("--variants", nargs="+", default=["sdpa", "plas-eager", "plas-graph"], choices=choices,
                     metavar="VARIANT", help=f"{', '.join(choices)} (default: %(default)s)")
    sub.set_defaults(run=graph)

    args = parser.parse_args()
    if args.command == "graph" and args.steps < 3:
        parser.error("graph: --steps must be at least 3 (steps 1 and 2 are warm-up and capture)")
    require_cuda("profile_model.py")
    args.run(args, load_model(args))


if __name__ == "__main__":
    main()
