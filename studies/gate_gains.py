"""Trained PLAS gates against mean pooling on held-out prose: density / next-token KL curves and matched ratios.

For each gate file (its block size read from the file) and each ``--lengths`` L, ``--sequences`` disjoint windows
of ``hf_sparse.tools.eval.held_out_sequences`` (the standard library's prose; gate training reads only code). Per window:
dense sdpa logits over the last ``--last-n`` positions, then for mean pooling and for the file, at each
``--fractions`` f, one sparse prefill with ``PLASConfig(block_size=B, query_union=B, prefill_top_k=(k, ceil(1.25 k)),
k = max(2, round(f * L / B))``, every layer but the last sparse at any length and density). Prints per point the density
and next-token KL / top-1 (mean and standard deviation over the windows), then the matched comparisons: mean
pooling's KL at each trained point's density and its density at the trained point's KL (log-KL interpolated
linearly in density along mean pooling's curve of means). Writes JSON and a PNG (one panel per length and block).

``--scorers NAME:BLOCK[:R]...`` adds curves for other block scorers (``block_scorers.SCORERS``; the rest of the
selection is PLAS's, on the PyTorch path): ``oracle`` ranks each query's blocks by their true dense attention mass, the
best any scorer could do; ``fitted-low-rank:BLOCK:R`` by their largest logit in R key directions fitted on training
code. ``--gates`` may then be empty.

A study (results in docs/gates.md), not a tool. From the repository root (it imports block_scorers.py beside it
and benchmarks/_common.py):

    python studies/gate_gains.py --gates gates_b128 gates_b64 --lengths 8192 32768 --sequences 8 \\
        --json docs/runs/gate_gains.json --png docs/gate_gains.png
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

import hf_sparse
from hf_sparse.tools.default_model import load_default_model
from hf_sparse.tools.eval import held_out_sequences
from hf_sparse.gate_files import read_gate_file, resolve_gate_file
from hf_sparse.gates import gate_spec, set_gates

# benchmarks/_common.py: the helpers the benchmark scripts share (block_scorers.py is beside this file)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _common import environment, header, save_figure, table, write_json  # noqa: E402
from block_scorers import (SCORERS, LayerCursor, build_scorers, fit_key_bases, parse_spec,  # noqa: E402
                           scored_selection)


PLOT_TITLE = ("PLAS gates and block scorers vs mean pooling, SmolLM2-135M-Instruct{model} on held-out prose: mean "
              "over {sequences} windows per point (error bars: standard error)")


def plot_title(args) -> str:
    return PLOT_TITLE.format(sequences=args.sequences, model=" (long-context)" if args.long_context else "")


def sparse_logprobs(model, ids: torch.Tensor, config: hf_sparse.PLASConfig, last_n: int) -> tuple[torch.Tensor, float]:
    hf_sparse.configure(model, config)
    with torch.no_grad(), hf_sparse.record_sparsity() as recorder:
        logits = model(ids, logits_to_keep=last_n).logits.float()
    return torch.log_softmax(logits, -1)[0], recorder.density("prefill")


def interpolate(x: float, points: list[tuple[float, float]]) -> float | None:
    """``y`` at ``x`` on the polyline ``points`` (sorted by x), None outside it."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1 and x1 > x0:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


