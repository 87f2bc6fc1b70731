"""PLAS gate distillation: learn each layer's gate so block scores predict where dense attention goes.

Per query, the target is the dense attention probabilities max-pooled (``target="max"``, the default) or summed
(``"sum"``: each block's attention mass) over each key block and renormalised to sum 1 over the causal blocks;
the prediction is ``softmax_j(q . Kc_j * scale)`` over the same blocks, with ``Kc`` the gate-compressed keys
(:func:`hf_sparse.kernels.reference.block_summaries`, the inference code path); the loss is
``KL(target || prediction)``. The model is frozen and runs dense attention; each layer's loss is
computed and back-propagated inside the forward pass as soon as that layer's query and keys exist, so memory
holds one layer's attention at a time. Only the gates get gradients.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from safetensors import safe_open
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..gate_files import GATE_FILENAME, save_safetensors_atomic, write_gate_file
from ..gates import gate_spec, model_plas_config, set_gates
from .default_model import default_model_dir, load_default_model
from .eval import held_out_sequences, stdlib_training_files
from .gate_eval import evaluate_gates
from .gate_objective import (
    attention_scale,
    refuse_tensor_parallel,
    gate_distillation_loss,
)
from .probe import probe_layers
from .text_data import pack_sequences, read_text_files, token_stream

logger = logging.getLogger(__name__)




#: File (in the output folder) holding the resumable training state.
CHECKPOINT_FILENAME = "gate_training_checkpoint.safetensors"


#: The clock of :func:`train_gates`'s time budget and log (a test replaces it).
_now = time.monotonic


#: What :func:`gate_distillation_loss` minimises (see :class:`GateTrainingConfig`).
OBJECTIVES = ("kl", "ranking")


@dataclass
class GateTrainingConfig:
    """Settings of :func:`train_gates`.

    Attributes:
        seq_length: tokens per packed training sequence (a multiple of ``block_size``).
        batch_size: sequences per optimisation step.
        max_tokens: training tokens (``steps = max_tokens // (seq_length * batch_size)``, cycling over the data
            in a fresh seeded order each epoch); ``None`` = one pass over the data.
        learning_rate: peak Adam learning rate (gates start at ``1 / block_size``).
        warmup_steps: linear warm-up steps, then cosine decay to ``min_lr_ratio * learning_rate``.
        min_lr_ratio: final learning rate as a fraction of the peak.
        block_size: gate block size; ``None`` = the model's ``PLASConfig.block_size``.
        layers: layer indices to train; ``None`` = every layer not in the model's ``dense_layers``. The forward
            pass stops after the last of them.
        query_chunk: queries whose dense logits the PyTorch path materialises at once (bounds its memory); the
            Triton path writes no logits and takes as many queries at once as keep its per-block tensors under
            :data:`hf_sparse.tools.gate_objective.TARGET_CHUNK_BYTES`.
        target: how the dense attention probabilities are pooled over a key block for the target: ``"max"`` (the
            block's strongest key; FastDeploy's PLAS) or ``"sum"`` (the block's attention mass: what a selection
            recalls).
        objective: ``"kl"``: ``KL(target || prediction)`` over the blocks; ``"ranking"``: the Plackett-Luce negative
            log-likelihood of the target's ``ranking_top_k`` best blocks in their order (each in turn must outscore
            every block not yet placed), which spends the gate on the order at the top, where selection cuts.
        ranking_top_k: how many of the target's best blocks ``objective="ranking"`` places.
        skip_forced_blocks: leave the blocks PLAS always attends (the model's ``sink_blocks`` first blocks and each
            query's own block) out of target and prediction, so the gate learns to rank the blocks selection
            actually chooses among; ``False`` distils over every causal block (see docs/gates.md for both).
        checkpoint_every: steps between checkpoints (with an output folder); 0 = only at the end / interruption.
        seed: seeds the data order; with the same data and settings two runs give identical gates.
    """

    seq_length: int = 4096
    batch_size: int = 1
    max_tokens: int | None = None
    learning_rate: float = 2e-3
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    block_size: int | None = None
    layers: tuple[int, ...] | None = None
    query_chunk: int = 1024
    target: str = "max"
    objective: str = "kl"
    ranking_top_k: int = 8
    skip_forced_blocks: bool = True
    checkpoint_every: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("seq_length", "batch_size", "query_chunk", "ranking_top_k"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer or None, got {self.max_tokens!r}")
        if not (isinstance(self.learning_rate, (int, float)) and self.learning_rate > 0):
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.warmup_steps < 0 or self.checkpoint_every < 0:
            raise ValueError("warmup_steps and checkpoint_every must be >= 0")
        if self.target not in ("max", "sum"):
            raise ValueError(f"target must be 'max' or 'sum', got {self.target!r}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.layers is not None:
            self.layers = tuple(sorted({int(i) for i in self.layers}))


@dataclass
class GateTrainingResult:
    """What :func:`train_gates` produced: the gates (also attached to the model), the mean loss over the trained
    layers at every step, and where the gate file went."""

    gates: dict[int, torch.Tensor]
    losses: list[float]
    steps: int
    tokens: int
    resumed_from: int = 0
    path: Path | None = None
    stopped: str = "done"  # or "deadline": checkpointed before the last step, nothing attached; run again to resume


def _as_sequences(dataset: Any, tokenizer: Any, config: GateTrainingConfig) -> torch.Tensor:
    if isinstance(dataset, torch.Tensor):
        if dataset.dim() == 2 and dataset.shape[1] == config.seq_length:
            return dataset.long()
        return pack_sequences(dataset.reshape(-1).long(), config.seq_length)
    items = list(dataset)
    if items and isinstance(items[0], str):
        if tokenizer is None:
            raise ValueError("a dataset of strings needs tokenizer=")
        return pack_sequences(token_stream(items, tokenizer, config.max_tokens), config.seq_length)
    flat = [int(t) for item in items for t in item]
    return pack_sequences(torch.tensor(flat, dtype=torch.long), config.seq_length)


def _data_order(num_sequences: int, steps: int, batch_size: int, seed: int) -> torch.Tensor:
    """Sequence index of every (step, slot): seeded permutations, a fresh one per epoch."""
    generator = torch.Generator().manual_seed(seed)
    needed = steps * batch_size
    parts, total = [], 0
    while total < needed:
        parts.append(torch.randperm(num_sequences, generator=generator))
        total += num_sequences
    return torch.cat(parts)[:needed].view(steps, batch_size)


# -- checkpoints ----------------------------------------------------------------------------------------------
def _fingerprint(config: GateTrainingConfig, spec: Any, layers: Sequence[int], sequences: torch.Tensor,
                 steps: int, sink_blocks: int | None) -> dict[str, Any]:
    digest = hashlib.sha256(sequences.to(torch.int64).numpy().tobytes()).hexdigest()
    settings = asdict(config)
    settings["layers"] = list(layers)
    settings["block_size"] = spec.block_size
    settings["sink_blocks"] = sink_blocks
    return {"settings": settings, "steps": steps, "data_sha256": digest, "num_sequences": int(sequences.shape[0]),
            "gate_shape": list(spec.shape)}


def _save_checkpoint(path: Path, step: int, gates: Mapping[int, torch.nn.Parameter], optimizer: torch.optim.Adam,
                     losses: list[float], fingerprint: Mapping[str, Any]) -> None:
    """Gates, Adam moments, step and loss history in one safetensors file, replaced atomically."""
    tensors: dict[str, torch.Tensor] = {}
    adam_steps = {}
    for layer, parameter in gates.items():
        tensors[f"gates.{layer}"] = parameter.detach().cpu().contiguous().clone()
        state = optimizer.state.get(parameter)
        if state:
            tensors[f"adam.{layer}.exp_avg"] = state["exp_avg"].detach().cpu().contiguous().clone()
            tensors[f"adam.{layer}.exp_avg_sq"] = state["exp_avg_sq"].detach().cpu().contiguous().clone()
            adam_steps[str(layer)] = float(state["step"])
    metadata = {"step": str(step), "losses": json.dumps(losses), "adam_steps": json.dumps(adam_steps),
                "fingerprint": json.dumps(fingerprint, sort_keys=True)}
    save_safetensors_atomic(tensors, path, metadata)
    logger.info("checkpoint at step %d written to %s", step, path)


def _load_checkpoint(path: Path, gates: Mapping[int, torch.nn.Parameter], optimizer: torch.optim.Adam,
                     fingerprint: Mapping[str, Any]) -> tuple[int, list[float]]:

    with safe_open(str(path), framework="pt", device="cpu") as handle:
        metadata = handle.metadata() or {}
        stored = json.loads(metadata.get("fingerprint", "{}"))
        if stored != json.loads(json.dumps(fingerprint, sort_keys=True)):
            differences = _differences(stored, fingerprint)
            raise ValueError(f"{path} was written by a different training run ({differences}); use another output "
                             "folder or overwrite=True (--overwrite) to start over")
        adam_steps = json.loads(metadata["adam_steps"])
        with torch.no_grad():
            for layer, parameter in gates.items():
                parameter.copy_(handle.get_tensor(f"gates.{layer}"))
                if str(layer) in adam_steps:
                    optimizer.state[parameter] = {
                        "step": torch.tensor(adam_steps[str(layer)], dtype=torch.float32),
                        "exp_avg": handle.get_tensor(f"adam.{layer}.exp_avg").to(parameter.device),
                        "exp_avg_sq": handle.get_tensor(f"adam.{layer}.exp_avg_sq").to(parameter.device),
                    }
        return int(metadata["step"]), json.loads(metadata["losses"])


def _differences(stored: Mapping[str, Any], current: Mapping[str, Any]) -> str:
    flat_stored = {**stored.get("settings", {}), **{k: v for k, v in stored.items() if k != "settings"}}
    flat_current = {**current.get("settings", {}), **{k: v for k, v in current.items() if k != "settings"}}
    changed = [f"{key}: {flat_stored.get(key)!r} -> {flat_current.get(key)!r}"
               for key in sorted(set(flat_stored) | set(flat_current)) if flat_stored.get(key) != flat_current.get(key)]
    return "; ".join(changed) or "unreadable fingerprint"


class GracefulStop:
    """While active (main thread only), SIGINT/SIGTERM set a flag that the loop checks between steps, so an
    interruption checkpoints a consistent state; a second signal interrupts at once."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.requested: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signum
        logger.warning("interrupt received: stopping after the current step (interrupt again to stop now)")

    def __enter__(self) -> "GracefulStop":
        if self.enabled:
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _learning_rate(step: int, steps: int, config: GateTrainingConfig) -> float:
    if config.warmup_steps and step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    span = max(1, steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.learning_rate * (config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine)


def train_gates(
    model: Any,
    dataset: Any,
    config: GateTrainingConfig | None = None,
    *,
    tokenizer: Any = None,
    output_dir: str | os.PathLike | None = None,
    overwrite: bool = False,
    progress: bool = True,
    on_step: Callable[[int, float], None] | None = None,
    log_path: str | os.PathLike | None = None,
    evaluate: Callable[[dict[int, torch.Tensor]], dict[str, float]] | None = None,
    eval_every: int = 0,
    max_minutes: float | None = None,
) -> GateTrainingResult:
    """Distil PLAS gates for ``model`` from its own dense attention on ``dataset``; attach and return them.

    ``dataset``: token ids (a ``[N, seq_length]`` or 1-D tensor), sequences of ids, or strings (with
    ``tokenizer``); it is packed into ``config.seq_length`` sequences. The model's weights are not changed
    (parameters are frozen for the run and restored after). With ``output_dir`` the gate file
    (:data:`~hf_sparse.gate_files.GATE_FILENAME`) is written there, a checkpoint every ``config.checkpoint_every``
    steps and on SIGINT/SIGTERM (the run then raises ``KeyboardInterrupt``); calling again with the same
    arguments resumes and ends with the same gates as an uninterrupted run. ``on_step(step, loss)`` is called
    after every step.

    ``log_path``: one JSON line per step (step, tokens, loss, lr, seconds and tokens per second of this call) and
    per evaluation (appended to when resuming). ``evaluate(gates)`` (layer -> current gate) returns held-out
    metrics, logged before the first step of a fresh run (the initial gates: mean pooling) and every
    ``eval_every`` steps and after the last. ``max_minutes``: this call's wall-clock budget: the run stops before a
    step that would pass it, writes a checkpoint (with ``output_dir``) and returns ``stopped="deadline"`` without
    attaching gates; the same call resumes it.
    """
    if max_minutes is not None and not (isinstance(max_minutes, (int, float)) and max_minutes > 0):
        raise ValueError(f"max_minutes must be > 0 or None, got {max_minutes!r}")
    if not isinstance(eval_every, int) or eval_every < 0:
        raise ValueError(f"eval_every must be an integer >= 0, got {eval_every!r}")
    config = config if config is not None else GateTrainingConfig()
    refuse_tensor_parallel(model, "train_gates")
    spec = gate_spec(model, config.block_size)
    if config.seq_length % spec.block_size:
        raise ValueError(f"seq_length {config.seq_length} must be a multiple of block_size {spec.block_size}")
    layers = list(config.layers if config.layers is not None else spec.gated_layers)
    if not layers or min(layers) < 0 or max(layers) >= spec.num_layers:
        raise ValueError(f"layers {layers} must be a non-empty subset of 0..{spec.num_layers - 1}")
    sequences = _as_sequences(dataset, tokenizer, config)
    steps = (config.max_tokens // (config.seq_length * config.batch_size) if config.max_tokens is not None
             else sequences.shape[0] // config.batch_size)
    if steps < 1:
        raise ValueError(f"{config.max_tokens or sequences.numel()} tokens make no step of "
                         f"{config.batch_size} x {config.seq_length} tokens")
    order = _data_order(sequences.shape[0], steps, config.batch_size, config.seed)
    device = next(model.parameters()).device
    scale = attention_scale(model, spec.head_dim)
    sink_blocks = model_plas_config(model).sink_blocks if config.skip_forced_blocks else None

    gates = {layer: torch.nn.Parameter(torch.full(spec.shape, 1.0 / spec.block_size, device=device))
             for layer in layers}
    optimizer = torch.optim.Adam(list(gates.values()), lr=config.learning_rate, foreach=False)
    fingerprint = _fingerprint(config, spec, layers, sequences, steps, sink_blocks)
    checkpoint = Path(output_dir) / CHECKPOINT_FILENAME if output_dir is not None else None
    start, losses = 0, []
    if checkpoint is not None and checkpoint.exists():
        if overwrite:
            checkpoint.unlink()
        else:
            start, losses = _load_checkpoint(checkpoint, gates, optimizer, fingerprint)
            logger.info("resuming gate training from step %d of %d (%s)", start, steps, checkpoint)

    frozen = [(p, p.requires_grad) for p in model.parameters()]
    for parameter, _ in frozen:
        parameter.requires_grad_(False)
    was_training = model.training
    model.eval()
    layer_losses: dict[int, torch.Tensor] = {}

    def on_layer(layer: int, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor) -> None:
        with torch.enable_grad(), torch.autocast(device.type, enabled=False):
            loss = gate_distillation_loss(query, key, gates[layer], spec.block_size, scale, config.query_chunk,
                                          sink_blocks, config.target, config.objective, config.ranking_top_k)
            loss.backward()
        layer_losses[layer] = loss.detach()  # read once per step, not per layer

    tokens_per_step = config.batch_size * config.seq_length
    log = open(log_path, "a" if start else "w", encoding="utf-8") if log_path is not None else None
    run_start, last_step_seconds, stopped = _now(), 0.0, "done"

    def write(record: dict[str, Any]) -> None:
        if log is not None:
            log.write(json.dumps(record) + "\n")
            log.flush()

    def run_evaluation(done: int) -> None:
        value = evaluate({layer: parameter.detach().float() for layer, parameter in gates.items()})
        write({"step": done, "tokens": done * tokens_per_step, "eval": value})
        logger.info("held-out evaluation at step %d: %s", done, value)

    bar = tqdm(total=steps, initial=start, desc="train gates", unit="step", disable=not progress)
    step = start
    try:
        if evaluate is not None and start == 0:
            run_evaluation(0)
        with GracefulStop(checkpoint is not None) as stopper:
            for step in range(start, steps):
                elapsed = _now() - run_start
                if max_minutes is not None and elapsed + 1.1 * last_step_seconds > 60.0 * max_minutes:
                    stopped = "deadline"
                    if checkpoint is not None:
                        _save_checkpoint(checkpoint, step, gates, optimizer, losses, fingerprint)
                    logger.warning("gate training stopped at the deadline after step %d of %d%s", step, steps,
                                   f"; checkpoint {checkpoint}: run again to resume" if checkpoint else "")
                    break
                step_start = _now()
                optimizer.zero_grad(set_to_none=True)
                layer_losses.clear()
                batch = sequences[order[step]].to(device)
                probe_layers(model, batch, layers, on_layer)
                for group in optimizer.param_groups:
                    group["lr"] = _learning_rate(step, steps, config)
                optimizer.step()
                loss = float(torch.stack(list(layer_losses.values())).mean())
                losses.append(loss)
                done = step + 1
                now = _now()
                last_step_seconds = now - step_start
                rate = (done - start) * tokens_per_step / max(now - run_start, 1e-9)
                write({"step": done, "tokens": done * tokens_per_step, "loss": loss,
                       "lr": optimizer.param_groups[0]["lr"], "seconds": round(now - run_start, 3),
                       "tokens_per_second": round(rate, 1)})
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{rate:,.0f}")
                if evaluate is not None and (done == steps or (eval_every and done % eval_every == 0)):
                    run_evaluation(done)
                if on_step is not None:
                    on_step(done, loss)
                if checkpoint is not None and (stopper.requested is not None or done == steps or
                                               (config.checkpoint_every and done % config.checkpoint_every == 0)):
                    _save_checkpoint(checkpoint, done, gates, optimizer, losses, fingerprint)
                if stopper.requested is not None:
                    raise KeyboardInterrupt(f"gate training interrupted after step {done} of {steps}; "
                                            f"checkpoint {checkpoint}: run again to resume")
    finally:
        bar.close()
        if log is not None:
            log.close()
        for parameter, requires_grad in frozen:
            parameter.requires_grad_(requires_grad)
        model.train(was_training)

    trained = {layer: parameter.detach().float().clone() for layer, parameter in gates.items()}
    if stopped == "deadline":
        return GateTrainingResult(trained, losses, steps, steps * tokens_per_step, start, None, stopped)
    set_gates(model, trained)
    path = write_gate_file(trained, Path(output_dir) / GATE_FILENAME, spec) if output_dir is not None else None
    return GateTrainingResult(trained, losses, steps, steps * config.batch_size * config.seq_length, start, path)


# -- command line ---------------------------------------------------------------------------------------------
def add_train_gates_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``train-gates`` to the ``hf-sparse`` command's subparsers."""
    parser = subparsers.add_parser(
        "train-gates", help="distil PLAS gates from a model's dense attention on text files",
        description="Train PLAS gates (only the gates learn; the model is frozen) and write "
                    f"{GATE_FILENAME} to --out. Re-running the same command resumes an interrupted run.",
    )
    parser.add_argument("--model", default="default", help="local folder or Hub id; 'default' = embedded SmolLM2-135M")
    parser.add_argument("--long-context", nargs="?", const=True, default=None, metavar="ADAPTER",
                        help="with --model default: the long-context default model (YaRN and the shipped adapter, or "
                             "this adapter file; hf_sparse.tools.default_model.load_default_model(long_context=True))")
    parser.add_argument("--data", nargs="+", required=True,
                        help="text files, globs (** allowed) or folders; 'stdlib' = the standard library's package "
                             "sources (hf_sparse.tools.eval.stdlib_training_files)")
    parser.add_argument("--tokens", type=int, required=True, help="training tokens")
    parser.add_argument("--out", required=True, help="output folder (gate file and checkpoint)")
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--lr", type=float, default=GateTrainingConfig.learning_rate)
    parser.add_argument("--warmup-steps", type=int, default=GateTrainingConfig.warmup_steps)
    parser.add_argument("--block-size", type=int, default=None, help="default: the model's PLASConfig.block_size")
    parser.add_argument("--layers", default=None, help="comma-separated layer indices (default: all sparse layers)")
    parser.add_argument("--query-chunk", type=int, default=GateTrainingConfig.query_chunk,
                        help="queries whose dense logits the PyTorch (CPU) path materialises at once (bounds memory)")
    parser.add_argument("--target", choices=["max", "sum"], default=GateTrainingConfig.target,
                        help="pool the dense attention over a block by its max (default) or sum (its mass)")
    parser.add_argument("--objective", choices=list(OBJECTIVES), default=GateTrainingConfig.objective,
                        help="kl (default): KL to the pooled block distribution; ranking: Plackett-Luce loss of its "
                             "--ranking-top-k best blocks")
    parser.add_argument("--ranking-top-k", type=int, default=GateTrainingConfig.ranking_top_k)
    parser.add_argument("--include-forced", action="store_true",
                        help="distil over every causal block (skip_forced_blocks=False)")
    parser.add_argument("--checkpoint-every", type=int, default=GateTrainingConfig.checkpoint_every)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="model dtype; auto = bfloat16 on GPU, float32 on CPU (gates always train in float32)")
    parser.add_argument("--overwrite", action="store_true", help="discard an existing checkpoint in --out")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--log", default=None,
                        help="JSON-lines log: every step (loss, tokens/s) and held-out evaluation (default: "
                             "OUT/gate_training.log.jsonl)")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="held-out evaluation every N steps (and before the first and after the last): KL, top-1 "
                             "and recall of the gates against dense attention on held-out prose "
                             "(hf_sparse.tools.eval.held_out_sequences; 0 = none)")
    parser.add_argument("--eval-sequences", type=int, default=1, help="held-out sequences per evaluation")
    parser.add_argument("--eval-length", type=int, default=None, help="their tokens (default: --seq-length)")
    parser.add_argument("--eval-density", type=float, default=0.25, help="selection density of the recall metric")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="this call's time budget: stop cleanly before a step that would pass it (checkpoint "
                             "written; the same command resumes)")
    parser.set_defaults(run=_run_train_gates)
    return parser


