"""PLAS gate training on the GPU: training tokens per second of ``hf_sparse.train_gates`` and where a step goes.

Runs ``--steps`` optimisation steps of one ``--seq-length`` sequence on ``--model`` (bfloat16, CUDA), then times
the same model's forward alone (the part of a step that is not distillation: the model up to the last trained
layer, dense attention) and profiles ``--profile-steps`` more steps with ``torch.profiler`` (GPU time per kernel).
Throughput does not depend on the weights, so ``--model smollm2-random`` measures it without the GGUF.

    python benchmarks/bench_training.py --model smollm2 --seq-length 8192 --steps 30

``--loss-curve CHECKPOINT --png FILE`` (no GPU) plots the per-step loss history a training run's checkpoint holds
(``gate_training_checkpoint.safetensors``), with a 50-step moving mean. ``--loss-curve LOG.jsonl`` plots a
long-context adapter run's log instead (``hf-sparse train-long-context`` writes it beside the adapter): the language
model loss per step, one colour per sequence length, and the tokens per second; a ``hf-sparse train-gates`` log
(``OUT/gate_training.log.jsonl``): the distillation loss and the held-out KL and recall of its evaluations.
"""
from __future__ import annotations

import argparse
import time

import torch

import hf_sparse
from hf_sparse.gates import gate_spec
from hf_sparse.tools.probe import probe_layers

from _common import add_model_arguments, environment, header, load_model, require_cuda, save_figure, write_json


def training_ids(loaded, seq_length: int, count: int) -> torch.Tensor:
    """``[count, seq_length]`` ids: gate training's data (the stdlib's package sources) for the trained model,
    random ids for a random-weight one."""
    if loaded.tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        return torch.randint(0, loaded.model.config.vocab_size, (count, seq_length), generator=generator)
    from hf_sparse.tools.eval import stdlib_training_files
    from hf_sparse.tools.text_data import read_text_files, token_stream

    return token_stream(read_text_files(stdlib_training_files()), loaded.tokenizer,
                        count * seq_length).view(count, seq_length)


def moving_mean(values: list[float], window: int) -> list[float]:
    """The mean of each value and the ``window - 1`` before it (fewer at the start)."""
    return [sum(values[max(0, i - window + 1): i + 1]) / len(values[max(0, i - window + 1): i + 1])
            for i in range(len(values))]


