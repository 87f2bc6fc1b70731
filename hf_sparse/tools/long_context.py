"""Training the long-context adapter (:func:`train_long_context`, ``hf-sparse train-long-context``): LoRA with
frozen base weights, the loss computed over chunks of the sequence (:func:`causal_lm_loss`), gradient checkpointing,
AdamW with warm-up and decay, budgets in steps, tokens and wall-clock minutes, checkpoints to resume from, a
JSON-lines log. The data is :mod:`hf_sparse.tools.long_documents`'; the file it writes, :mod:`hf_sparse.tools.adapter`'s.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ..gate_files import save_safetensors_atomic
from ..rope_scaling import (
    apply_yarn,
    check_context_length,
    rope_parameters,
    trained_length,
)
from .adapter import (
    LongContextAdapter,
    LoRALinear,
    adapter_from_lora,
    attach_lora,
    detach_lora,
    norm_modules,
    save_adapter,
)
from .default_model import DEFAULT_MODEL_ID, default_model_dir
from .gate_training import GracefulStop
from .long_documents import LongDocumentStream, TensorSequences, long_documents

logger = logging.getLogger(__name__)


CHECKPOINT_FORMAT = "hf_sparse.long_context_checkpoint"


# -- the loss -------------------------------------------------------------------------------------------------
def _chunk_loss(head: nn.Module, states: torch.Tensor, labels: torch.Tensor, softcap: float | None) -> torch.Tensor:
    logits = head(states).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """Mean next-token cross-entropy of ``input_ids`` ``[B, S]``, equal to ``model(input_ids,
    labels=input_ids).loss``, without ever holding the ``[S, vocab]`` logits: the decoder (final norm included)
    runs once, then the output head and the cross-entropy run over ``chunk`` positions at a time, each chunk under
    activation checkpointing when gradients are on (its float32 logits are recomputed in the backward pass)."""
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be [batch, length >= 2], got {tuple(input_ids.shape)}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    hidden = model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state
    head = model.get_output_embeddings()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    states, labels = hidden[:, :-1], input_ids[:, 1:]
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, labels.shape[1], chunk):
        part = (states[:, start: start + chunk], labels[:, start: start + chunk])
        if torch.is_grad_enabled():
            total = total + torch.utils.checkpoint.checkpoint(_chunk_loss, head, *part, softcap, use_reentrant=False)
        else:
            total = total + _chunk_loss(head, *part, softcap)
    return total / labels.numel()


# -- training -------------------------------------------------------------------------------------------------
@dataclass
class LongContextTrainingConfig:
    """Settings of :func:`train_long_context`.

    Attributes:
        rank, alpha: LoRA rank and scale (the update is ``alpha / rank * B @ A``).
        train_norms: train the RMSNorm weights too (tiny; LongLoRA found trainable norms help long-context LoRA).
        learning_rate: peak AdamW learning rate (LoRA factors and norms).
        weight_decay: AdamW weight decay of the LoRA factors (norms: none).
        warmup_steps: linear warm-up steps, then ``schedule`` decay to ``min_lr_ratio * learning_rate``.
        schedule: ``"cosine"`` or ``"linear"`` decay over the run's budget: ``max_steps``, else ``max_tokens``, else
            the time trained so far plus ``max_minutes`` (a run split over several calls should set ``max_tokens``
            or ``max_steps`` so the schedule is fixed).
        max_steps, max_tokens: the run's total budget (across resumed calls); the run stops when either is reached.
        max_minutes: this call's wall-clock budget: the run stops cleanly before a step that would pass it, writes
            its checkpoint and adapter, and a later call resumes. At least one of the three budgets must be set.
        sequences_per_step: sequences whose gradients are accumulated per optimizer step (one forward each).
        loss_chunk: positions per chunk of the output head and loss (:func:`causal_lm_loss`).
        max_grad_norm: gradient clipping (``None`` = none).
        gradient_checkpointing: recompute each decoder layer in the backward pass
            (``model.gradient_checkpointing_enable()``).
        autocast: bfloat16 autocast on CUDA (the weights keep their dtype; load the model in float32).
        checkpoint_every: steps between checkpoints (with a checkpoint path; also at the end and on a stop).
        eval_every: steps between calls of the ``evaluate`` hook (0 = only at the end, when given).
        seed: the LoRA initialisation.
    """

    rank: int = 16
    alpha: float = 32.0
    train_norms: bool = True
    learning_rate: float = 2e-4
    weight_decay: float = 0.0
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    schedule: str = "cosine"
    max_steps: int | None = None
    max_tokens: int | None = None
    max_minutes: float | None = None
    sequences_per_step: int = 1
    loss_chunk: int = 4096
    max_grad_norm: float | None = 1.0
    gradient_checkpointing: bool = True
    autocast: bool = True
    checkpoint_every: int = 100
    eval_every: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("rank", "sequences_per_step", "loss_chunk"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("max_steps", "max_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ValueError(f"max_minutes must be > 0 or None, got {self.max_minutes!r}")
        if self.max_steps is None and self.max_tokens is None and self.max_minutes is None:
            raise ValueError("set a budget: max_steps, max_tokens or max_minutes")
        if not self.alpha > 0 or not self.learning_rate > 0 or self.weight_decay < 0:
            raise ValueError("alpha and learning_rate must be > 0 and weight_decay >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.schedule not in ("cosine", "linear"):
            raise ValueError(f"schedule must be 'cosine' or 'linear', got {self.schedule!r}")
        if self.warmup_steps < 0 or self.checkpoint_every < 0 or self.eval_every < 0:
            raise ValueError("warmup_steps, checkpoint_every and eval_every must be >= 0")


@dataclass
class LongContextTrainingResult:
    """What :func:`train_long_context` did: the adapter (not merged: the model is left as it was), the run's
    totals (across resumed calls), this call's losses, seconds and throughput, why it stopped, and its files."""

    adapter: LongContextAdapter
    steps: int
    tokens: int
    losses: list[float]
    seconds: float
    tokens_per_second: float
    stopped: str
    resumed_from: int = 0
    path: Path | None = None
    checkpoint: Path | None = None
    evaluations: list[dict[str, Any]] = field(default_factory=list)