def _run_train_gates(args: argparse.Namespace) -> int:

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        args.dtype, torch.bfloat16 if device.startswith("cuda") else torch.float32)
    if args.long_context is not None and args.model != "default":
        raise SystemExit("--long-context needs --model default (other models: load them with rope scaling yourself)")
    if args.long_context is not None:

        adapter = None if args.long_context is True else args.long_context
        model, tokenizer = load_default_model(dtype=dtype, device=device, long_context=True, adapter_path=adapter,
                                              max_length=max(args.seq_length, args.eval_length or 0))
        model.eval()
    else:
        if args.model == "default":

            path = str(default_model_dir())
        else:
            path = args.model
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
    layers = tuple(int(i) for i in args.layers.split(",") if i) if args.layers else None
    config = GateTrainingConfig(seq_length=args.seq_length, batch_size=args.batch_size, max_tokens=args.tokens,
                                learning_rate=args.lr, warmup_steps=args.warmup_steps, block_size=args.block_size,
                                layers=layers, query_chunk=args.query_chunk, checkpoint_every=args.checkpoint_every,
                                target=args.target, objective=args.objective, ranking_top_k=args.ranking_top_k,
                                skip_forced_blocks=not args.include_forced, seed=args.seed)

    patterns = [path for item in args.data for path in (stdlib_training_files() if item == "stdlib" else [item])]
    texts = read_text_files(patterns)
    evaluate = None
    if args.eval_every:

        held_out = held_out_sequences(tokenizer, args.eval_length or args.seq_length, args.eval_sequences).to(device)

        def evaluate(gates: dict[int, torch.Tensor]) -> dict[str, float]:
            metrics = evaluate_gates(model, held_out, gates, density=args.eval_density, layers=layers,
                                     block_size=args.block_size)
            return {name: getattr(metrics, name) for name in ("kl", "top1", "recall", "oracle_recall", "density")}

    times: list[float] = []
    log = args.log if args.log is not None else str(Path(args.out) / "gate_training.log.jsonl")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = train_gates(model, texts, config, tokenizer=tokenizer, output_dir=args.out, overwrite=args.overwrite,
                         progress=not args.no_progress, on_step=lambda step, loss: times.append(time.perf_counter()),
                         log_path=log, evaluate=evaluate, eval_every=args.eval_every, max_minutes=args.max_minutes)
    if result.stopped == "deadline":
        print(f"stopped at the --max-minutes deadline after {len(result.losses)} of {result.steps} "
              f"steps; checkpoint in {args.out}: run the same command again to resume; log {log}")
        return 0
    first, last = result.losses[0], result.losses[-1]
    print(f"trained {len(result.gates)} layer gate(s) on {result.tokens} tokens in {result.steps} steps: "
          f"loss {first:.4f} -> {last:.4f}; wrote {result.path}; log {log}")
    if len(times) > 1:
        rate = (len(times) - 1) * config.batch_size * config.seq_length / (times[-1] - times[0])
        print(f"this run: {len(times)} steps, {rate:,.0f} training tokens/s ({rate * 60 / 1e6:.2f}M per minute)")
    return 0
