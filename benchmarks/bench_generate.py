"""End-to-end generate(): time to first token (TTFT), time per output token (TPOT), peak memory, density and
(with --fidelity) next-token fidelity of hf_sparse's methods beside dense sdpa; one row per length and method.

Measured per prompt length and method, greedy, batch 1 (--batch), medians of --repeats timed calls, each after one
untimed first call of that method at that length (3 new tokens; sdpa-static: the most the timed calls take). The first
call makes the static cache and captures the CUDA graphs that later calls reuse, and compiles what no earlier call of
the process compiled (Triton kernels; hf_sparse's compiled decode step, decode_compile, which the sparse methods share;
sdpa-static's torch.compile'd step; at a later length, what specialises on it), as a user's first call in a fresh
process does. Its time is left out, its peak memory reported ("first call" below). Per row:
* TTFT: wall time of generate(max_new_tokens=1), median of --ttft-rounds rounds in which each method runs once,
  in turn (a Williams design: each method at each position and right after each other method equally often),
  after all are warm: the host's speed drifts by tens of percent over a minute (a short prompt's prefill is bound
  by the host's launches), and interleaving lets that drift hit every method alike. Its ratio is a speed-up
  against "sdpa": the median over the rounds of sdpa's TTFT / this method's in the same round.
* TPOT@N: median over pairs of (wall time of generate(max_new_tokens=N) - that of generate(max_new_tokens=1) run just
  before it) / (N - 1), for each N of --tpot-tokens (N < 64 takes 64 / N times --repeats pairs: the noise of one
  TTFT is a larger part of few tokens). So it includes each call's first decode step and whatever a call pays once
  (a CUDA-graph capture): TPOT@16 within a few percent of TPOT@256 says a call pays little of that. Its ratio is a
  speed-up against "sdpa-static" at the largest N: transformers' cache_implementation="static", with which
  generate() compiles the decode step, the fastest dense decode a transformers user has.
* steps@16 / @256: the same calls' decode steps on the GPU's timeline (CUDA events where each forward's logits
  reach the token choice, from the prefill's to the last step's), 16 against 256: a call's fixed cost after its
  prefill without the noise of the TTFT that TPOT@N subtracts.
* captures / call: hf_sparse CUDA-graph captures per timed generate() call (hf_sparse.graphs.stats); 0 when a
  call replays the graph an earlier call captured.
* first call / peak: torch.cuda.max_memory_allocated (weights included) over the first call (reset just before it,
  after what every earlier method and length kept is released, hf_sparse.graphs.release, and the allocator's cache
  emptied: the memory that call needs) and, reset again, over the timed calls after it (the steady state); each with
  its ratio to sdpa's, measured the same way. Off CUDA neither is measured ("-").
* density: attended / causal key blocks of the sparse prefill layers and of the decode steps, from one more,
  untimed generate(max_new_tokens=8) under hf_sparse.record_sparsity() (--no-density skips it); 1.000 = every
  layer ran dense.
* --fidelity: next-token KL(sdpa || method) and top-1 agreement over the prompt's last 256 positions, and KL at
  the last one (hf_sparse.tools.eval.fidelity).
* "tokens = sdpa('s)": the leading new tokens (of the largest N) equal to sdpa's, or, marked "(static)", to
  sdpa-static's where sdpa ran for TTFT only (transformers' compiled step rounds otherwise than eager decode: its
  greedy tokens can leave eager sdpa's).

Methods (--methods): "sdpa" (dynamic cache, eager decode); "sdpa-static" (above); "plas", "xattn", "star" (their
configs' defaults: decode steps replayed from a CUDA graph over a static SparseCache); "-eager" (decode_cuda_graph=False),
"-int8" (int8 K/V cache; plas and xattn) and "-FIELD=VALUE" (a config field) variants of those, e.g. "plas-eager",
"xattn-int8", "plas-query_union=64", "plas-prefill_top_k=[40:48]", "star-block_size=8192". Each method starts without what an earlier
one kept (hf_sparse.graphs.release): the static cache and graphs a method keeps between its own calls count in
its peak. --batch N repeats the prompt N times (peak memory and TPOT of a batch).

Models (--model): "llama3-8b-random" (default; Llama-3-8B shape, random weights, uniform random token ids, or
--segment-vocab N ids per 2048-token segment), "smollm2-random", and "smollm2": the trained SmolLM2-135M-Instruct
(hf_sparse.tools.default_model, or --gguf FILE) on the standard library's source text (hf_sparse.tools.eval.stdlib_text);
with --long-context its long-context version (load_default_model(long_context=True): YaRN and the shipped adapter),
the model bench_quality.py --long-context judges the defaults on.
Random weights give i.i.d.-like queries and keys: selections are nearly dense there and such a run measures
overhead, not a speed-up.

Several GPUs (--parallel): "device-map" splits the layers evenly over the visible GPUs (accelerate's dispatch_model,
as from_pretrained(device_map=...) does); "tp" runs under torchrun, one process per GPU, the model loaded with
from_pretrained(tp_plan="auto") (a random-weight model is saved to --checkpoint once), every rank timing the same
calls and rank 0 reporting. Peak memory is then the fullest GPU's; steps@N are not measured across devices.
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --nproc-per-node 2 benchmarks/bench_generate.py \
        --parallel tp --lengths 32768 131072

Output: the table on stdout, its header holding the device, the torch / triton / transformers versions and the
date; --json FILE every number (written atomically); --plot FILE.png the speed-ups: TTFT vs sdpa and TPOT vs
sdpa-static against the prompt length (needs matplotlib).

Commands (on a GPU):
    python benchmarks/bench_generate.py --model smollm2 --plot docs/speedup.png --json smollm2.json
    python benchmarks/bench_generate.py --lengths 32768 131072 --tpot-tokens 128 --repeats 2
A full --model smollm2 run (6 lengths x 4 methods, TPOT over 16 and 256 tokens, 3 repeats) takes minutes per
length, most of it eager sdpa's 256-token calls: split it with --lengths where one command's time is limited.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from _common import (add_model_arguments, add_parallel_arguments, cell, environment, graph_counts, header,
                     interleaved, load_model, method_name, progress, rank, require_cuda, save_figure, speedup,
                     start_parallel, table, use_method, write_json)
from hf_sparse import graphs, record_sparsity
from hf_sparse.tools.eval import fidelity

METHODS = ["sdpa", "sdpa-static"] + [f"{name}{option}" for name in ("plas", "xattn")
                                     for option in ("", "-eager", "-int8", "-eager-int8")] + ["star", "star-eager"]
DEFAULT_LENGTHS = {"smollm2": [4096, 8192, 16384, 32768, 65536, 131072]}


class StepClock(LogitsProcessor):
    """A CUDA event recorded where each forward's logits reach generate()'s token choice (no host wait): the
    decode steps' time on the GPU's timeline, idle gaps included, apart from the prefill's."""

    def __init__(self) -> None:
        self.events: list[torch.cuda.Event] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append(event)
        return scores

    def step_ms(self) -> float:
        """Mean time from the prefill's logits to the last step's (after a synchronize)."""
        return self.events[0].elapsed_time(self.events[-1]) / (len(self.events) - 1)


