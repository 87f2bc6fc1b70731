"""Quality at long context: does a sparse method keep what matters? Dense sdpa beside each method, per length.

For each length L of --lengths and each method of --methods (sdpa, the dense reference, always runs first):
* PPL: perplexity of the same --targets tokens of held-out prose (``hf_sparse.eval.stdlib_prose``, the Python
  reference's topic texts and the standard library's docstrings), the last ones before token --text-end, scored after
  the L-token window [text-end - L, text-end): every length scores the same tokens, so a method's rows are
  comparable across lengths. "/ dense": its ratio to sdpa's at that length.
* KL, top-1: next-token KL(sdpa || method) and top-1 agreement at --positions positions evenly spaced over the
  window after its first --skip tokens (at most half the window), from the same forward's logits (only the kept
  positions reach the LM head: ``logits_to_keep``, never [L, vocab] logits).
* pass keys: a 5-digit key hidden at each --depths of two haystacks, the demo's filler (``examples/generate.py``)
  and held-out prose (``stdlib_prose`` from token --text-end on: not the scored window), in an L-token prompt (the
  model's chat template when it has one); greedy generate() of --answer-tokens tokens through the method (sparse
  prefill and sparse decode); found when the key's digits appear in the answer.
* density: attended / causal key blocks of the scoring forward's sparse layers ("dense": every layer ran sdpa).
* budget (--budget): PPL <= 1.01x sdpa's, top-1 >= 0.97, every pass key sdpa finds found: pass or what failed.

Star Attention takes a context and a query apart: a prediction at a position p before the targets is that of a
forward over the window up to p whose last ``q = max(query_tokens, 1)`` tokens are the query (``q > 1``: the tri-shape,
those tokens dense over everything before them). Its PPL scores the targets in one query (from ``q - 1`` tokens
before their first prediction to the window's end, as ``studies/fidelity_curves.py`` scores Star's query positions):
a later target's query also holds the targets before it, up to ``--targets`` more dense tokens than a ``generate()``
ending there would have, so the PPL is that of a query of ``q`` plus the targets; at an earlier position p the
context (the window up to ``p - q + 1``) is encoded once without the dense fallback and cut back for each position,
then Star's own query phase runs the q tokens; where Star's rules would run that context dense, the prediction is
sdpa's. Its pass keys: ``hf_sparse.star_attention.generate`` with the question, or the last ``q`` tokens if more, as
the query and the haystack before it as context.

Output: the table last on stdout under a header (device, versions, date, model, rope scaling, texts); --json FILE
(atomic, rewritten after every row, so a run cut short keeps what it measured); --png FILE (PPL and top-1 against
length; needs matplotlib, the ``bench`` extra). --replot A.json B.json ... reprints earlier runs as one table (each
row judged against its own run's sdpa); --tradeoff FILE.png draws their top-1 against prefill density per length,
each point labelled with its TTFT speed-up from --speed (bench_generate.py --json files, same method names).

    python benchmarks/bench_quality.py --json quality.json --png quality.png               # GPU: 8K-128K
    python benchmarks/bench_quality.py --rope-scaling yarn --lengths 32768 65536 131072    # YaRN for 128K
    python benchmarks/bench_quality.py --lengths 1024 2048 --targets 128 --positions 128   # CPU, minutes
    python benchmarks/bench_quality.py --replot q1.json q2.json --tradeoff tradeoff.png --speed speed.json
"""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import math
import random
import sys
import textwrap
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

import hf_sparse
from hf_sparse import graphs, star_attention
from hf_sparse.cache import CACHE_KWARG
from hf_sparse.eval import filler_ids, held_out_sequences, passkey_found, passkey_prompt
from hf_sparse.methods.star import StarMethod

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (cell, environment, header, method_name, save_figure, sparse_config, table,  # noqa: E402
                     use_method, write_json)

DEFAULT_LENGTHS = [8192, 16384, 32768, 65536, 131072]
DEFAULT_METHODS = ["sdpa", "plas", "xattn", "star"]
HAYSTACKS = ("filler", "prose")


# -- arguments ----------------------------------------------------------------------------------------------------


def quality_method(value: str) -> str:
    """argparse type: "sdpa" or a plas / xattn / star name (benchmarks/_common.method_name)."""
    return method_name(value, dense=("sdpa",))