def _structure(config: LongContextTrainingConfig, lora_names: Sequence[str], norm_names: Sequence[str]) -> dict:
    return {"rank": config.rank, "alpha": float(config.alpha), "train_norms": config.train_norms,
            "lora": sorted(lora_names), "norms": sorted(norm_names)}


def _save_checkpoint(path: Path, wrappers: Mapping[str, LoRALinear], norms: Mapping[str, nn.Module],
                     optimizer: torch.optim.Optimizer, progress: Mapping[str, Any], structure: Mapping[str, Any],
                     data_state: Mapping[str, Any]) -> None:
    """LoRA factors, norms, AdamW moments, step/tokens/seconds and the data position in one safetensors file
    (replaced atomically)."""
    tensors: dict[str, torch.Tensor] = {}
    parameters = _named_parameters(wrappers, norms)
    adam_steps = {}
    for name, parameter in parameters.items():
        tensors[f"param.{name}"] = parameter.detach().float().cpu().contiguous().clone()
        state = optimizer.state.get(parameter)
        if state:
            tensors[f"adam.{name}.exp_avg"] = state["exp_avg"].detach().cpu().contiguous().clone()
            tensors[f"adam.{name}.exp_avg_sq"] = state["exp_avg_sq"].detach().cpu().contiguous().clone()
            adam_steps[name] = float(state["step"])
    metadata = {"format": CHECKPOINT_FORMAT, "format_version": "1", "progress": json.dumps(dict(progress)),
                "structure": json.dumps(dict(structure), sort_keys=True), "data": json.dumps(dict(data_state)),
                "adam_steps": json.dumps(adam_steps)}
    save_safetensors_atomic(tensors, path, metadata)
    logger.info("checkpoint at step %d written to %s", progress["step"], path)


