"""Density / KL curves of sparse attention settings on the embedded SmolLM2-135M-Instruct, one prefill each.

Each setting is a method name as in bench_generate.py ("xattn-threshold=0.8-pool=mean", "plas-prefill_top_k=[8:10]",
"star-block_size=8192-query_tokens=256": KL over the query positions with ``--last-n 256``);
every one runs sparse at any length and density (``dense_below=0``, ``dense_above_density=None`` are added). Input:
the first ``--tokens`` tokens of the standard library's ``*.py`` files in sorted order (``hf_sparse.tools.eval``'s text).
Reported per setting: prefill density (attended / causal key blocks over the sparse layers), next-token
KL(dense || sparse) and top-1 agreement over the last ``--last-n`` positions, and the KL at the last position alone.
Runs on the CPU (PyTorch reference path) or the GPU; prints a Markdown table, writes JSON and a PNG (KL against
density, one line per method family: the part of the name before the threshold or top-k option).

A study (results in docs/xattn.md and docs/star.md), not a tool. From the repository root (it imports
benchmarks/_common.py):

    python studies/fidelity_curves.py --tokens 8192 --png docs/fidelity_curves.png \
        xattn-threshold=0.8 xattn-threshold=0.9 plas-prefill_top_k=[8:10] plas-prefill_top_k=[16:20]
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch

import hf_sparse
from hf_sparse.tools.default_model import load_default_model
from hf_sparse.tools.eval import stdlib_text
from hf_sparse.methods.star import StarMethod

# benchmarks/_common.py: the helpers the benchmark scripts share
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _common import save_figure, sparse_config, table, write_json  # noqa: E402


def family(name: str) -> str:
    """The line a setting belongs to: its name without the threshold / top-k / Star block size option."""
    line = re.sub(r"-(threshold|prefill_top_k|block_size)=[^-]*", "", name)
    return line if "-" in line else f"{line} (other fields default)"


def run(model, ids: torch.Tensor, name: str, dense_lp: torch.Tensor, last_n: int) -> dict:
    config = sparse_config(f"{name}-dense_below=0-noprobe")
    hf_sparse.configure(model, config)
    start = time.perf_counter()
    with torch.no_grad(), hf_sparse.record_sparsity() as rec:
        logits = model(ids, logits_to_keep=last_n).logits.float()
    elapsed = time.perf_counter() - start
    model.set_attn_implementation("sdpa")
    sparse_lp = torch.log_softmax(logits, -1)
    kl = (dense_lp.exp() * (dense_lp - sparse_lp)).sum(-1)[0]
    if isinstance(config, hf_sparse.StarConfig):  # the pattern's share of causal attention over the context
        density = StarMethod(config).context_density(ids.shape[1] - config.query_tokens)
    else:
        density = rec.density("prefill")
    return {"setting": name, "family": family(name), "tokens": ids.shape[1], "density": density,
            "kl": kl.mean().item(),
            "kl_last": kl[-1].item(), "top1": (dense_lp.argmax(-1) == sparse_lp.argmax(-1)).float().mean().item(),
            "seconds": elapsed}


def plot(rows: list[dict], path: str, title: str, last_n: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(15, 4.4))
    for ax, key, label in ((axes[0], "kl", f"next-token KL vs dense, mean over the last {last_n} positions"),
                           (axes[1], "kl_last", "next-token KL vs dense at the last position")):
        lengths = {row["tokens"] for row in rows}
        for line in dict.fromkeys((family(row["setting"]), row["tokens"]) for row in rows):
            points = sorted((row["density"], row[key]) for row in rows
                            if (family(row["setting"]), row["tokens"]) == line)
            name = line[0] if len(lengths) == 1 else f"{line[0]}, {line[1]} tokens"
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        ax.set_yscale("log")
        ax.set_xlabel("prefill density (attended / causal key blocks)")
        ax.set_ylabel(label, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    save_figure(fig, path, title)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("settings", nargs="*", help="method names (see the docstring)")
    parser.add_argument("--replot", nargs="+", metavar="JSON", help="table and plot of earlier runs' JSON files")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--last-n", type=int, default=512)
    parser.add_argument("--skip", type=int, default=0, help="start the input this many tokens into the text")
    parser.add_argument("--windows", type=int, default=1,
                        help="consecutive windows of --tokens each; the table gives the mean and range over them")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="float32 (default on CPU) or bfloat16 (default on CUDA)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--png", default=None)
    args = parser.parse_args()
    if args.replot:
        import json

        runs = [json.load(open(path)) for path in args.replot]
        rows = [{"tokens": run["tokens"], **row} for run in runs for row in run["rows"]]
        lengths = " / ".join(str(tokens) for tokens in sorted({run["tokens"] for run in runs}))
        report(rows, f"{lengths} tokens", runs[0]["last_n"], args.png)
        return
    if not args.settings:
        parser.error("name at least one setting (or --replot)")
    for name in args.settings:
        if sparse_config(name) is None:
            parser.error(f"{name!r} is not a plas, xattn or star setting")

    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    model, tokenizer = load_default_model(attn_implementation="sdpa", dtype=dtype, device=args.device)
    span = args.skip + args.windows * args.tokens
    text = stdlib_text(6 * span)
    all_ids = tokenizer(text, return_tensors="pt").input_ids
    if all_ids.shape[1] < span:
        raise SystemExit(f"the text holds only {all_ids.shape[1]} tokens, fewer than --skip + --windows x --tokens "
                         f"= {span}")
    rows = []
    for window in range(args.windows):
        start = args.skip + window * args.tokens
        ids = all_ids[:, start: start + args.tokens].to(args.device)
        with torch.no_grad():
            dense_lp = torch.log_softmax(model(ids, logits_to_keep=args.last_n).logits.float(), -1)
        for name in args.settings:
            rows.append({**run(model, ids, name, dense_lp, args.last_n), "window": window, "start": start})
            print(f"window {window} {name}: density {rows[-1]['density']:.3f} KL {rows[-1]['kl']:.4f} KL last "
                  f"{rows[-1]['kl_last']:.4f} ({rows[-1]['seconds']:.0f} s)", flush=True)
    if args.json:
        write_json(args.json, {"tokens": args.tokens, "skip": args.skip, "windows": args.windows,
                               "last_n": args.last_n, "device": args.device, "dtype": str(dtype), "rows": rows})
    report(rows, f"{args.tokens} tokens from {args.skip}, {dtype}, {args.device}", args.last_n, args.png)


def averaged(rows: list[dict]) -> list[dict]:
    """One row per setting and input length: the mean of each number over its windows, with the range (``*_min`` /
    ``*_max``)."""
    merged = []
    for tokens, name in dict.fromkeys((row["tokens"], row["setting"]) for row in rows):
        runs = [row for row in rows if (row["tokens"], row["setting"]) == (tokens, name)]
        out = {"setting": name, "family": runs[0]["family"], "tokens": tokens, "windows": len(runs)}
        for key in ("density", "kl", "kl_last", "top1"):
            values = [row[key] for row in runs]
            out.update({key: sum(values) / len(values), f"{key}_min": min(values), f"{key}_max": max(values)})
        merged.append(out)
    return merged


def report(rows: list[dict], what: str, last_n: int, png: str | None) -> None:
    rows = averaged(rows)
    windows = max(row["windows"] for row in rows)
    spread = windows > 1

    def number(key, spec):
        return lambda r: (f"{r[key]:{spec}}" + (f" ({r[key + '_min']:{spec}}-{r[key + '_max']:{spec}})"
                                                 if spread else ""))
    print(f"\nSmolLM2-135M-Instruct, {what}; KL and top-1 over the last {last_n} positions"
          + (f"; mean (range) over {windows} windows" if spread else ""))
    print(table([("tokens", lambda r: str(r["tokens"])), ("setting", lambda r: r["setting"]),
                 ("density", lambda r: f"{r['density']:.3f}"),
                 ("KL", number("kl", ".4f")), ("KL last", number("kl_last", ".4f")),
                 ("top-1", number("top1", ".3f"))], rows))
    if png:
        plot(rows, png, f"SmolLM2-135M-Instruct, {what.split(',')[0]} of the standard library's source", last_n)


if __name__ == "__main__":
    main()
