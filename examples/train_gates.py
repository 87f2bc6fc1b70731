"""Train PLAS gates on the embedded SmolLM2-135M-Instruct and compare them with mean pooling on held-out text.

Training and held-out text both come from the Python standard library installed with the interpreter (nothing is
downloaded), split by file so they never overlap: the held-out text is the first ``--eval-tokens`` tokens of the
top-level ``*.py`` files in sorted order (the input of docs/fidelity.md), the training text is every other
stdlib ``*.py`` file in a seeded shuffled order. Prints two tables:

* block scores (``hf_sparse.evaluate_gates``) at equal density: every query selects the same number of blocks
  with either gate set; KL and top-1 of the predicted block distribution against the dense attention's
  max-pooled block distribution, and the dense attention mass recalled by the selected blocks;
* the model itself (``hf_sparse.tools.eval.fidelity``) running sparse prefill with ``--top-k`` / ``--query-union``:
  next-token KL and top-1 agreement with dense attention, the measured density and the recall.

The defaults take a few minutes on 2 CPU cores. docs/gates.md lists the settings of the measured table.
Re-running with the same ``--out`` resumes an interrupted training run (``--overwrite`` starts over).
"""
from __future__ import annotations

import argparse
import glob
import os
import random
import sysconfig
import time
from typing import Iterator

import torch

import hf_sparse
from hf_sparse.tools.default_model import load_default_model
from hf_sparse.tools.eval import fidelity
from hf_sparse.gates import set_gates
from hf_sparse.tools.text_data import read_text_files, token_stream


def split_stdlib(tokenizer, eval_tokens: int, seed: int) -> tuple[torch.Tensor, Iterator[str]]:
    """Held-out ids ``[1, eval_tokens]`` and the training texts (read lazily), from disjoint stdlib files."""
    root = sysconfig.get_paths()["stdlib"]
    top_level = sorted(glob.glob(os.path.join(root, "*.py")))
    held_out_files, text = [], ""
    for path in top_level:  # whole files until the held-out text is long enough
        held_out_files.append(path)
        text += read_text_files([path])[0]
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        if ids.shape[1] >= eval_tokens:
            break
    if ids.shape[1] < eval_tokens:
        raise ValueError(f"the stdlib's top-level files hold only {ids.shape[1]} tokens")
    everything = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
    training_files = [p for p in everything if p not in set(held_out_files) and "site-packages" not in p]
    random.Random(seed).shuffle(training_files)
    texts = (text for path in training_files for text in read_text_files([path]) if text.strip())
    return ids[:, :eval_tokens], texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-tokens", type=int, default=16 * 1024, help="training tokens")
    parser.add_argument("--seq-length", type=int, default=1024, help="packed training sequence length")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=hf_sparse.GateTrainingConfig.learning_rate)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--eval-tokens", type=int, default=2048, help="held-out tokens (one sequence)")
    parser.add_argument("--density", type=float, default=0.434, help="block density of the score comparison")
    parser.add_argument("--top-k", default="5,7", help="prefill_top_k of the fidelity comparison")
    parser.add_argument("--query-union", type=int, default=64)
    parser.add_argument("--no-fidelity", action="store_true", help="skip the model-level comparison")
    parser.add_argument("--out", default="gates_smollm2", help="folder for the gate file and the checkpoint")
    parser.add_argument("--overwrite", action="store_true", help="discard a checkpoint in --out and start over")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # gates themselves always train in float32
    model, tokenizer = load_default_model(attn_implementation="sdpa", dtype=dtype, device=device)
    held_out, texts = split_stdlib(tokenizer, args.eval_tokens, args.seed)
    held_out = held_out.to(device)
    print(f"device {device} ({dtype}), torch {torch.__version__}; held-out {held_out.shape[1]} tokens, "
          f"training {args.train_tokens} tokens in sequences of {args.seq_length}")

    started = time.perf_counter()
    config = hf_sparse.GateTrainingConfig(
        seq_length=args.seq_length, max_tokens=args.train_tokens, block_size=args.block_size,
        learning_rate=args.lr, warmup_steps=args.warmup_steps, checkpoint_every=10, seed=args.seed)
    # Tokenize only what training uses (a stream of max_tokens is cycled over when max_tokens exceeds it).
    sequences = token_stream(texts, tokenizer, args.train_tokens)
    result = hf_sparse.train_gates(model, sequences, config, output_dir=args.out, overwrite=args.overwrite)
    train_seconds = time.perf_counter() - started
    head, tail = result.losses[: max(1, len(result.losses) // 10)], result.losses[-max(1, len(result.losses) // 10):]
    print(f"trained {len(result.gates)} layers in {result.steps} steps ({train_seconds:.0f} s): loss "
          f"{sum(head) / len(head):.4f} (first tenth) -> {sum(tail) / len(tail):.4f} (last tenth); "
          f"wrote {result.path}")

    print(f"\nblock scores on held-out text, target density {args.density} (achieved in the last column; the same "
          "number of blocks per query for both gate sets; hf_sparse.evaluate_gates)")
    print(f"{'gates':<14} {'KL':>7} {'top-1':>7} {'recall':>7} {'oracle':>7} {'density':>8}")
    scores = {}
    for name, gates in (("mean pooling", None), ("trained", result.gates)):
        metrics = hf_sparse.evaluate_gates(model, held_out, gates, density=args.density, block_size=args.block_size)
        scores[name] = metrics
        print(f"{name:<14} {metrics.kl:>7.4f} {metrics.top1:>7.4f} {metrics.recall:>7.4f} "
              f"{metrics.oracle_recall:>7.4f} {metrics.density:>8.3f}")

    if not args.no_fidelity:
        top_k = tuple(int(k) for k in args.top_k.split(","))
        plas = hf_sparse.PLASConfig(block_size=args.block_size, prefill_top_k=top_k, query_union=args.query_union,
                                    dense_below=0)
        print(f"\nsparse prefill vs dense (hf_sparse.tools.eval.fidelity), block_size {args.block_size}, "
              f"prefill_top_k {top_k}, query_union {args.query_union}, last 256 positions")
        print(f"{'gates':<14} {'next-token KL':>13} {'top-1':>7} {'recall':>7} {'density':>8}")
        for name, gates in (("mean pooling", None), ("trained", result.gates)):
            set_gates(model, None)
            if gates is not None:
                set_gates(model, gates)
            report = fidelity(model, held_out, plas)
            print(f"{name:<14} {report.kl:>13.5f} {report.top1_agreement:>7.4f} {report.recall:>7.4f} "
                  f"{report.density:>8.3f}")
    print(f"\ntotal {time.perf_counter() - started:.0f} s; load the gates with "
          f"hf_sparse.load_gates(model, {args.out!r})")


if __name__ == "__main__":
    main()