@dataclass
class Budget:
    """What a method must keep against dense sdpa at the same length; None = not checked."""

    ppl_ratio: float | None = 1.01
    top1: float | None = 0.97
    passkeys: bool = True  # every pass key sdpa finds

    @classmethod
    def parse(cls, text: str) -> "Budget":
        """``"ppl=1.01,top1=0.97,keys=dense"`` (any subset; a missing item is not checked) or ``"none"``."""
        if text.strip().lower() == "none":
            return cls(None, None, False)
        budget = cls(None, None, False)
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, _, value = item.partition("=")
            try:
                if name == "ppl":
                    budget.ppl_ratio = float(value)
                    if not budget.ppl_ratio >= 1.0:
                        raise ValueError("a PPL ratio >= 1")
                elif name == "top1":
                    budget.top1 = float(value)
                    if not 0.0 <= budget.top1 <= 1.0:
                        raise ValueError("a fraction in [0, 1]")
                elif name == "keys":
                    if value not in ("dense", "none"):
                        raise ValueError("'dense' or 'none'")
                    budget.passkeys = value == "dense"
                else:
                    raise ValueError("one of ppl, top1, keys")
            except ValueError as error:
                raise argparse.ArgumentTypeError(f"--budget item {item!r}: expected {error}") from None
        return budget

    def describe(self) -> str:
        parts = ([f"PPL <= {self.ppl_ratio:g}x sdpa's"] if self.ppl_ratio is not None else []) + \
                ([f"top-1 >= {self.top1:g}"] if self.top1 is not None else []) + \
                (["every pass key sdpa finds"] if self.passkeys else [])
        return ", ".join(parts) or "none"

    def failures(self, row: dict, dense: dict) -> list[str]:
        """What ``row`` misses of the budget against ``dense`` (the sdpa row of its length); [] = within it."""
        failed = []
        if self.ppl_ratio is not None and not row["ppl"] <= self.ppl_ratio * dense["ppl"]:
            failed.append("ppl")
        if self.top1 is not None and not row["top1"] >= self.top1:
            failed.append("top-1")
        if self.passkeys:
            for haystack in HAYSTACKS:
                for own, reference in zip(row["passkeys"][haystack], dense["passkeys"][haystack]):
                    if reference["found"] and not own["found"]:
                        failed.append(f"key {haystack} {own['depth']:g}")
        return failed


# -- metrics ------------------------------------------------------------------------------------------------------


def perplexity(log_probs: torch.Tensor, targets: torch.Tensor) -> float:
    """exp of the mean negative log-probability of ``targets`` ``[N]`` under ``log_probs`` ``[N, vocab]`` (row i
    predicts targets[i])."""
    if log_probs.dim() != 2 or targets.shape != log_probs.shape[:1]:
        raise ValueError(f"log_probs [N, vocab] and targets [N] expected, got {tuple(log_probs.shape)} and "
                         f"{tuple(targets.shape)}")
    picked = log_probs.float().gather(1, targets.to(log_probs.device).long()[:, None])
    return math.exp(-picked.mean().item())


def next_token_agreement(dense_log_probs: torch.Tensor, method_log_probs: torch.Tensor) -> tuple[float, float]:
    """(mean KL(dense || method), top-1 agreement) over the rows of two ``[N, vocab]`` log-probability tensors."""
    if dense_log_probs.shape != method_log_probs.shape or dense_log_probs.dim() != 2:
        raise ValueError(f"two [N, vocab] tensors of one shape expected, got {tuple(dense_log_probs.shape)} and "
                         f"{tuple(method_log_probs.shape)}")
    dense, method = dense_log_probs.float(), method_log_probs.float()
    kl = (dense.exp() * (dense - method)).sum(-1)
    top1 = (dense.argmax(-1) == method.argmax(-1)).float()
    return kl.mean().item(), top1.mean().item()


# -- the scored window -------------------------------------------------------------------------------------------


@dataclass
class Window:
    """One length's input: ``input_ids [1, L]`` and the positions whose logits are kept (sorted: the spread
    positions and the targets' predictions, united); ``spread`` / ``predictions`` index into ``kept``."""

    input_ids: torch.Tensor
    kept: torch.Tensor
    spread: torch.Tensor
    predictions: torch.Tensor
    targets: torch.Tensor
    skip: int

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]

    @property
    def first_prediction(self) -> int:
        """Position whose logits predict the first target: where Star's query starts."""
        return self.length - self.targets.numel() - 1