#: The CUDA devices the model's weights sit on (set by main(); several where its layers are split over GPUs).
MODEL_GPUS: list[int] = []


def _gpus(device: torch.device) -> list[int]:
    """The CUDA devices a run with inputs on ``device`` synchronises and measures: the model's."""
    return (MODEL_GPUS or [device.index if device.index is not None else torch.cuda.current_device()]
            if device.type == "cuda" else [])


def synchronize(device: torch.device) -> None:
    for index in _gpus(device):
        torch.cuda.synchronize(index)


def reset_peak(device: torch.device) -> None:
    """Start a peak-memory measurement on the GPUs (CUDA's allocator statistics; none elsewhere)."""
    for index in _gpus(device):
        torch.cuda.reset_peak_memory_stats(index)


def peak_gib(device: torch.device) -> float | None:
    """The most memory allocated on one GPU since :func:`reset_peak` (the fullest one where the model spans
    several), weights included, in GiB; None off CUDA."""
    gpus = _gpus(device)
    return max(torch.cuda.max_memory_allocated(index) for index in gpus) / 2**30 if gpus else None


def timed_generate(model, ids: torch.Tensor, new_tokens: int, clock: StepClock | None = None,
                   **kwargs) -> tuple[float, torch.Tensor]:
    """(seconds, the new token ids) of one greedy generate() of exactly ``new_tokens`` tokens; ``clock`` records
    its steps."""
    # The caches of earlier calls can sit in reference cycles: free them first, or 128K runs run out of memory.
    # (The allocator keeps its cached blocks, as it does between a user's calls.)
    gc.collect()
    if clock is not None:
        kwargs["logits_processor"] = LogitsProcessorList([clock])
    synchronize(ids.device)
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs)
    synchronize(ids.device)
    return time.perf_counter() - start, out[0, ids.shape[1]:]