def _load_checkpoint(path: Path, wrappers: Mapping[str, LoRALinear], norms: Mapping[str, nn.Module],
                     optimizer: torch.optim.Optimizer, structure: Mapping[str, Any], source: Any) -> dict[str, Any]:

    with safe_open(str(path), framework="pt", device="cpu") as handle:
        metadata = handle.metadata() or {}
        if metadata.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{path} is not a long-context training checkpoint")
        stored = json.loads(metadata["structure"])
        if stored != json.loads(json.dumps(dict(structure), sort_keys=True)):
            changed = [key for key in structure if stored.get(key) != json.loads(json.dumps(structure[key]))]
            raise ValueError(f"{path} was written by a run with another adapter layout ({', '.join(changed)} "
                             "differ): resume with the same model, rank, alpha and norm setting")
        source.load_state_dict(json.loads(metadata["data"]))
        adam_steps = json.loads(metadata["adam_steps"])
        with torch.no_grad():
            for name, parameter in _named_parameters(wrappers, norms).items():
                parameter.copy_(handle.get_tensor(f"param.{name}"))
                if name in adam_steps:
                    optimizer.state[parameter] = {
                        "step": torch.tensor(adam_steps[name], dtype=torch.float32),
                        "exp_avg": handle.get_tensor(f"adam.{name}.exp_avg").to(parameter.device),
                        "exp_avg_sq": handle.get_tensor(f"adam.{name}.exp_avg_sq").to(parameter.device),
                    }
        return json.loads(metadata["progress"])


def _named_parameters(wrappers: Mapping[str, LoRALinear], norms: Mapping[str, nn.Module]) -> dict[str, nn.Parameter]:
    named = {}
    for name, wrapper in wrappers.items():
        named[f"{name}.lora_A"], named[f"{name}.lora_B"] = wrapper.lora_A, wrapper.lora_B
    for name, module in norms.items():
        named[f"{name}.weight"] = module.weight
    return named


def _learning_rate(config: LongContextTrainingConfig, step: int, tokens: int, seconds: float,
                   seconds_before: float) -> float:
    """The learning rate of optimizer step ``step`` (0-based) given the run's progress so far."""
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    if config.max_steps is not None:
        progress = (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps)
    elif config.max_tokens is not None:
        progress = tokens / config.max_tokens
    else:
        progress = seconds / (seconds_before + 60.0 * config.max_minutes)
    progress = min(1.0, max(0.0, progress))
    decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if config.schedule == "cosine" else 1.0 - progress
    return config.learning_rate * (config.min_lr_ratio + (1.0 - config.min_lr_ratio) * decay)