def scoring_window(text_ids: torch.Tensor, end: int, length: int, targets: int, positions: int, skip: int) -> Window:
    """The window ``text_ids[end - length: end]``: its last ``targets`` tokens are scored, and ``positions``
    positions evenly spaced over ``[min(skip, length // 2), length - 1)`` are compared with dense."""
    if not 0 < targets < length - 1:
        raise ValueError(f"--targets {targets} must be at least 1 and below the length {length} - 1")
    if end > text_ids.numel() or length > end:
        raise ValueError(f"a {length}-token window ending at token {end} needs {end} tokens of text "
                         f"(and a length <= --text-end); the text holds {text_ids.numel()}")
    ids = text_ids[end - length: end][None].long()
    skip = min(skip, length // 2)
    spread = torch.linspace(skip, length - 2, positions).round().long().unique()
    predictions = torch.arange(length - targets - 1, length - 1)
    kept = torch.cat([spread, predictions]).unique()  # sorted
    return Window(ids, kept, torch.searchsorted(kept, spread), torch.searchsorted(kept, predictions),
                  ids[0, length - targets:].clone(), skip)


# -- one method's predictions ------------------------------------------------------------------------------------


@dataclass
class Scored:
    """Log-probabilities ``[len(window.kept), vocab]`` of one method, and what its scoring forward did."""

    log_probs: torch.Tensor
    density: float | None = None  # attended / causal key blocks of the sparse layers; None: all ran dense
    dense_reason: str | None = None  # why the first dense layer ran dense, when any did
    scored: str = "one forward over the window"
    extra: dict = field(default_factory=dict)


def _recorded(recorder: Any, phase: str) -> tuple[float | None, str | None]:
    records = [record for record in recorder.records if record.phase == phase]
    sparse = [record for record in records if record.dense_reason is None]
    dense = [record.dense_reason for record in records if record.dense_reason is not None]
    return (recorder.density(phase) if sparse else None), (dense[0] if dense else None)


@torch.no_grad()
def score_method(model: Any, window: Window, method: str, dense: Scored | None = None) -> Scored:
    """``method``'s log-probabilities at the window's kept positions (``dense``: sdpa's, which Star needs)."""
    config = sparse_config(method)
    if isinstance(config, hf_sparse.StarConfig):
        if dense is None:
            raise ValueError("Star's scoring needs sdpa's log-probabilities (it is dense where Star's rules are)")
        return score_star(model, window, config, dense)
    use_method(model, method)
    device = model.device
    with hf_sparse.record_sparsity() as recorder:
        logits = model(window.input_ids.to(device), use_cache=False, logits_to_keep=window.kept.to(device)).logits
    density, reason = _recorded(recorder, "prefill")
    return Scored(torch.log_softmax(logits[0].float(), -1), density, reason)


def star_context_runs_dense(config: hf_sparse.StarConfig, context_length: int) -> bool:
    """Whether one-process Star runs a context of ``context_length`` tokens dense in every layer: the forward-wide
    rules of ``hf_sparse.plan.plan_star`` ("length", "pattern"), checked against Star itself by the tests."""
    if context_length < config.dense_threshold("context"):
        return True
    return (config.dense_above_density is not None
            and StarMethod(config).context_density(context_length) > config.dense_above_density)


@torch.no_grad()
def score_star(model: Any, window: Window, config: hf_sparse.StarConfig, dense: Scored) -> Scored:
    """Star's log-probabilities at the kept positions (the module docstring says what each one is). A prediction at
    a position p before the targets is that of a plain forward over the window up to p: its last ``q =
    max(config.query_tokens, 1)`` tokens are the query (dense over everything before them, the tri-shape of
    ``q > 1``), the rest the context; the targets are one query from ``q - 1`` tokens before their first
    prediction."""
    device = model.device
    ids = window.input_ids.to(device)
    tail = max(config.query_tokens, 1) - 1  # query tokens before the predicting one
    context = max(window.first_prediction - tail, 0)
    in_query = window.kept >= window.first_prediction
    log_probs = torch.empty_like(dense.log_probs)
    # The targets as the query of one forward, with the q - 1 tokens before their first prediction.
    hf_sparse.configure(model, replace(config, query_tokens=window.length - context))
    with hf_sparse.record_sparsity() as recorder:
        logits = model(ids, use_cache=False, logits_to_keep=window.kept[in_query].to(device)).logits
    log_probs[in_query.to(device)] = torch.log_softmax(logits[0].float(), -1)
    density, reason = _recorded(recorder, "context")
    # Earlier positions p: Star with the window up to p - q + 1 as context and the q tokens up to p as the query.
    early = [(row, int(position), max(int(position) - tail, 0)) for row, position in enumerate(window.kept.tolist())
             if position < window.first_prediction]
    as_dense = [row for row, _, start in early if star_context_runs_dense(config, start)]
    if as_dense:
        log_probs[as_dense] = dense.log_probs[as_dense]
    sparse = [item for item in early if not star_context_runs_dense(config, item[2])]
    if sparse:
        # Phase 1 once over the longest context needed, every layer sparse as Star runs such a context; a
        # shorter context's KV is its prefix (causal, blocks counted from the window's start).
        whole = replace(config, dense_below=0, dense_above_density=None)
        encoded = star_attention.encode_context(model, ids[:, :sparse[-1][2]], config=whole)
        hf_sparse.configure(model, config)
        for row, position, start in tqdm(sparse[::-1], desc="star: context positions", unit="pos", leave=False):
            for layer in encoded.cache.layers:  # longest first: each cut only shortens the cache
                layer.crop(start)
            positions = torch.arange(start, position + 1, device=device)[None]
            logits = model(ids[:, start: position + 1], position_ids=positions, use_cache=True,
                           logits_to_keep=1, **{CACHE_KWARG: encoded.cache}).logits
            log_probs[row] = torch.log_softmax(logits[0, -1].float(), -1)
        del encoded
    query = "one-token queries" if not tail else f"queries of the {tail + 1} tokens up to them"
    scored = (f"targets: query of {window.length - context} tokens after a context of {context}; earlier positions: "
              f"{query} after the window before them ({len(sparse)} through Star's phase 1, "
              f"{len(as_dense)} where Star runs dense)")
    return Scored(log_probs, density, reason, scored, {"star_context": context, "star_positions_phase1": len(sparse),
                                                       "star_positions_dense": len(as_dense)})


# -- pass keys ---------------------------------------------------------------------------------------------------


def passkey_key(seed: int, haystack: str, depth: float) -> str:
    """The 5-digit key hidden at ``depth`` of ``haystack``: the same at every length and for every method."""
    return str(random.Random(f"{seed}:{haystack}:{depth}").randint(10000, 99999))


def passkey_prompts(tokenizer: Any, haystacks: dict[str, torch.Tensor], length: int, depths: list[float],
                    seed: int) -> dict[str, list]:
    """The prompts of one length: one per haystack and depth."""
    return {name: [passkey_prompt(tokenizer, ids, length, depth, passkey_key(seed, name, depth)) for depth in depths]
            for name, ids in haystacks.items()}


@torch.no_grad()
def answer(model: Any, tokenizer: Any, prompt: Any, method: str, new_tokens: int) -> str:
    """Greedy ``new_tokens`` tokens through ``method`` (prefill and decode), decoded."""
    config = sparse_config(method)
    ids = prompt.input_ids.to(model.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    options = {"max_new_tokens": new_tokens, "do_sample": False, "pad_token_id": pad}
    if isinstance(config, hf_sparse.StarConfig):
        hf_sparse.configure(model, config)
        split = prompt.context_length  # the question is the query; with query_tokens q, at least the last q tokens
        split = max(min(split, ids.shape[1] - config.query_tokens), 1)
        output = star_attention.generate(model, ids[:, :split], ids[:, split:], config=config, **options)
    else:
        use_method(model, method)
        output = model.generate(ids, attention_mask=torch.ones_like(ids), **options)
    return tokenizer.decode(output[0, ids.shape[1]:], skip_special_tokens=True)


def passkey_results(model: Any, tokenizer: Any, prompts: dict[str, list], method: str, new_tokens: int) -> dict:
    results = {}
    for name, items in prompts.items():
        results[name] = []
        for prompt in items:
            text = answer(model, tokenizer, prompt, method, new_tokens)
            results[name].append({"depth": round(prompt.depth, 4), "key": prompt.key, "answer": text,
                                  "found": passkey_found(text, prompt.key)})
    return results


# -- the model ---------------------------------------------------------------------------------------------------


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    description: str
    rope: str


def _rope_description(config: Any) -> str:
    parameters = getattr(config, "rope_parameters", None) or {}
    kind = parameters.get("rope_type", "default")
    if kind == "default":
        return f"none (rope_theta {parameters.get('rope_theta', '?')}, trained to {config.max_position_embeddings})"
    details = ", ".join(f"{key} {value}" for key, value in sorted(parameters.items()) if key != "rope_type")
    return f"{kind} ({details})"


def rope_factor(spec: str, length: int) -> tuple[str, float | None]:
    """(kind, factor) of --rope-scaling at ``length``: ("none", None), ("yarn", factor) with factor None for
    "yarn" (from the length) or the number of "yarn:F"."""
    if spec == "none":
        return "none", None
    if spec in ("yarn", "yarn:per-length"):
        return "yarn", None
    if spec.startswith("yarn:"):
        return "yarn", float(spec.split(":", 1)[1])
    raise ValueError(spec)


def rope_spec(value: str) -> str:
    """argparse type of --rope-scaling."""
    try:
        kind, factor = rope_factor(value, 1)
        if factor is not None and not (math.isfinite(factor) and factor >= 1):
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected none, yarn, yarn:per-length or yarn:FACTOR (>= 1)")
    return value


def load_model(args: argparse.Namespace, length: int) -> LoadedModel:
    """The model of --model in eval mode, sdpa attention, its rope scaled as --rope-scaling asks for ``length``
    tokens (the longest of --lengths, or each length with yarn:per-length)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from hf_sparse import default_model

    dtype = getattr(torch, args.dtype)
    if args.long_context:
        loader = default_model.load_default_model
        parameters = inspect.signature(loader).parameters
        if "long_context" not in parameters:
            raise SystemExit("--long-context: hf_sparse.default_model.load_default_model has no long_context keyword "
                             "in this checkout (the long-context default model of issue 51 is not here yet)")
        extra = {"max_length": length} if "max_length" in parameters else {}
        if args.long_context != "shipped":
            if "adapter_path" not in parameters:
                raise SystemExit("--long-context FILE: load_default_model takes no adapter_path in this checkout")
            extra["adapter_path"] = args.long_context
        try:
            model, tokenizer = loader(attn_implementation="sdpa", dtype=dtype, device=args.device, long_context=True,
                                      **extra)
        except FileNotFoundError as error:
            raise SystemExit(f"--long-context: {error}") from None
        called = ", ".join(["long_context=True"] + [f"{key}={value}" for key, value in extra.items()])
        return LoadedModel(model.eval(), tokenizer, f"the long-context SmolLM2-135M-Instruct (load_default_model("
                           f"{called})), {args.dtype}", _rope_description(model.config))
    kind, factor = rope_factor(args.rope_scaling, length)
    if args.model == "default" and kind == "none":
        model, tokenizer = default_model.load_default_model(attn_implementation="sdpa", dtype=dtype, device=args.device)
        return LoadedModel(model.eval(), tokenizer, f"SmolLM2-135M-Instruct (hf_sparse.default_model), {args.dtype}",
                           _rope_description(model.config))
    path = default_model.default_model_dir() if args.model == "default" else Path(args.model)
    if not Path(path).is_dir():
        raise SystemExit(f"--model {args.model}: not 'default' nor a folder holding a transformers model")
    config = AutoConfig.from_pretrained(path)
    if kind == "yarn":
        try:
            from hf_sparse import rope_scaling
        except ImportError:
            raise SystemExit("--rope-scaling needs hf_sparse.rope_scaling, which this checkout lacks") from None
        if factor is None:
            rope_scaling.apply_yarn(config, length)
        else:
            rope_scaling.apply_yarn(config, factor=factor)
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(path)
    name = "SmolLM2-135M-Instruct (hf_sparse.default_model)" if args.model == "default" else str(path)
    return LoadedModel(model.to(args.device).eval(), tokenizer,
                       f"{name}, {config.num_hidden_layers} layers, {args.dtype}", _rope_description(model.config))


# -- the run -----------------------------------------------------------------------------------------------------


def _free(model: Any) -> None:
    graphs.release(model)  # a method's static cache and CUDA graphs
    if model.device.type == "cuda":  # caches in reference cycles hold GPU memory until collected
        gc.collect()
        torch.cuda.empty_cache()


def measure_length(model: Any, tokenizer: Any, window: Window, prompts: dict, methods: list[str], args: Any,
                   bar: Any, on_row: Any) -> None:
    """Every method's row at one length, sdpa's first; ``on_row(row)`` after each."""
    dense = None
    for method in methods:
        bar.set_postfix_str(f"{window.length} tokens, {method}")
        start = time.perf_counter()
        scored = score_method(model, window, method, dense)
        if dense is None:
            dense = scored
        kl, top1 = next_token_agreement(dense.log_probs[window.spread], scored.log_probs[window.spread])
        kl_targets, top1_targets = next_token_agreement(dense.log_probs[window.predictions],
                                                        scored.log_probs[window.predictions])
        ppl = perplexity(scored.log_probs[window.predictions], window.targets)
        passkeys = passkey_results(model, tokenizer, prompts, method, args.answer_tokens)
        _free(model)
        row = {"length": window.length, "method": method, "ppl": ppl, "kl": kl, "top1": top1,
               "kl_targets": kl_targets, "top1_targets": top1_targets, "positions": int(window.spread.numel()),
               "skip": window.skip,
               "density": scored.density, "dense_reason": scored.dense_reason, "scored": scored.scored,
               **scored.extra, "passkeys": passkeys,
               "found": {name: sum(item["found"] for item in passkeys[name]) for name in passkeys},
               "seconds": time.perf_counter() - start}
        on_row(row)
        bar.update(1)
        bar.write(f"{window.length:>7} {method}: PPL {ppl:.3f}  KL {kl:.4f}  top-1 {top1:.3f}  pass keys "
                  + ", ".join(f"{name} {row['found'][name]}/{len(passkeys[name])}" for name in passkeys)
                  + f"  ({row['seconds']:.0f} s)")


def judge(rows: list[dict], budget: Budget) -> None:
    """Add ``ppl_ratio`` and ``budget`` ("reference", "pass", or "fail: ...") to each row, against the sdpa row of
    its length."""
    dense = {row["length"]: row for row in rows if row["method"] == "sdpa"}
    for row in rows:
        reference = dense.get(row["length"])
        row["ppl_ratio"] = row["ppl"] / reference["ppl"] if reference else None
        if row["method"] == "sdpa":
            row["budget"] = "reference"
        elif reference is not None:
            failed = budget.failures(row, reference)
            row["budget"] = "pass" if not failed else "fail: " + ", ".join(failed)


def density_cell(row: dict) -> str:
    if row["density"] is None:
        return "dense"
    return cell(row["density"], ".3f")


def report_table(rows: list[dict]) -> str:
    def keys(name):
        return lambda row: f"{row['found'][name]}/{len(row['passkeys'][name])}"

    return table([("tokens", lambda row: str(row["length"])), ("method", lambda row: row["method"]),
                  ("PPL", lambda row: cell(row["ppl"], ".3f")),
                  ("/ dense", lambda row: cell(row.get("ppl_ratio"), ".3f", "x")),
                  ("KL", lambda row: cell(row["kl"], ".4f")), ("top-1", lambda row: cell(row["top1"], ".3f")),
                  ("keys filler", keys("filler")), ("keys prose", keys("prose")), ("density", density_cell),
                  ("budget", lambda row: row.get("budget", "-"))], rows)


def plot(rows: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--png needs matplotlib: pip install 'hf-sparse[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    figure, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for method in dict.fromkeys(row["method"] for row in rows):
        points = sorted((row["length"], row["ppl"], row["top1"]) for row in rows if row["method"] == method)
        lengths = [point[0] for point in points]
        axes[0].plot(lengths, [point[1] for point in points], marker="o", label=method)
        axes[1].plot(lengths, [point[2] for point in points], marker="o", label=method)
    axes[0].set_ylabel("perplexity of the fixed target tokens")
    perplexities = [row["ppl"] for row in rows]
    if max(perplexities) > 20 * min(perplexities):  # a model past its trained length: PPL in the thousands
        axes[0].set_yscale("log")
    axes[1].set_ylabel("top-1 agreement with sdpa (spread positions)")
    lengths = sorted({row["length"] for row in rows})
    for axis in axes:
        axis.set_xscale("log", base=2)
        axis.set_xticks(lengths, [f"{length // 1024}K" if length % 1024 == 0 else str(length) for length in lengths])
        axis.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        axis.set_xlabel("tokens of context (window length)")
        axis.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=8)
    save_figure(figure, path, "\n".join(textwrap.wrap(title, 160)))


def speed_ups(paths: list[str]) -> dict[tuple[int, str], float]:
    """``(length, method) -> TTFT speed-up over sdpa`` from ``bench_generate.py --json`` files (each ratio within
    its own run; a later file's figure replaces an earlier one's)."""
    speeds = {}
    for path in paths:
        with open(path) as handle:
            rows = json.load(handle)["rows"]
        dense = {row["length"]: row["ttft_s"] for row in rows if row["method"] == "sdpa"}
        for row in rows:
            if row["length"] in dense and row["method"] not in ("sdpa", "sdpa-static") and row.get("ttft_s"):
                speeds[(row["length"], row["method"])] = dense[row["length"]] / row["ttft_s"]
    return speeds


def plot_tradeoff(rows: list[dict], speeds: dict[tuple[int, str], float], path: str, title: str,
                  budget: Budget) -> None:
    """Top-1 agreement against prefill density, one panel per length with a sparse row: each method setting a
    point (filled: within the budget), labelled with its TTFT speed-up over sdpa where ``speeds`` has it."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--tradeoff needs matplotlib: pip install 'hf-sparse[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sparse = [row for row in rows if row["method"] != "sdpa" and row["density"] is not None]
    lengths = sorted({row["length"] for row in sparse})
    if not lengths:
        raise SystemExit("--tradeoff: no row ran sparse (every density is 'dense')")
    figure, axes = plt.subplots(1, len(lengths), figsize=(6.5 * len(lengths), 4.8), squeeze=False)
    colours = {"plas": "tab:blue", "xattn": "tab:orange", "star": "tab:green"}
    short = {"prefill_top_k=": "", "threshold=": "", "block_size=": "block ", "dense_layers=": "dense ", ":": ","}
    for axis, length in zip(axes[0], lengths):
        points = sorted((row for row in sparse if row["length"] == length), key=lambda row: row["top1"])
        for index, row in enumerate(points):
            family = row["method"].split("-")[0]
            passed = row.get("budget") == "pass"
            axis.scatter(row["density"], row["top1"], s=46, color=colours.get(family, "tab:gray"),
                         facecolors=colours.get(family, "tab:gray") if passed else "none", zorder=3)
            speed = speeds.get((length, row["method"]))
            setting = " ".join(row["method"].split("-")[1:]) or "(run's defaults)"
            for long, brief in short.items():
                setting = setting.replace(long, brief)
            label = setting + (f"  {speed:.2f}x" if speed else "")
            axis.annotate(label, (row["density"], row["top1"]), fontsize=6.5, xytext=(5, 5 if index % 2 else -8),
                          textcoords="offset points", color=colours.get(family, "tab:gray"))
        if budget.top1 is not None:
            axis.axhline(budget.top1, color="gray", linestyle="--", linewidth=1)
        axis.set_title(f"{length // 1024}K tokens" if length % 1024 == 0 else f"{length} tokens", fontsize=10)
        axis.set_xlabel("prefill density (attended / causal key blocks); label: setting, TTFT vs sdpa")
        axis.set_ylabel("top-1 agreement with sdpa")
        axis.grid(True, alpha=0.3)
    handles = [plt.Line2D([], [], marker="o", linestyle="", color=colour, label=family)
               for family, colour in colours.items()]
    handles.append(plt.Line2D([], [], marker="o", linestyle="", color="black", markerfacecolor="none",
                              label="outside the budget (filled: within)"))
    axes[0][0].legend(handles=handles, fontsize=7, loc="lower right")
    save_figure(figure, path, "\n".join(textwrap.wrap(title, 160)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--lengths", type=int, nargs="+", default=DEFAULT_LENGTHS)
    parser.add_argument("--methods", type=quality_method, nargs="+", default=DEFAULT_METHODS,
                        help="sdpa (the dense reference, run first even when not named), plas, xattn, star, or "
                             "NAME-field=value variants (as in bench_generate.py: plas-prefill_top_k=[40:48])")
    parser.add_argument("--model", default="default",
                        help="'default' (the embedded SmolLM2-135M-Instruct) or a local folder of a transformers "
                             "model and its tokenizer")
    parser.add_argument("--long-context", nargs="?", const="shipped", default=None, metavar="ADAPTER",
                        help="the long-context default model: load_default_model(long_context=True, max_length=the "
                             "longest length), with the shipped adapter or this adapter file")
    parser.add_argument("--rope-scaling", type=rope_spec, default="none",
                        help="none; yarn (factor = the longest length / the trained length, one model for every "
                             "row); yarn:per-length (that factor at each length, the model reloaded); yarn:FACTOR")
    parser.add_argument("--targets", type=int, default=1024, help="scored target tokens (PPL)")
    parser.add_argument("--positions", type=int, default=1024, help="positions of the KL / top-1 comparison")
    parser.add_argument("--skip", type=int, default=1024,
                        help="window tokens before the first compared position (at most half the window)")
    parser.add_argument("--text-end", type=int, default=None,
                        help="the targets end at this token of the prose (default: max(131072, longest length))")
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument("--answer-tokens", type=int, default=12, help="new tokens generated per pass key")
    parser.add_argument("--seed", type=int, default=0, help="seed of the pass keys' digits")
    parser.add_argument("--budget", type=Budget.parse, default=Budget(),
                        help="ppl=RATIO,top1=FRACTION,keys=dense|none (default ppl=1.01,top1=0.97,keys=dense) "
                             "or none")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="default bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--json", default=None, help="every number, rewritten after each row (atomic)")
    parser.add_argument("--png", default=None, help="PPL and top-1 against length (needs matplotlib)")
    parser.add_argument("--replot", metavar="JSON", nargs="+", default=None,
                        help="no run: the table (judged by --budget) and --png of earlier runs' --json (several: "
                             "their rows together, each judged against its own run's sdpa)")
    parser.add_argument("--tradeoff", metavar="PNG", default=None,
                        help="with --replot: top-1 against prefill density per length, every method setting a "
                             "point marked within / outside the budget, with its TTFT speed-up from --speed")
    parser.add_argument("--speed", metavar="JSON", nargs="+", default=[],
                        help="with --tradeoff: bench_generate.py --json files whose TTFT speed-ups (same length "
                             "and method name: a bare name means the defaults of the tree it ran on, so pair runs "
                             "of one set of defaults) label the points")
    args = parser.parse_args(argv)
    if (args.tradeoff or args.speed) and not args.replot:
        parser.error("--tradeoff and --speed draw earlier runs: give their JSON files with --replot")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if any(length < 2 for length in args.lengths):
        parser.error("--lengths must be at least 2 tokens")
    if args.targets < 1 or args.positions < 1 or args.skip < 0 or args.answer_tokens < 1:
        parser.error("--targets, --positions and --answer-tokens must be positive, --skip not negative")
    if any(not 0.0 <= depth <= 1.0 for depth in args.depths):
        parser.error("--depths are fractions of the haystack in [0, 1]")
    if args.long_context and (args.model != "default" or args.rope_scaling != "none"):
        parser.error("--long-context loads the default model with its own rope scaling: no --model / --rope-scaling")
    args.text_end = args.text_end or max(131072, *args.lengths)
    if max(args.lengths) > args.text_end:
        parser.error(f"--text-end {args.text_end} is shorter than the longest length {max(args.lengths)}")
    args.methods = ["sdpa"] + [method for method in dict.fromkeys(args.methods) if method != "sdpa"]
    return args


def merged_runs(paths: list[str], budget: Budget) -> dict:
    """The runs of ``paths`` (``--json`` files) as one: the first file's header, texts and settings, every
    file's rows (each judged against the sdpa row of its own file and length; one sdpa row per length kept)."""
    merged, runs = None, {}
    for path in paths:
        with open(path) as handle:
            data = json.load(handle)
        judge(data["rows"], budget)
        runs[f"{data['environment']['device']} {data['environment']['date'][:10]}"] = None
        if merged is None:
            merged = data
            continue
        dense = {row["length"] for row in merged["rows"] if row["method"] == "sdpa"}
        merged["rows"] += [row for row in data["rows"] if row["method"] != "sdpa" or row["length"] not in dense]
    merged["rows"].sort(key=lambda row: (row["length"], row["method"] != "sdpa"))
    merged["judged"] = True
    if len(paths) > 1:
        merged["title"] = (f"{len(paths)} runs ({'; '.join(runs)}) | {merged['model']} | texts and positions as "
                           f"each run's settings say")
    return merged


def report(data: dict, budget: Budget, png: str | None) -> None:
    """The table of a run's JSON ``data`` (rows judged against ``budget``), under its header and notes, last on
    stdout; the plot to ``png``."""
    rows, settings, texts = data["rows"], data["settings"], data["texts"]
    title = data.get("title") or data["header"].split(" | texts:")[0]  # "header": files written before 2026-11-28 01:00
    if not data.get("judged"):
        judge(rows, budget)
    if png:
        plot(rows, png, title)
    print(f"\n{title} | texts: " + "; ".join(f"{name}: {text}" for name, text in texts.items()))
    print(f"PPL: {texts['targets']}, scored after each length's window; KL(sdpa || method) and top-1 at "
          f"{settings['positions']} positions spread over each window past its first min({settings['skip']}, L/2) "
          f"tokens; pass keys: found / hidden at depths {', '.join(f'{depth:g}' for depth in settings['depths'])}, "
          f"{settings['answer_tokens']} greedy new tokens; density: attended / causal key blocks of the scoring "
          f"forward's sparse layers; budget: {budget.describe()}.")
    if any(isinstance(sparse_config(row["method"]), hf_sparse.StarConfig) for row in rows):
        print("star: PPL scores the targets as its query (context: the window before them); KL / top-1 at earlier "
              "positions are its predictions with the window up to each as the context and its token as the query.")
    print()
    print(report_table(rows))


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.replot:
        data = merged_runs(args.replot, args.budget)
        report(data, args.budget, args.png)
        if args.tradeoff:
            plot_tradeoff(data["rows"], speed_ups(args.speed), args.tradeoff, data["title"], args.budget)
        return data["rows"]
    lengths = sorted(set(args.lengths))
    per_length = args.rope_scaling == "yarn:per-length"
    loaded = load_model(args, max(lengths) if not per_length else lengths[0])
    tokenizer = loaded.tokenizer
    try:  # the scored window ends at --text-end; the prose haystack follows it
        prose_ids = held_out_sequences(tokenizer, args.text_end + max(lengths), 1)[0]
    except ValueError as error:
        raise SystemExit(f"{error}: --text-end {args.text_end} plus the longest length is more than it holds") from None
    haystacks = {"filler": filler_ids(tokenizer, max(lengths)), "prose": prose_ids[args.text_end:]}
    python = ".".join(map(str, sys.version_info[:3]))
    texts = {"targets": f"stdlib_prose (Python {python}: pydoc topics, then stdlib docstrings), the {args.targets} "
                        f"tokens before token {args.text_end}",
             "filler": "examples/generate.py's filler (hf_sparse.eval.PASSKEY_FILLER)",
             "prose haystack": f"stdlib_prose from token {args.text_end} on"}
    env = environment()
    rope = "yarn, factor = each length / the trained length" if per_length else loaded.rope
    data = {"environment": env, "title": f"{header(env)} | {loaded.description} | rope scaling: {rope}",
            "model": loaded.description, "rope_scaling": args.rope_scaling, "texts": texts,
            "budget": args.budget.describe(),
            "settings": {key: value for key, value in vars(args).items() if key != "budget"}, "rows": []}
    print(data["title"], file=sys.stderr)

    def save(row: dict) -> None:
        data["rows"].append({**row, "rope": loaded.rope})
        judge(data["rows"], args.budget)
        if args.json:
            write_json(args.json, data)

    with tqdm(total=len(lengths) * len(args.methods), desc="quality", unit="row") as bar:
        for length in lengths:
            if per_length and length != lengths[0]:
                _free(loaded.model)
                loaded = load_model(args, length)
            window = scoring_window(prose_ids, args.text_end, length, args.targets, args.positions, args.skip)
            prompts = passkey_prompts(tokenizer, haystacks, length, args.depths, args.seed)
            measure_length(loaded.model, tokenizer, window, prompts, args.methods, args, bar, save)
    report(data, args.budget, args.png)
    return data["rows"]


if __name__ == "__main__":
    main()