def long_context_curve(log: str, png: str) -> dict:
    """Plot a ``train-long-context`` JSON-lines log (loss per step by sequence length, 20-step mean); its summary."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(log, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    rows = [row for row in rows if "loss" in row]
    if not rows:
        raise SystemExit(f"{log} holds no training steps")
    tokens = [row["tokens"] / 1e6 for row in rows]
    losses = [row["loss"] for row in rows]
    window = min(20, len(losses))
    fig, ax = plt.subplots(figsize=(7, 4))
    for length in sorted({row["seq_length"] for row in rows}):
        picked = [(t, loss) for t, loss, row in zip(tokens, losses, rows) if row["seq_length"] == length]
        ax.plot(*zip(*picked), ".", ms=3, alpha=0.5, label=f"step loss, sequences of {length}")
    ax.plot(tokens, moving_mean(losses, window), lw=1.5, label=f"mean of {window} steps")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("language-model loss")
    ax.set_title(f"long-context adapter: {len(rows)} steps, {rows[-1]['tokens'] / 1e6:.1f}M tokens, "
                 f"{rows[-1]['tokens_per_second']:,.0f} tokens/s", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, png)
    summary = {"steps": len(rows), "tokens": rows[-1]["tokens"], "seconds": rows[-1]["seconds"],
               "tokens_per_second": rows[-1]["tokens_per_second"], "first_mean": moving_mean(losses, window)[window - 1],
               "last_mean": moving_mean(losses, window)[-1]}
    print(f"{summary['steps']} steps, {summary['tokens'] / 1e6:.2f}M tokens in {summary['seconds']:.0f} s "
          f"({summary['tokens_per_second']:,.0f} tokens/s): loss {summary['first_mean']:.3f} (first {window} steps) -> "
          f"{summary['last_mean']:.3f} (last {window})")
    return summary


def gate_log_curve(log: str, png: str) -> dict:
    """Plot a ``train-gates`` JSON-lines log: the distillation loss per step (50-step mean) and, where the run
    evaluated, the gates' held-out KL and recall against training tokens; its summary."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(log, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    steps = [row for row in rows if "loss" in row]
    evals = [row for row in rows if "eval" in row]
    if not steps:
        raise SystemExit(f"{log} holds no training steps")
    window = min(50, len(steps))
    tokens = [row["tokens"] / 1e6 for row in steps]
    smooth = moving_mean([row["loss"] for row in steps], window)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(tokens, [row["loss"] for row in steps], lw=0.5, alpha=0.4, label="per step")
    left.plot(tokens, smooth, lw=1.5, label=f"mean of {window} steps")
    left.set_xlabel("training tokens (millions)")
    left.set_ylabel("distillation loss (mean over layers)")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    if evals:
        eval_tokens = [row["tokens"] / 1e6 for row in evals]
        right.plot(eval_tokens, [row["eval"]["kl"] for row in evals], "o-", label="held-out KL")
        right.set_ylabel("held-out KL (gate vs dense block distribution)")
        if "recall" in evals[0]["eval"]:
            twin = right.twinx()
            twin.plot(eval_tokens, [row["eval"]["recall"] for row in evals], "s--", color="tab:green",
                      label="held-out recall")
            twin.set_ylabel("recall at the evaluation density")
        right.set_xlabel("training tokens (millions)")
        right.grid(alpha=0.3)
        right.legend(fontsize=8, loc="upper right")
    last = steps[-1]
    fig.suptitle(f"PLAS gates: {len(steps)} steps, {last['tokens'] / 1e6:.1f}M tokens, "
                 f"{last['tokens_per_second']:,.0f} tokens/s (last call)", fontsize=9)
    save_figure(fig, png)
    summary = {"steps": len(steps), "tokens": last["tokens"], "tokens_per_second": last["tokens_per_second"],
               "first_mean": smooth[window - 1], "last_mean": smooth[-1],
               "held_out_kl": [(row["step"], row["eval"]["kl"]) for row in evals]}
    held_out = (f"; held-out KL {evals[0]['eval']['kl']:.4f} (step {evals[0]['step']}) -> "
                f"{evals[-1]['eval']['kl']:.4f} (step {evals[-1]['step']})" if evals else "")
    print(f"{summary['steps']} steps, {summary['tokens'] / 1e6:.2f}M tokens ({summary['tokens_per_second']:,.0f} "
          f"tokens/s): loss {summary['first_mean']:.4f} (first {window} steps) -> {summary['last_mean']:.4f} (last "
          f"{window}){held_out}")
    return summary