def matched(rows: list[dict]) -> list[dict]:
    """Per trained point: mean pooling's KL at its density and density at its KL (on the means' curve; the second
    reads it as a function of KL, which holds where mean pooling's KL falls with density, as in every run so far)."""
    out = []
    for (length, block) in dict.fromkeys((r["length"], r["block"]) for r in rows):
        group = [r for r in rows if r["length"] == length and r["block"] == block]
        mean_curve = sorted((r["density"], math.log(r["kl"])) for r in group if r["gates"] == "mean pooling")
        by_kl = sorted((math.log(r["kl"]), r["density"]) for r in group if r["gates"] == "mean pooling")
        for row in (r for r in group if r["gates"] != "mean pooling"):
            log_kl = interpolate(row["density"], mean_curve)
            density = interpolate(math.log(row["kl"]), by_kl)
            out.append({"length": length, "block": block, "gates": row["gates"], "fraction": row["fraction"],
                        "density": row["density"],
                        "kl": row["kl"], "mean_kl": None if log_kl is None else math.exp(log_kl),
                        "kl_ratio": None if log_kl is None else row["kl"] / math.exp(log_kl),
                        "mean_density": density, "density_ratio": None if density is None else row["density"] / density,
                        "top1": row["top1"]})
    return out


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["length"], r["block"]) for r in rows))
    columns = min(2, len(panels))
    lines = -(-len(panels) // columns)
    fig, axes = plt.subplots(lines, columns, figsize=(6.2 * columns, 4.2 * lines), squeeze=False)
    for ax, (length, block) in zip(axes.flat, panels):
        for gates in dict.fromkeys(r["gates"] for r in rows):
            points = sorted((r["density"], r["kl"], r["kl_std"] / math.sqrt(r["windows"])) for r in rows
                            if (r["length"], r["block"], r["gates"]) == (length, block, gates))
            if points:
                ax.errorbar([p[0] for p in points], [p[1] for p in points], yerr=[p[2] for p in points],
                            marker="o", ms=4, capsize=2, lw=2.2 if gates == "mean pooling" else 1.2,
                            color="black" if gates == "mean pooling" else None, label=gates)
        ax.set_yscale("log")
        ax.set_title(f"{length} tokens, block {block}", fontsize=10)
        ax.set_xlabel("prefill density (attended / causal blocks)")
        ax.set_ylabel("next-token KL vs dense")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    save_figure(fig, path, title, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gates", nargs="*", default=[], help="gate files or folders (one block size each)")
    parser.add_argument("--scorers", nargs="*", default=[], metavar="NAME:BLOCK[:R]",
                        help="also these block scorers: " + "; ".join(
                            f"{name}:BLOCK{':R' if sized else ''} ({what})" for name, (sized, what) in SCORERS.items()))
    parser.add_argument("--query-stride", type=int, default=1, metavar="S",
                        help="the scorers (not gate files) select for every S-th query only; each tile takes the "
                             "union of those and every query's forced blocks")
    parser.add_argument("--fit-windows", type=int, default=4,
                        help="windows of training code (of the longest --lengths) that fitted-low-rank is fitted on")
    parser.add_argument("--replot", nargs="+", metavar="JSON",
                        help="no run: the tables and --png of earlier runs' --json files (their rows together)")
    parser.add_argument("--long-context", action="store_true",
                        help="the long-context default model (load_default_model(long_context=True): YaRN and the "
                             "shipped adapter), the one that attends past 8K")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.03, 0.05, 0.08, 0.12, 0.18])
    parser.add_argument("--last-n", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--recall", type=int, default=0, metavar="N",
                        help="also score the blocks of the first N windows per length (hf_sparse.evaluate_gates: "
                             "recall of the dense attention mass at --recall-density against the oracle's)")
    parser.add_argument("--recall-density", type=float, default=0.3)
    parser.add_argument("--json")
    parser.add_argument("--png")
    args = parser.parse_args()
    if args.replot:
        import json

        runs = [json.load(open(path)) for path in args.replot]
        rows = [row for run in runs for row in run.get("rows") or summarise(run["samples"])]  # (a cut run: samples)
        rows = [row for index, row in enumerate(rows)  # a curve measured in several runs (mean pooling): the first
                if (row["length"], row["block"], row["gates"], row["fraction"]) not in
                {(r["length"], r["block"], r["gates"], r["fraction"]) for r in rows[:index]}]
        counts = sorted({row["windows"] for row in rows})  # per point: a cut run's are the windows it finished
        args.sequences = "-".join(str(count) for count in counts)
        args.last_n = runs[0]["args"]["last_n"]
        args.long_context = runs[0]["args"].get("long_context", False)
        report(rows, runs[0]["environment"], args)
        if args.png:
            plot(rows, args.png, plot_title(args))
        return
    if not args.gates and not args.scorers:
        parser.error("name at least one gate file (--gates), scorer (--scorers) or earlier runs (--replot)")
    try:
        specs = [parse_spec(spec) for spec in args.scorers]
    except ValueError as error:
        parser.error(str(error))
    if args.query_stride < 1:
        parser.error("--query-stride must be >= 1")
    env = environment()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model, tokenizer = load_default_model(attn_implementation="sdpa", dtype=dtype, device=args.device,
                                          long_context=args.long_context)
    fitted, cursor = None, None
    if any(name == "fitted-low-rank" for name, _, _ in specs):
        fit_start = time.perf_counter()
        rank = max(r for name, _, r in specs if name == "fitted-low-rank")
        fitted = fit_key_bases(model, tokenizer, rank, max(args.lengths), args.fit_windows, args.device)
        cursor = LayerCursor(model)
        print(f"key directions fitted on {args.fit_windows} windows of training code "
              f"({time.perf_counter() - fit_start:.0f} s)")
    built = build_scorers(args.scorers, args.query_stride, fitted, cursor)
    scorers = {f"{scorer.label} (block {scorer.block})": scorer for scorer in built}
    files = []
    for source in args.gates:
        path = resolve_gate_file(source)
        with safe_open(str(path), framework="pt") as handle:
            block = int((handle.metadata() or {})["block_size"])
        files.append((str(path), block))
    names = []  # a gate file's label: its folder's name (made unique)
    for path, _ in files:
        name = os.path.basename(os.path.dirname(os.path.abspath(path)))
        names.append(name if name not in names else f"{name} #{len(names) + 1}")
    samples = []  # one dict per (length, block, gates, fraction, window)
    start = time.perf_counter()
    for length in args.lengths:
        windows = held_out_sequences(tokenizer, length, args.sequences).to(args.device)
        for index, ids in enumerate(windows):
            model.set_attn_implementation("sdpa")
            with torch.no_grad():
                dense = torch.log_softmax(model(ids[None], logits_to_keep=args.last_n).logits.float(), -1)[0]
            blocks = dict.fromkeys([block for _, block in files] + [scorer.block for scorer in built])
            runs = [(block, "mean pooling", None) for block in blocks]
            runs += [(block, name, path) for (path, block), name in zip(files, names)]
            runs += [(scorer.block, scorer.label, key) for key, scorer in scorers.items()]
            for block, gates_name, path in runs:
                for fraction in args.fractions:
                    left = max(2, round(fraction * length / block))
                    config = hf_sparse.PLASConfig(block_size=block, query_union=block, dense_below=0,
                                                  prefill_top_k=(left, math.ceil(1.25 * left)),
                                                  prefill_top_k_length=None,
                                                  dense_above_density=None, density_memory=False)
                    hf_sparse.configure(model, config)
                    set_gates(model, None if path is None or path in scorers
                              else read_gate_file(path, gate_spec(model, block)))
                    scored = scored_selection(scorers[path].score, args.query_stride) if path in scorers else None
                    with scored or contextlib.nullcontext():
                        sparse, density = sparse_logprobs(model, ids[None], config, args.last_n)
                    kl = (dense.exp() * (dense - sparse)).sum(-1)
                    samples.append({"length": length, "block": block, "gates": gates_name, "fraction": fraction,
                                    "top_k": [left, math.ceil(1.25 * left)], "window": index, "density": density,
                                    "kl": kl.mean().item(),
                                    "top1": (dense.argmax(-1) == sparse.argmax(-1)).float().mean().item()})
            print(f"{length} tokens, window {index + 1}/{args.sequences} done ({time.perf_counter() - start:.0f} s)",
                  flush=True)
            if args.json:  # so far (a run cut short keeps its finished windows)
                write_json(args.json, {"environment": env, "args": vars(args), "samples": samples, "partial": True})
    set_gates(model, None)
    model.set_attn_implementation("sdpa")
    rows = summarise(samples)
    report(rows, env, args)
    scores = block_scores(model, tokenizer, files, names, args) if args.recall else []
    if args.json:
        write_json(args.json, {"environment": env, "args": vars(args), "samples": samples, "rows": rows,
                               "matched": matched(rows), "block_scores": scores})
    if args.png:
        plot(rows, args.png, plot_title(args))