def _checkpointing(model: nn.Module) -> bool:
    """Whether the model recomputes its layers in the backward pass (transformers 5.24 renamed "gradient
    checkpointing" to "activation checkpointing" and deprecated the old names; 5.17 has only those)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def _set_checkpointing(model: nn.Module, enabled: bool) -> None:
    if enabled:
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()


def _model_id(model: nn.Module) -> str:
    return str(getattr(model.config, "_name_or_path", "") or type(model).__name__)


def train_long_context(
    model: nn.Module,
    token_source: Any,
    seq_length: int | Sequence[int] | None = None,
    config: LongContextTrainingConfig | None = None,
    *,
    output: str | os.PathLike | None = None,
    checkpoint: str | os.PathLike | None = None,
    resume: str | os.PathLike | None = None,
    log_path: str | os.PathLike | None = None,
    evaluate: Callable[[nn.Module], float | Mapping[str, float]] | None = None,
    on_step: Callable[[Mapping[str, Any]], bool | None] | None = None,
    base_model: str | None = None,
    progress: bool = True,
) -> LongContextTrainingResult:
    """Train a long-context LoRA adapter for ``model`` (loaded with the rope scaling it is to be trained with, e.g.
    :func:`hf_sparse.rope_scaling.apply_yarn` on its config) on ``token_source`` and return it.

    ``token_source``: a :class:`LongDocumentStream` (its own sequence lengths, mixed lengths allowed), a
    :class:`TensorSequences`, or a token tensor (2-D rows, or 1-D cut into ``seq_length`` windows). The model's
    weights are frozen; every decoder projection gets a rank-``config.rank`` LoRA update (and the norms train when
    ``config.train_norms``); each step runs :func:`causal_lm_loss` under gradient checkpointing (bf16 autocast on
    CUDA), AdamW and the learning-rate schedule. On return the model is as it was (LoRA removed, norms restored);
    ``merge_adapter(model, result.adapter)`` applies the result.

    ``output``: write the adapter there (:func:`save_adapter`). ``checkpoint``: write the resumable state there
    every ``config.checkpoint_every`` steps and at the end (also on a deadline, SIGINT/SIGTERM or an ``on_step``
    stop); ``resume``: start from such a checkpoint (same model, adapter layout and data; the budgets are the
    run's totals). ``log_path``: one JSON line per step (step, tokens, loss, lr, seconds, tokens/s) and per
    evaluation, appended as the run goes. ``evaluate(model) -> float | dict``: called every ``config.eval_every``
    steps and at the end, on the model with the current update in eval mode without gradients. ``on_step(record)``:
    called after each step with its log record; returning True stops the run cleanly.
    """

    config = config if config is not None else LongContextTrainingConfig(max_steps=100)
    if isinstance(token_source, torch.Tensor):
        token_source = TensorSequences(token_source, seq_length if isinstance(seq_length, int) else None)
    for method in ("state_dict", "load_state_dict", "__next__"):
        if not hasattr(token_source, method):
            raise TypeError(f"token_source must be a LongDocumentStream, TensorSequences or tensor; "
                            f"{type(token_source).__name__} has no {method}()")
    lengths = list(getattr(token_source, "seq_lengths", []))
    if seq_length is not None and lengths:
        wanted = [seq_length] if isinstance(seq_length, int) else list(seq_length)
        if sorted(wanted) != sorted(lengths):
            raise ValueError(f"seq_length {seq_length} differs from the token source's lengths {lengths}")
    if lengths:
        check_context_length(model, max(lengths))
    device = next(model.parameters()).device
    if config.train_norms and any(p.dtype != torch.float32 for p in model.parameters()):
        logger.warning("the model's weights are not float32: trained norms update in their dtype (load the model "
                       "in float32; on CUDA the step runs under bfloat16 autocast anyway)")

    requires_grad = [(p, p.requires_grad) for p in model.parameters()]
    for parameter, _ in requires_grad:
        parameter.requires_grad_(False)
    norms = norm_modules(model) if config.train_norms else {}
    original_norms = {name: module.weight.detach().clone() for name, module in norms.items()}
    wrappers = attach_lora(model, config.rank, config.alpha, config.seed)
    for module in norms.values():
        module.weight.requires_grad_(True)
    lora_parameters = [p for w in wrappers.values() for p in (w.lora_A, w.lora_B)]
    groups = [{"params": lora_parameters, "weight_decay": config.weight_decay}]
    if norms:
        groups.append({"params": [m.weight for m in norms.values()], "weight_decay": 0.0})
    optimizer = torch.optim.AdamW(groups, lr=config.learning_rate, foreach=False)
    structure = _structure(config, list(wrappers), list(norms))
    checkpoint = Path(checkpoint) if checkpoint is not None else None

    step = tokens = 0
    seconds_before = 0.0
    if resume is not None:
        state = _load_checkpoint(Path(resume), wrappers, norms, optimizer, structure, token_source)
        step, tokens, seconds_before = int(state["step"]), int(state["tokens"]), float(state["seconds"])
        logger.info("resuming long-context training from step %d (%d tokens) of %s", step, tokens, resume)
    resumed_from = step
    log = open(log_path, "a" if resume is not None else "w", encoding="utf-8") if log_path is not None else None
    was_training, was_checkpointing = model.training, _checkpointing(model)
    if config.gradient_checkpointing and not was_checkpointing:
        _set_checkpointing(model, True)
    use_autocast = config.autocast and device.type == "cuda"
    losses: list[float] = []
    evaluations: list[dict[str, Any]] = []
    stopped = "budget"
    start = time.monotonic()
    call_tokens = 0
    last_step_seconds = 0.0

    def save_state() -> None:
        if checkpoint is not None:
            _save_checkpoint(checkpoint, wrappers, norms, optimizer,
                             {"step": step, "tokens": tokens, "seconds": seconds_before + time.monotonic() - start},
                             structure, token_source.state_dict())

    def run_evaluation() -> None:
        model.eval()
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
            value = evaluate(model)
        model.train()
        record = {"step": step, "tokens": tokens, "eval": value}
        evaluations.append(record)
        if log is not None:
            log.write(json.dumps(record) + "\n")
            log.flush()
        logger.info("evaluation at step %d: %s", step, value)

    bar = tqdm(total=config.max_steps, initial=step, desc="long-context LoRA", unit="step", disable=not progress)
    model.train()
    try:
        with GracefulStop(True) as stopper:
            while True:
                if config.max_steps is not None and step >= config.max_steps:
                    break
                if config.max_tokens is not None and tokens >= config.max_tokens:
                    break
                elapsed = time.monotonic() - start
                if config.max_minutes is not None and elapsed + 1.1 * last_step_seconds > 60.0 * config.max_minutes:
                    stopped = "deadline"
                    break
                step_start = time.monotonic()
                optimizer.zero_grad(set_to_none=True)
                step_loss, step_tokens = 0.0, 0
                for _ in range(config.sequences_per_step):
                    ids = next(token_source).to(device)[None]
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
                        loss = causal_lm_loss(model, ids, config.loss_chunk)
                    (loss / config.sequences_per_step).backward()
                    step_loss += float(loss.detach()) / config.sequences_per_step
                    step_tokens += ids.numel()
                if config.max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], config.max_grad_norm)
                lr = _learning_rate(config, step, tokens, seconds_before + time.monotonic() - start, seconds_before)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                optimizer.step()
                step, tokens = step + 1, tokens + step_tokens
                call_tokens += step_tokens
                losses.append(step_loss)
                now = time.monotonic()
                last_step_seconds = now - step_start
                rate = call_tokens / max(now - start, 1e-9)
                record = {"step": step, "tokens": tokens, "loss": step_loss, "lr": lr,
                          "seconds": round(seconds_before + now - start, 3), "tokens_per_second": round(rate, 1),
                          "seq_length": step_tokens // config.sequences_per_step}
                if log is not None:
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                bar.update(1)
                bar.set_postfix(loss=f"{step_loss:.4f}", tok_s=f"{rate:,.0f}")
                if evaluate is not None and config.eval_every and step % config.eval_every == 0:
                    run_evaluation()
                if checkpoint is not None and config.checkpoint_every and step % config.checkpoint_every == 0:
                    save_state()
                if on_step is not None and on_step(record):
                    stopped = "requested"
                    break
                if stopper.requested is not None:
                    stopped = "interrupted"
                    logger.warning("long-context training interrupted after step %d; checkpoint %s", step, checkpoint)
                    break
        seconds = time.monotonic() - start
        if evaluate is not None and (not evaluations or evaluations[-1]["step"] != step):
            run_evaluation()
        save_state()
        adapter = adapter_from_lora(wrappers, norms, rope=rope_parameters(model.config),
                                    base_model=base_model or _model_id(model),
                                    seq_lengths=lengths or [0], tokens_trained=tokens,
                                    training={**asdict(config), "steps": step})
    finally:
        bar.close()
        if log is not None:
            log.close()
        detach_lora(model)
        with torch.no_grad():
            for name, module in norms.items():
                module.weight.copy_(original_norms[name])
        for parameter, flag in requires_grad:
            parameter.requires_grad_(flag)
        if config.gradient_checkpointing and not was_checkpointing:
            _set_checkpointing(model, False)
        model.train(was_training)
    path = save_adapter(adapter, output) if output is not None else None
    return LongContextTrainingResult(adapter, step, tokens, losses, seconds, call_tokens / max(seconds, 1e-9),
                                     stopped, resumed_from, path, checkpoint if checkpoint is not None else None,
                                     evaluations)


def heldout_loss(model: nn.Module, sequences: Sequence[torch.Tensor], chunk: int = 4096) -> float:
    """Mean :func:`causal_lm_loss` over ``sequences`` (1-D token tensors), without gradients."""
    device = next(model.parameters()).device
    with torch.no_grad():
        values = [float(causal_lm_loss(model, ids.to(device)[None], chunk)) for ids in sequences]
    return sum(values) / len(values)


# -- command line ---------------------------------------------------------------------------------------------
def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(part) for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not lengths or min(lengths) < 2:
        raise argparse.ArgumentTypeError(f"sequence lengths must be >= 2, got {text!r}")
    return lengths


def add_train_long_context_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``train-long-context`` to the ``hf-sparse`` command's subparsers."""
    parser = subparsers.add_parser(
        "train-long-context", help="train the long-context LoRA adapter (YaRN, long documents)",
        description="Fine-tune a low-rank adapter of every decoder projection (and the norms) at long sequence "
                    "lengths with YaRN rope scaling, on installed packages' Python sources and an optional folder "
                    "of prose, and write the adapter file to --out. --max-minutes stops cleanly at a deadline "
                    "with a checkpoint that --resume continues from.")
    parser.add_argument("--model", default="default",
                        help="local folder or Hub id; 'default' = the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--data-dir", default=None, help="folder of prose (.txt / .txt.xz), one sub-folder a group")
    parser.add_argument("--no-packages", action="store_true", help="leave the site-packages Python sources out")
    parser.add_argument("--site-packages", default=None,
                        help="folder of installed packages to read (default: this interpreter's purelib)")
    parser.add_argument("--seq-length", type=_lengths, default=[32768],
                        help="tokens per sequence; comma-separated for mixed lengths (e.g. 32768,65536)")
    parser.add_argument("--out", required=True, help="adapter file to write (.safetensors)")
    parser.add_argument("--max-minutes", type=float, default=None, help="this call's wall-clock budget")
    parser.add_argument("--tokens", type=int, default=None, help="the run's total training tokens")
    parser.add_argument("--max-steps", type=int, default=None, help="the run's total optimizer steps")
    parser.add_argument("--resume", default=None, metavar="CKPT", help="continue from this checkpoint")
    parser.add_argument("--checkpoint", default=None,
                        help="checkpoint to write (default: --out with .checkpoint.safetensors)")
    parser.add_argument("--checkpoint-every", type=int, default=LongContextTrainingConfig.checkpoint_every)
    parser.add_argument("--log", default=None, help="JSON-lines log (default: --out with .log.jsonl)")
    parser.add_argument("--yarn-factor", type=float, default=None,
                        help="YaRN factor (default: the longest --seq-length over the trained length, rounded up)")
    parser.add_argument("--rank", type=int, default=LongContextTrainingConfig.rank)
    parser.add_argument("--alpha", type=float, default=LongContextTrainingConfig.alpha)
    parser.add_argument("--no-train-norms", action="store_true", help="keep the norms frozen")
    parser.add_argument("--lr", type=float, default=LongContextTrainingConfig.learning_rate)
    parser.add_argument("--warmup-steps", type=int, default=LongContextTrainingConfig.warmup_steps)
    parser.add_argument("--schedule", choices=["cosine", "linear"], default="cosine")
    parser.add_argument("--sequences-per-step", type=int, default=1)
    parser.add_argument("--loss-chunk", type=int, default=LongContextTrainingConfig.loss_chunk)
    parser.add_argument("--retrieval-share", type=float, default=0.1,
                        help="share of synthetic retrieval sequences (a number stated once and asked for at the end)")
    parser.add_argument("--prose-share", type=float, default=0.5,
                        help="share of the other sequences drawn from --data-dir when packages are used too")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="steps between held-out losses (documents held out of training by name hash)")
    parser.add_argument("--eval-sequences", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--base-model", default=None, help="base model id recorded in the adapter")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="weights' dtype (float32 default: on CUDA the steps run under bfloat16 autocast)")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(run=_run_train_long_context)
    return parser


def _sibling(path: str, suffix: str) -> str:
    stem = path[: -len(".safetensors")] if path.endswith(".safetensors") else path
    return stem + suffix


def _run_train_long_context(args: argparse.Namespace) -> int:

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    path = str(default_model_dir()) if args.model == "default" else args.model
    base_model = args.base_model or (DEFAULT_MODEL_ID if args.model == "default" or
                                     (Path(path) / "hf_sparse_source.txt").is_file() else args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model_config = AutoConfig.from_pretrained(path)
    longest = max(args.seq_length)
    try:
        if args.yarn_factor is not None:
            apply_yarn(model_config, factor=args.yarn_factor)
        elif longest > trained_length(model_config):
            apply_yarn(model_config, longest, whole=True)
    except ValueError as error:
        raise SystemExit(f"--yarn-factor / --seq-length: {error}") from None
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(path, config=model_config, dtype=dtype, attn_implementation="sdpa")
    model.to(device)
    try:
        config = LongContextTrainingConfig(
            rank=args.rank, alpha=args.alpha, train_norms=not args.no_train_norms, learning_rate=args.lr,
            warmup_steps=args.warmup_steps, schedule=args.schedule, max_steps=args.max_steps, max_tokens=args.tokens,
            max_minutes=args.max_minutes, sequences_per_step=args.sequences_per_step, loss_chunk=args.loss_chunk,
            checkpoint_every=args.checkpoint_every, eval_every=args.eval_every, seed=args.seed)
        documents = long_documents(args.data_dir, packages=not args.no_packages, site_packages=args.site_packages)
        stream = LongDocumentStream(documents, tokenizer, args.seq_length, seed=args.seed,
                                    prose_share=args.prose_share, retrieval_share=args.retrieval_share)
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(f"train-long-context: {error}") from None
    evaluate = None
    if args.eval_every:
        heldout = long_documents(args.data_dir, packages=not args.no_packages, site_packages=args.site_packages,
                                 split="heldout")
        if not heldout:
            raise SystemExit("--eval-every: no document is held out of these sources")
        held = LongDocumentStream(heldout, tokenizer, longest, seed=args.seed, retrieval_share=0.0)
        sequences = [next(held) for _ in range(args.eval_sequences)]
        evaluate = lambda m: heldout_loss(m, sequences, args.loss_chunk)  # noqa: E731
    counts = ", ".join(f"{len(docs)} {name} documents" for name, docs in documents.items())
    print(f"training on {counts}; rope {model.config.rope_parameters}", flush=True)
    try:
        result = train_long_context(
            model, stream, config=config, output=args.out,
            checkpoint=args.checkpoint or _sibling(args.out, ".checkpoint.safetensors"), resume=args.resume,
            log_path=args.log or _sibling(args.out, ".log.jsonl"), evaluate=evaluate, base_model=base_model,
            progress=not args.no_progress)
    except ValueError as error:  # a checkpoint of another run, a sequence too short for a retrieval question, ...
        raise SystemExit(f"train-long-context: {error}") from None
    first = f"{result.losses[0]:.4f} -> {result.losses[-1]:.4f}" if result.losses else "no step"
    print(f"stopped ({result.stopped}) at step {result.steps}, {result.tokens:,} tokens in all; this call: "
          f"{len(result.losses)} steps in {result.seconds:.1f} s, loss {first}; wrote {result.path} and "
          f"{result.checkpoint}")
    print(f"{result.tokens_per_second:,.0f} training tokens/s ({result.tokens_per_second * 60 / 1e6:.3f}M tokens/min)")
    return 0