def loss_curve(checkpoint: str, png: str) -> None:
    import json

    import matplotlib
    from safetensors import safe_open

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with safe_open(checkpoint, framework="pt") as handle:
        metadata = handle.metadata()
    losses = json.loads(metadata["losses"])
    settings = json.loads(metadata["fingerprint"])["settings"]
    if not losses:
        raise SystemExit(f"{checkpoint} holds no steps")
    window = min(50, len(losses))
    smooth = moving_mean(losses, window)
    tokens = [(i + 1) * settings["seq_length"] * settings["batch_size"] / 1e6 for i in range(len(losses))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(tokens, losses, lw=0.5, alpha=0.4, label="per step")
    ax.plot(tokens, smooth, lw=1.5, label=f"mean of {window} steps")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("distillation loss (KL, mean over layers)")
    ax.set_title(f"PLAS gates, SmolLM2-135M-Instruct: block {settings['block_size']}, sequences of "
                 f"{settings['seq_length']}, target {settings.get('target', 'max')}, lr {settings['learning_rate']}",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, png)
    print(f"{len(losses)} steps, {tokens[-1]:.1f}M tokens: loss {smooth[window - 1]:.4f} (first {window} steps) -> "
          f"{smooth[-1]:.4f} (last {window})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, "smollm2")
    parser.add_argument("--seq-length", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=30, help="timed steps (the first is left out as warm-up)")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--query-chunk", type=int, default=hf_sparse.GateTrainingConfig.query_chunk)
    parser.add_argument("--profile-steps", type=int, default=2, help="steps under torch.profiler (0: none)")
    parser.add_argument("--json", help="write every number here")
    parser.add_argument("--loss-curve", metavar="CHECKPOINT",
                        help="plot this gate checkpoint's loss history, or a long-context run's .jsonl log (no run)")
    parser.add_argument("--png", help="with --loss-curve: the plot's file")
    args = parser.parse_args()
    if args.loss_curve:
        if args.loss_curve.endswith(".jsonl") and "seq_length" in open(args.loss_curve, encoding="utf-8").readline():
            long_context_curve(args.loss_curve, args.png or "long_context_loss.png")
        elif args.loss_curve.endswith(".jsonl"):  # a train-gates log
            gate_log_curve(args.loss_curve, args.png or "gate_loss.png")
        else:
            loss_curve(args.loss_curve, args.png or "gate_loss.png")
        return
    if args.steps < 2:
        parser.error("--steps: the rate needs at least 2 steps")
    require_cuda("bench_training.py")
    env = environment()
    loaded = load_model(args)
    model = loaded.model
    ids = training_ids(loaded, args.seq_length, args.steps + args.profile_steps)
    tokens = args.seq_length

    def config(steps: int) -> hf_sparse.GateTrainingConfig:
        return hf_sparse.GateTrainingConfig(seq_length=args.seq_length, max_tokens=steps * tokens,
                                            block_size=args.block_size, query_chunk=args.query_chunk,
                                            warmup_steps=1, checkpoint_every=0)

    stamps: list[float] = []
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    result = hf_sparse.train_gates(model, ids[: args.steps], config(args.steps), progress=False,
                                   on_step=lambda step, loss: stamps.append(time.perf_counter()))
    step_s = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    peak = torch.cuda.max_memory_allocated() / 2**30

    layers = gate_spec(model, args.block_size).gated_layers
    forward = []
    for row in ids[:5]:
        torch.cuda.synchronize()
        begin = time.perf_counter()
        probe_layers(model, row[None].cuda(), layers, lambda *unused: None)
        torch.cuda.synchronize()
        forward.append(time.perf_counter() - begin)
    forward_s = sorted(forward)[len(forward) // 2]

    kernels = []
    if args.profile_steps:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            hf_sparse.train_gates(model, ids[args.steps:], config(args.profile_steps), progress=False)
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        total = sum(e.self_device_time_total for e in events)
        for event in sorted(events, key=lambda e: -e.self_device_time_total)[:12]:
            kernels.append({"kernel": event.key[:90], "ms_per_step": event.self_device_time_total / 1e3 /
                            args.profile_steps, "share": event.self_device_time_total / total})
        gpu_busy_ms = total / 1e3 / args.profile_steps
    else:
        gpu_busy_ms = None

    rate = tokens / step_s
    print(header(env))
    print(f"{loaded.description}; sequences of {tokens} tokens, block {args.block_size}, {len(layers)} gated layers, "
          f"query_chunk {args.query_chunk}; {len(stamps)} steps in {time.perf_counter() - start:.1f} s")
    print(f"\nstep {step_s * 1e3:.1f} ms: {rate:,.0f} training tokens/s = {rate * 60 / 1e6:.2f}M per minute; "
          f"peak memory {peak:.2f} GiB; loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}")
    print(f"the model's forward up to layer {max(layers)} alone (no distillation): {forward_s * 1e3:.1f} ms "
          f"({forward_s / step_s:.0%} of a step)")
    if kernels:
        print(f"GPU busy {gpu_busy_ms:.1f} ms per step ({gpu_busy_ms / 1e3 / step_s:.0%} of the step's wall time); "
              "top kernels:\n")
        print("| kernel | ms per step | share of GPU time |\n| --- | ---: | ---: |")
        for row in kernels:
            print(f"| `{row['kernel']}` | {row['ms_per_step']:.2f} | {row['share']:.1%} |")
    if args.json:
        write_json(args.json, {"environment": env, "args": vars(args) | {"gguf": str(args.gguf)},
                               "step_ms": step_s * 1e3, "tokens_per_s": rate, "peak_gib": peak,
                               "forward_ms": forward_s * 1e3, "gpu_busy_ms": gpu_busy_ms, "kernels": kernels,
                               "losses": result.losses})


if __name__ == "__main__":
    main()