def block_scores(model, tokenizer, files, names, args) -> list[dict]:
    """Mean pooling and each gate file scored at the block level (``evaluate_gates``), mean over windows."""
    rows = []
    for length in args.lengths:
        windows = held_out_sequences(tokenizer, length, args.recall).to(args.device)
        runs = [(block, "mean pooling", None) for block in dict.fromkeys(block for _, block in files)]
        runs += [(block, name, path) for (path, block), name in zip(files, names)]
        for block, name, path in runs:
            gates = None if path is None else read_gate_file(path, gate_spec(model, block))
            metrics = [hf_sparse.evaluate_gates(model, ids[None], gates, density=args.recall_density, block_size=block)
                       for ids in windows]
            row = {"length": length, "block": block, "gates": name}
            for field in ("kl", "top1", "recall", "oracle_recall", "density"):
                row[field] = sum(getattr(m, field) for m in metrics) / len(metrics)
            rows.append(row)
    print(f"\nblock scores (hf_sparse.evaluate_gates) at density {args.recall_density}, first {args.recall} windows: "
          "KL / top-1 of the predicted block distribution vs the max-pooled dense one; recall = dense attention mass "
          "in the selected blocks; oracle = the same number of blocks chosen by true mass\n")
    print(table([("length", lambda r: str(r["length"])), ("block", lambda r: str(r["block"])),
                 ("gates", lambda r: r["gates"]), ("block KL", lambda r: f"{r['kl']:.3f}"),
                 ("block top-1", lambda r: f"{r['top1']:.3f}"), ("recall", lambda r: f"{r['recall']:.4f}"),
                 ("oracle recall", lambda r: f"{r['oracle_recall']:.4f}")], rows))
    return rows