@torch.no_grad()
def measure(model, ids: torch.Tensor, method: str, tpot_tokens: list[int], repeats: int) -> dict:
    """TTFT, TPOT@N (none when ``tpot_tokens`` is empty), graph captures per call and peak memory of ``method`` on
    ``ids`` (over its first call and over the timed calls); the last call's tokens."""
    # The first call starts from nothing that another method or length kept (a static cache, graphs).
    graphs.release(model)
    gc.collect()
    if ids.is_cuda:
        torch.cuda.empty_cache()
    config = use_method(model, method)
    extra = {"cache_implementation": "static"} if method == "sdpa-static" else {}
    # The first call at this length (kernels specialise on it), untimed: 3 new tokens reach a CUDA-graph replay;
    # sdpa-static compiles its step for its static cache's size, so it starts with the most tokens the timed calls take.
    reset_peak(ids.device)
    timed_generate(model, ids, max(tpot_tokens, default=3) if method == "sdpa-static" else 3, **extra)
    first_peak_gib = peak_gib(ids.device)
    reset_peak(ids.device)
    row = {"length": ids.shape[1], "method": method, "config": config.to_dict() if config is not None else None}
    row["ttft_s"] = statistics.median(timed_generate(model, ids, 1, **extra)[0] for _ in range(repeats))
    row["tpot_ms"], row["step_ms"], row["captures_per_call"], row["replays_per_call"] = {}, {}, {}, {}
    tokens = None
    for new_tokens in tpot_tokens:
        decode_s, step_ms, captures, replays = [], [], [], []
        for _ in range(repeats * max(1, 64 // new_tokens)):
            first_s = timed_generate(model, ids, 1, **extra)[0]
            before = graph_counts(model)
            clock = StepClock() if ids.is_cuda and len(MODEL_GPUS) <= 1 else None  # events time one stream
            elapsed, tokens = timed_generate(model, ids, new_tokens, clock=clock, **extra)
            after = graph_counts(model)
            decode_s.append(elapsed - first_s)
            if clock is not None:
                step_ms.append(clock.step_ms())
            captures.append(after[0] - before[0])
            replays.append(after[1] - before[1])
        row["tpot_ms"][new_tokens] = statistics.median(decode_s) / (new_tokens - 1) * 1e3
        if step_ms:
            row["step_ms"][new_tokens] = statistics.median(step_ms)
        row["captures_per_call"][new_tokens] = statistics.mean(captures)
        row["replays_per_call"][new_tokens] = statistics.mean(replays)
    row["first_peak_gib"], row["peak_gib"] = first_peak_gib, peak_gib(ids.device)
    row["tokens"] = tokens.tolist() if tokens is not None else []
    stats = graphs.stats(model)
    if stats is not None and stats.disabled_reason:
        row["graphs_disabled"] = stats.disabled_reason
    return row


@torch.no_grad()
def interleaved_ttft(model, ids: torch.Tensor, methods: list[str], rounds: int) -> dict[str, list[float]]:
    """TTFT of each method in each of ``rounds`` balanced rounds (:func:`_common.interleaved`) of one
    generate(max_new_tokens=1) per method."""

    def first_token(method: str) -> float:
        extra = {"cache_implementation": "static"} if method == "sdpa-static" else {}
        return timed_generate(model, ids, 1, **extra)[0]

    return interleaved(model, methods, rounds, first_token)


@torch.no_grad()
def densities(model, ids: torch.Tensor, method: str) -> tuple[float, float]:
    """(prefill, decode) density of ``method`` over one untimed generate() of 8 tokens."""
    graphs.release(model)
    use_method(model, method)
    with record_sparsity() as recorder:
        timed_generate(model, ids, 8)
    if method.startswith("star"):  # its context encoding, then global attention
        return recorder.density("context"), recorder.density("query")
    return recorder.density("prefill"), recorder.density("decode")


def add_ratios(rows: list[dict], tpot_tokens: list[int]) -> None:
    """TTFT and both peaks against sdpa, TPOT (largest N) against sdpa-static, leading tokens equal to sdpa's."""
    largest = max(tpot_tokens, default=0)
    base = {row["method"]: row for row in rows}
    sdpa, static = base.get("sdpa"), base.get("sdpa-static")
    for row in rows:
        rounds = list(zip(sdpa.get("ttft_rounds_s", []), row.get("ttft_rounds_s", []))) if sdpa else []
        if rounds:  # the median of the rounds' ratios: each round's calls ran close together
            row["ttft_vs_sdpa"] = statistics.median(base_s / own_s for base_s, own_s in rounds)
        else:
            row["ttft_vs_sdpa"] = sdpa["ttft_s"] / row["ttft_s"] if sdpa else None
        for peak in ("first_peak", "peak"):  # none where one is not measured (off CUDA; older files: first_peak)
            own, base_gib = row.get(f"{peak}_gib"), sdpa.get(f"{peak}_gib") if sdpa else None
            row[f"{peak}_vs_sdpa"] = own / base_gib if own is not None and base_gib else None
        tpot, static_tpot = row["tpot_ms"].get(largest), static["tpot_ms"].get(largest) if static else None
        row["tpot_vs_sdpa_static"] = static_tpot / tpot if static_tpot and tpot else None
        # sdpa's tokens; sdpa-static's where sdpa was timed for TTFT only (its compiled step rounds otherwise:
        # its greedy tokens may leave eager sdpa's), and the row says which
        reference = sdpa if sdpa and sdpa["tokens"] else static if static and static["tokens"] else None
        if reference is not None:
            differs = [a != b for a, b in zip(row["tokens"], reference["tokens"])] + [True]
            row["same_tokens_as_sdpa"] = differs.index(True)
            row["same_tokens_reference"] = reference["method"]


def print_table(rows: list[dict], tpot_tokens: list[int], env: dict, described: str, repeats: int) -> None:
    largest, smallest = max(tpot_tokens, default=0), min(tpot_tokens, default=0)
    print(f"\n{header(env)}\n{described}; greedy, medians of {repeats}. TTFT vs sdpa; TPOT vs sdpa-static "
          f"(at {largest} new tokens); first call / peak = max_memory_allocated (weights included) over a method's "
          f"first call at that length / over its timed calls, vs sdpa's")
    columns = [("length", lambda r: str(r["length"])), ("method", lambda r: r["method"]),
               ("TTFT s", lambda r: f"{r['ttft_s']:.3f}"), ("vs sdpa", lambda r: speedup(r["ttft_vs_sdpa"]))]
    columns += [(f"TPOT@{n} ms", lambda r, n=n: cell(r["tpot_ms"].get(n), ".2f")) for n in tpot_tokens]
    if len(tpot_tokens) > 1:
        for name, field in (("TPOT", "tpot_ms"), ("steps", "step_ms")):
            columns.append((f"{name}@{smallest} / @{largest}",
                            lambda r, f=field: cell(r[f][smallest] / r[f][largest]
                                                    if smallest in r.get(f, {}) and largest in r.get(f, {}) else None,
                                                    ".2f")))
    columns += [("vs sdpa-static", lambda r: speedup(r["tpot_vs_sdpa_static"])),
                ("captures / call", lambda r: " ".join(f"{r['captures_per_call'][n]:g}" for n in tpot_tokens
                                                       if n in r["captures_per_call"]) or "-"),
                ("first call GiB", lambda r: cell(r.get("first_peak_gib"))),
                ("vs sdpa", lambda r: speedup(r.get("first_peak_vs_sdpa"))),
                ("peak GiB", lambda r: cell(r.get("peak_gib"))), ("vs sdpa", lambda r: speedup(r["peak_vs_sdpa"])),
                ("density prefill", lambda r: cell(r.get("prefill_density"), ".3f")),
                ("decode", lambda r: cell(r.get("decode_density"), ".3f"))]
    if any("kl" in row for row in rows):
        columns += [("KL", lambda r: cell(r.get("kl"), ".4f")), ("KL last", lambda r: cell(r.get("kl_last"), ".4f")),
                    ("top-1", lambda r: cell(r.get("top1"), ".3f"))]
    columns.append(("tokens = sdpa('s)", lambda r: "-" if not r.get("tokens") or r["method"].startswith("sdpa")
                    else f"{cell(r.get('same_tokens_as_sdpa'), 'd')} of {len(r['tokens'])}"
                    + (" (static)" if r.get("same_tokens_reference") == "sdpa-static" else "")))
    print(table(columns, rows))
    for row in rows:
        if "graphs_disabled" in row:
            print(f"{row['length']} {row['method']}: CUDA graphs off: {row['graphs_disabled']}")


def plot(rows: list[dict], tpot_tokens: list[int], path: str, title: str) -> None:
    """Two panels against the prompt length (log2): TTFT speed-up vs sdpa, TPOT speed-up vs sdpa-static."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({row["length"] for row in rows})
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    panels = ((axes[0], "ttft_vs_sdpa", "sdpa", "TTFT speed-up vs sdpa"),
              (axes[1], "tpot_vs_sdpa_static", "sdpa-static", "TPOT speed-up vs sdpa-static"))
    colors = {method: f"C{i}" for i, method in enumerate(dict.fromkeys(row["method"] for row in rows))}
    for ax, key, baseline, label in panels:
        for method, color in colors.items():
            points = [(row["length"], row[key]) for row in rows if row["method"] == method and row.get(key)]
            if not method.startswith("sdpa") and points:  # sparse methods against the panel's dense baseline
                ax.plot(*zip(*points), marker="o", label=method, color=color)
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label=f"dense ({baseline}) = 1")
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths])
        ax.minorticks_off()
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    save_figure(figure, path, title, dpi=150)


#: The fields of a row that its TTFT measurement sets (see replot): the prefill's time and what the same run's prefill
#: selected (density) and gave (fidelity).
TTFT_FIELDS = ("ttft_s", "ttft_rounds_s", "prefill_density", "kl", "kl_last", "top1")


def replot(args: argparse.Namespace) -> None:
    """The table (and --plot) of the rows of earlier --json files, e.g. two calls' lengths together, of the methods
    in --methods (its default: sdpa, sdpa-static, plas, xattn; a file's option variants are left out). A (length,
    method) row in several files is merged: its TTFT, prefill density and fidelity from the last file that has them
    (e.g. a run of more interleaved rounds after a full run), every other field from the first; ratios are
    recomputed per length, a TTFT (TPOT) ratio only between rows whose TTFT (TPOT) comes from the same file; TPOT
    ratios at each length's largest number of new tokens (files may have measured different ones)."""
    import json

    runs = [json.load(open(path)) for path in args.replot]
    merged: dict[tuple, dict] = {}
    ttft_source: dict[tuple, int] = {}  # the file each row's TTFT comes from
    tpot_source: dict[tuple, int] = {}  # the file each row's TPOT comes from (the first that has one)
    for index, run in enumerate(runs):
        for row in run["rows"]:
            for key in ("tpot_ms", "step_ms", "captures_per_call", "replays_per_call"):  # JSON keys are strings
                row[key] = {int(n): value for n, value in row.get(key, {}).items()}
            if row["tpot_ms"]:
                tpot_source.setdefault((row["length"], row["method"]), index)
            kept = merged.setdefault((row["length"], row["method"]), {})
            for key, value in row.items():
                if value not in (None, {}, []) and (key in TTFT_FIELDS or kept.get(key) in (None, {}, [])):
                    kept[key] = value
            ttft_source[(row["length"], row["method"])] = index
            for key in ("tpot_ms", "step_ms", "captures_per_call", "replays_per_call", "tokens"):
                kept.setdefault(key, {} if key != "tokens" else [])
    rows = sorted((row for row in merged.values() if row["method"] in args.methods), key=lambda row: row["length"])
    tpot_tokens = sorted(set().union(*(row["tpot_ms"] for row in rows)))
    for length in dict.fromkeys(row["length"] for row in rows):  # TPOT ratios at each length's largest N
        group = [row for row in rows if row["length"] == length]
        add_ratios(group, sorted(set().union(*(row["tpot_ms"] for row in group))))
    for row in rows:  # a ratio holds only between the calls of one run
        key = (row["length"], row["method"])
        if ttft_source[key] != ttft_source.get((row["length"], "sdpa")):
            row["ttft_vs_sdpa"] = None
        if tpot_source.get(key) != tpot_source.get((row["length"], "sdpa-static")):
            row["tpot_vs_sdpa_static"] = None
    first = runs[0]
    environment = dict(first["environment"])
    dates = sorted({run["environment"]["date"] for run in runs})
    if len(dates) > 1:  # the runs' first and last dates
        environment["date"] = f"{dates[0]} to {dates[-1]}"
    print_table(rows, tpot_tokens, environment, first["model"], first["arguments"]["repeats"])
    if args.plot:
        plot(rows, tpot_tokens, args.plot, f"{first['model']}\n{header(environment)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, default="llama3-8b-random")
    add_parallel_arguments(parser)
    parser.add_argument("--lengths", type=int, nargs="+",
                        help="prompt lengths (default: 4096 .. 131072 for smollm2, else 32768 131072)")
    parser.add_argument("--methods", nargs="+", type=method_name, default=["sdpa", "sdpa-static", "plas", "xattn"],
                        metavar="METHOD", help=f"{', '.join(METHODS)}, or plas / xattn / star with -FIELD=VALUE options "
                                              "(default: %(default)s)")
    parser.add_argument("--tpot-tokens", "--new-tokens", type=int, nargs="+", default=[16, 256],
                        help="TPOT over each of these numbers of new tokens (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per number (default: %(default)s)")
    parser.add_argument("--ttft-rounds", type=int, default=5,
                        help="interleaved rounds of TTFT (0: TTFT from each method's own timed calls; default: "
                             "%(default)s)")
    parser.add_argument("--ttft-only", nargs="*", default=[], metavar="METHOD",
                        help="methods timed for TTFT and peak only (e.g. sdpa, whose eager decode is no baseline)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per call, each the same prompt (default: 1)")
    parser.add_argument("--segment-vocab", type=int, default=0,
                        help="random models: distinct token ids per 2048-token segment (0: uniform random ids)")
    parser.add_argument("--no-density", action="store_true", help="skip the untimed runs that record density")
    parser.add_argument("--fidelity", action="store_true", help="next-token KL / top-1 of each sparse method vs sdpa")
    parser.add_argument("--json", help="write every number to this file")
    parser.add_argument("--plot", help="write the speed-up plot to this PNG file (needs matplotlib)")
    parser.add_argument("--replot", nargs="+", metavar="JSON",
                        help="no run: print the table and write --plot from the --json files of earlier runs (their "
                             "rows together; no GPU needed)")
    args = parser.parse_args()
    if args.replot:
        replot(args)
        return
    if min(args.tpot_tokens) < 2:
        parser.error("--tpot-tokens: TPOT needs at least 2 new tokens")
    if args.segment_vocab and args.model == "smollm2":
        parser.error("--segment-vocab applies to the random models; smollm2 runs on real text")
    lengths = args.lengths = args.lengths or DEFAULT_LENGTHS.get(args.model, [32768, 131072])
    require_cuda("bench_generate.py")
    start_parallel(args)
    env = environment()
    loaded = load_model(args)
    model = loaded.model
    MODEL_GPUS[:] = sorted({parameter.device.index for parameter in model.parameters() if parameter.is_cuda})
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    described = loaded.description + (f", {args.segment_vocab} ids per 2048-token segment" if args.segment_vocab
                                      else "") + f", batch {args.batch}"
    rows = []
    for length in lengths:
        ids = loaded.prompt(length, args.segment_vocab).expand(args.batch, -1).contiguous()
        at_length = []
        for method in args.methods:
            tpot_tokens = [] if method in args.ttft_only else args.tpot_tokens
            at_length.append(measure(model, ids, method, tpot_tokens, args.repeats))
            at_length[-1]["batch"] = args.batch
            row = at_length[-1]
            sparse = row["config"] is not None
            if sparse and not args.no_density:
                row["prefill_density"], row["decode_density"] = densities(model, ids, method)
            if sparse and args.fidelity:
                report = fidelity(model, ids, use_method(model, method), last_n=256, with_recall=False)
                row["kl"], row["kl_last"], row["top1"] = report.kl, report.kl_last, report.top1_agreement
            if rank() == 0:
                progress(" ".join(f"{key}={value}" for key, value in row.items() if key not in ("tokens", "config")))
        if args.ttft_rounds:
            ttft = interleaved_ttft(model, ids, args.methods, args.ttft_rounds)
            for row in at_length:
                row["ttft_rounds_s"] = ttft[row["method"]]
                row["ttft_alone_s"], row["ttft_s"] = row["ttft_s"], statistics.median(ttft[row["method"]])
        add_ratios(at_length, args.tpot_tokens)
        rows += at_length
        if args.json and rank() == 0:  # after each length: a run cut short keeps the lengths it finished
            write_json(args.json, {"environment": env, "model": described,
                                   "arguments": {**vars(args), "lengths": lengths}, "rows": rows})
    if rank() != 0:
        return
    print_table(rows, args.tpot_tokens, env, described, args.repeats)
    if args.plot:
        plot(rows, args.tpot_tokens, args.plot, f"{described}\n{header(env)}")


if __name__ == "__main__":
    main()