def summarise(samples: list[dict]) -> list[dict]:
    rows = []
    keys = dict.fromkeys((s["length"], s["block"], s["gates"], s["fraction"]) for s in samples)
    for length, block, gates, fraction in keys:
        group = [s for s in samples if (s["length"], s["block"], s["gates"], s["fraction"]) == (length, block, gates,
                                                                                               fraction)]
        kls = torch.tensor([s["kl"] for s in group])
        rows.append({"length": length, "block": block, "gates": gates, "fraction": fraction, "top_k": group[0]["top_k"],
                     "windows": len(group), "density": sum(s["density"] for s in group) / len(group),
                     "kl": kls.mean().item(), "kl_std": kls.std().item() if len(group) > 1 else 0.0,
                     "top1": sum(s["top1"] for s in group) / len(group)})
    return rows


def report(rows: list[dict], env: dict, args: argparse.Namespace) -> None:
    print(header(env))
    model = "SmolLM2-135M-Instruct" + (" (long-context)" if args.long_context else "")
    print(f"{model}, held-out prose (hf_sparse.tools.eval.held_out_sequences), {args.sequences} windows per "
          f"length; KL(dense || sparse) and top-1 over the last {args.last_n} positions, mean (std) over windows\n")
    print(table([("length", lambda r: str(r["length"])), ("block", lambda r: str(r["block"])),
                 ("gates", lambda r: r["gates"]), ("prefill_top_k", lambda r: f"{r['top_k'][0]}-{r['top_k'][1]}"),
                 ("density", lambda r: f"{r['density']:.3f}"), ("KL", lambda r: f"{r['kl']:.4f} ({r['kl_std']:.4f})"),
                 ("top-1", lambda r: f"{r['top1']:.3f}")], rows))
    print("\nmatched against mean pooling's curve (- : outside its density / KL range)\n")

    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    print(table([("length", lambda r: str(r["length"])), ("block", lambda r: str(r["block"])),
                 ("gates", lambda r: r["gates"]), ("trained density", lambda r: f"{r['density']:.3f}"),
                 ("trained KL", lambda r: f"{r['kl']:.4f}"),
                 ("mean pooling KL there", lambda r: fmt(r["mean_kl"], ".4f")),
                 ("KL ratio", lambda r: fmt(r["kl_ratio"], ".2f")),
                 ("mean pooling density at that KL", lambda r: fmt(r["mean_density"], ".3f")),
                 ("density ratio", lambda r: fmt(r["density_ratio"], ".2f"))], matched(rows)))


if __name__ == "__main__":
    main()
