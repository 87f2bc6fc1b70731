"""Quality at long context against the model's own float32 answer: next-token figures on two held-out texts and a
RULER-style task suite, dense sdpa, its floors and each sparse method side by side, per length.

Rows, per length L of --lengths (default 16K, 32K, 64K, 128K):
* ``float32``: the same model in float32 with dense sdpa attention, the reference every figure is measured
  against. Its forward is a chunked prefill over a KV cache (``REFERENCE_CHUNK`` = 2,048 tokens a forward,
  ``reference_log_probs``): float32 attention stays within a few GB at 128K, whichever sdpa kernel PyTorch picks.
* ``sdpa``: dense attention in --dtype (bfloat16 on CUDA). Its distance from float32 is the **floor**: what rounding
  alone costs. It is also the dense row the budget compares PPL, accuracy and tasks with. The model is loaded in
  --dtype by the same loader as the float32 one (as a user loads it, not cast from the float32 copy), so the floor
  holds whatever that loader does in --dtype.
* ``all-blocks``: the sparse kernels at full density (PLAS selecting every block, no dense layer, no dense fallback:
  ``ALL_BLOCKS_CONFIG``): a second floor, the rounding of the sparse kernels themselves.
* each method of --methods (plas, xattn, star, or NAME-field=value variants as in bench_generate.py).

Texts (held out: neither the gates' nor the long-context adapter's training data; named in the header):
* ``prose``: ``hf_sparse.tools.eval.stdlib_prose`` (the Python reference's topic texts, then the standard library's
  docstrings), tokenized whole; the window ``[text-end - L, text-end)``.
* ``document``: one package's source read in order, a document of ``hf_sparse.tools.long_documents.long_documents(
  split="heldout")`` (--document, default ``code:torchgen#0``, PyTorch's code generator: its modules define the
  types and helpers its later modules use, so predicting a token often needs a definition from far back); the
  window ``[text-end - L, text-end)`` of its tokens. The held-out split is chosen by a hash of the document's name,
  so the adapter trained on none of it.

Figures per text (each with a seeded percentile-bootstrap interval, --confidence 95%, --resamples 1000, over the
positions; "paired": the resamples of the row's per-position differences from sdpa's, the same resamples for every
row):
* PPL of the --targets (2,048) tokens before token --text-end (the same tokens at every length); "/ dense": the
  ratio to sdpa's (paired: exp of the mean difference of the targets' log-likelihoods).
* at --positions (2,048) positions evenly spaced over the window after its first min(--skip, L/2) tokens (only
  the kept positions reach the LM head: ``logits_to_keep``, never [L, vocab] logits, and the figures are reduced
  from the kept log-probabilities in slices of rows):
  accuracy: the top-1 prediction is the text's next token; KL(float32 || row); top-1 disagreement: the top-1
  differs from float32's; excess KL and excess top-1 disagreement: the row's minus sdpa's (paired), i.e. above
  the floor.
* density: attended / causal key blocks of the scoring forward's sparse layers ("dense": every layer ran dense).

Tasks (``quality_tasks.py``, whose docstring says each one): needle, multi-key, multi-value, variable tracking,
common words, --instances (50) prompts of exactly L tokens per task and length, the same for every row (seeded by
--seed), the model's chat template when it has one; greedy generate() of each task's few tokens through the method
(sparse prefill and sparse decode); accuracy with Wilson's 95% interval. The float32 and all-blocks rows run no
tasks (they are floors of the next-token figures).

Star Attention takes a context and a query apart: a prediction at a position p before the targets is that of a
forward over the window up to p whose last ``q = max(query_tokens, 1)`` tokens are the query (``q > 1``: the tri-shape,
those tokens dense over everything before them). Its PPL scores the targets in one query (from ``q - 1`` tokens
before their first prediction to the window's end, as ``studies/fidelity_curves.py`` scores Star's query positions):
a later target's query also holds the targets before it, up to ``--targets`` more dense tokens than a ``generate()``
ending there would have, so the PPL is that of a query of ``q`` plus the targets; at an earlier position p the
context (the window up to ``p - q + 1``) is encoded once without the dense fallback and cut back for each position,
then Star's own query phase runs the q tokens; where Star's rules would run that context dense, the prediction is
sdpa's. Its tasks: ``hf_sparse.star_attention.generate`` with the question (and the chat template's tail), or the
last ``q`` tokens if more, as the query and the instruction and haystack before it as the context.

Budget (--budget, default ``ppl=1.01,accuracy=0.5,kl=0.02,top1=2,tasks=3``), each row against the sdpa row of its
length; a row passes when every item holds:
* on each text, point estimates: PPL <= 1.01x sdpa's; accuracy >= sdpa's - 0.5 points; excess KL <= 0.02 nats;
  excess top-1 disagreement <= 2 points (both against float32, above sdpa's floor);
* on each task: the task fails only when the whole 95% paired-bootstrap interval of (the row's mean score -
  sdpa's), over the instances, lies below -3 points (its upper end < -0.03): a shortfall the interval cannot tell
  apart from 3 points is not a failure.

Output: the tables last on stdout under a header (device, versions, date, model, rope scaling, texts); --json FILE
(atomic, rewritten after every row, so a run cut short keeps what it measured; per-instance answers and scores
too); --png FILE (excess top-1, excess KL and mean task accuracy against length; needs matplotlib, the ``bench``
extra). --replot A.json B.json ... reprints runs of this version as one table (each row judged against its own
run's sdpa); --tradeoff FILE.png draws their excess top-1 disagreement against prefill density per length, each
point labelled with its TTFT speed-up from --speed (bench_generate.py --json files, same method names).

    python benchmarks/bench_quality.py --long-context --json quality.json --png quality.png     # GPU: 16K-128K
    python benchmarks/bench_quality.py --rope-scaling yarn --lengths 32768 65536 131072         # YaRN for 128K
    python benchmarks/bench_quality.py --lengths 1024 --targets 128 --positions 128 --instances 1  # CPU, minutes
    python benchmarks/bench_quality.py --replot q1.json q2.json --tradeoff tradeoff.png --speed speed.json
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import textwrap
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

import hf_sparse
from hf_sparse import graphs, rope_scaling, star_attention
from hf_sparse.tools import default_model
from hf_sparse.cache import CACHE_KWARG
from hf_sparse.tools.eval import held_out_sequences
from hf_sparse.tools.long_documents import long_documents
from hf_sparse.methods.star import StarMethod

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality_tasks  # noqa: E402
from _common import (cell, environment, header, method_name, save_figure, sparse_config, table,  # noqa: E402
                     use_method, write_json)
from quality_stats import Estimate, bootstrap, wilson  # noqa: E402

DEFAULT_LENGTHS = [16384, 32768, 65536, 131072]
DEFAULT_METHODS = ["sdpa", "all-blocks", "plas", "xattn", "star"]
REFERENCE = "float32"
#: The sparse kernels at full density: PLAS selecting every block in prefill and decode, in every layer, with no
#: dense fallback (``hf_sparse.plan``'s rules never send it to sdpa).
ALL_BLOCKS_CONFIG = ("plas-dense_below=0-dense_layers=[]-noprobe-prefill_top_k_length=None"
                     "-prefill_top_k=[10000:10000]-decode_top_k=[10000:10000]")
DEFAULT_DOCUMENT = "code:torchgen#0"
#: Tokens per forward of the float32 reference (``reference_log_probs``).
REFERENCE_CHUNK = 2048


# -- arguments ----------------------------------------------------------------------------------------------------


def quality_method(value: str) -> str:
    """argparse type: "sdpa", "all-blocks" or a plas / xattn / star name (benchmarks/_common.method_name)."""
    return value if value == "all-blocks" else method_name(value, dense=("sdpa",))


def method_config_name(method: str) -> str:
    """The ``_common.sparse_config`` name a row's method runs: ``ALL_BLOCKS_CONFIG`` for "all-blocks"."""
    return ALL_BLOCKS_CONFIG if method == "all-blocks" else method


#: --budget items: (Budget field, its value per unit of the command line's, what the command line takes).
BUDGET_ITEMS = {"ppl": ("ppl_ratio", 1.0, "a PPL ratio >= 1"), "accuracy": ("accuracy_drop", 0.01, "points >= 0"),
                "kl": ("excess_kl", 1.0, "nats >= 0"), "top1": ("excess_top1", 0.01, "points >= 0"),
                "tasks": ("task_drop", 0.01, "points >= 0")}


@dataclass
class Budget:
    """What a row must keep against the sdpa row of its length (the module docstring says each rule); None = not
    checked. Shares (accuracy, top-1, tasks) are fractions here and points on the command line."""

    ppl_ratio: float | None = 1.01
    accuracy_drop: float | None = 0.005
    excess_kl: float | None = 0.02
    excess_top1: float | None = 0.02
    task_drop: float | None = 0.03

    @classmethod
    def parse(cls, text: str) -> "Budget":
        """``"ppl=1.01,accuracy=0.5,kl=0.02,top1=2,tasks=3"`` (any subset; a missing item is not checked; points for
        accuracy, top1 and tasks) or ``"none"``."""
        budget = cls(None, None, None, None, None)
        if text.strip().lower() == "none":
            return budget
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, _, value = item.partition("=")
            if name not in BUDGET_ITEMS:
                raise argparse.ArgumentTypeError(f"--budget item {item!r}: expected one of {', '.join(BUDGET_ITEMS)}")
            attribute, unit, expected = BUDGET_ITEMS[name]
            try:
                number = float(value)
            except ValueError:
                number = float("nan")
            if not math.isfinite(number) or number < (1.0 if name == "ppl" else 0.0):
                raise argparse.ArgumentTypeError(f"--budget item {item!r}: expected {expected}")
            setattr(budget, attribute, number * unit)
        return budget

    def describe(self) -> str:
        parts = [f"PPL <= {self.ppl_ratio:g}x sdpa's" if self.ppl_ratio is not None else "",
                 f"accuracy >= sdpa's - {100 * self.accuracy_drop:g} points" if self.accuracy_drop is not None else "",
                 f"excess KL <= {self.excess_kl:g}" if self.excess_kl is not None else "",
                 f"excess top-1 disagreement <= {100 * self.excess_top1:g} points" if self.excess_top1 is not None
                 else "",
                 f"no task's paired interval of (score - sdpa's) wholly below -{100 * self.task_drop:g} points"
                 if self.task_drop is not None else ""]
        return ", ".join(filter(None, parts)) or "none"

    def failures(self, row: dict, dense: dict, settings: dict) -> list[str]:
        """What ``row`` misses of the budget against ``dense`` (the sdpa row of its length); [] = within it. Adds
        each task's paired interval of (score - sdpa's) to ``row["tasks"][task]["change"]``."""
        failed = []
        for text, figures in row["texts"].items():
            if self.ppl_ratio is not None and figures["ppl_ratio"]["value"] > self.ppl_ratio:
                failed.append(f"PPL {text}")
            if self.accuracy_drop is not None and figures["accuracy_change"]["value"] < -self.accuracy_drop:
                failed.append(f"accuracy {text}")
            if self.excess_kl is not None and figures["excess_kl"]["value"] > self.excess_kl:
                failed.append(f"KL {text}")
            if self.excess_top1 is not None and figures["excess_top1"]["value"] > self.excess_top1:
                failed.append(f"top-1 {text}")
        for task, result in row["tasks"].items():
            reference = dense["tasks"].get(task)
            if reference is None or len(reference["scores"]) != len(result["scores"]):
                continue
            change = bootstrap(torch.tensor(result["scores"]) - torch.tensor(reference["scores"]),
                               settings["resamples"], settings["confidence"], settings["seed"])
            result["change"] = change.to_dict()
            if self.task_drop is not None and change.high < -self.task_drop:
                failed.append(task)
        return failed


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
    def spread_labels(self) -> torch.Tensor:
        """The text's next token at each spread position."""
        return self.input_ids[0, self.kept[self.spread] + 1]

    @property
    def first_prediction(self) -> int:
        """Position whose logits predict the first target: where Star's query starts."""
        return self.length - self.targets.numel() - 1


def scoring_window(text_ids: torch.Tensor, end: int, length: int, targets: int, positions: int, skip: int) -> Window:
    """The window ``text_ids[end - length: end]``: its last ``targets`` tokens are scored, and ``positions``
    positions evenly spaced over ``[min(skip, length // 2), length - 1)`` are compared with float32."""
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



# -- figures against float32 --------------------------------------------------------------------------------------


@torch.no_grad()
def reference_log_probs(reference: Any, window: Window, chunk: int = REFERENCE_CHUNK) -> torch.Tensor:
    """Float32 dense log-probabilities ``[len(window.kept), vocab]`` of ``reference`` (the model in float32) at the
    window's kept positions: the window's tokens ``chunk`` at a time over a KV cache (chunked prefill), the LM head
    over the kept positions only. Chunks bound the forward's memory: a float32 sdpa over grouped KV heads without
    a mask runs PyTorch's quadratic math kernel where its memory-efficient kernel lacks GQA (as in the torch
    versions of 2025-2026 before that kernel gained it), [heads, L, L] scores that do not fit at 64K; with a cache,
    each chunk's mask sends its sdpa to the memory-efficient kernel, and even the math kernel holds [heads, chunk,
    L] only."""
    use_method(reference, "sdpa")
    device = reference.device
    ids, kept = window.input_ids.to(device), window.kept.to(device)
    cache, parts = DynamicCache(config=reference.config), []
    for start in tqdm(range(0, window.length, chunk), desc=f"float32 reference, {window.length} tokens", unit="chunk",
                      leave=False):
        end = min(start + chunk, window.length)
        inside = kept[(kept >= start) & (kept < end)] - start
        logits = reference(ids[:, start:end], use_cache=True, logits_to_keep=inside if inside.numel() else 1,
                           **{CACHE_KWARG: cache}).logits
        if inside.numel():
            parts.append(torch.log_softmax(logits[0].float(), -1))
    return torch.cat(parts)


@dataclass
class PositionStats:
    """One row's per-position numbers on one window against the float32 reference (1-D float64, on the CPU)."""

    target_nll: torch.Tensor  # [targets]: -log p(target)
    kl: torch.Tensor  # [spread]: KL(float32 || row)
    disagree: torch.Tensor  # [spread]: 1 where the row's top-1 differs from float32's
    correct: torch.Tensor  # [spread]: 1 where the row's top-1 is the text's next token


@torch.no_grad()
def position_stats(reference: torch.Tensor, log_probs: torch.Tensor, window: Window, rows: int = 512) -> PositionStats:
    """``log_probs`` (a row's, ``[len(window.kept), vocab]``) against ``reference`` (float32's), ``rows`` positions
    at a time (a few [rows, vocab] float32 temporaries, whatever the number of positions)."""
    if reference.shape != log_probs.shape:
        raise ValueError(f"reference {tuple(reference.shape)} and row {tuple(log_probs.shape)} log-probabilities "
                         "differ in shape")
    device = log_probs.device
    labels = window.spread_labels.to(device)
    kl, disagree, correct = [], [], []
    for start in range(0, window.spread.numel(), rows):
        picked = window.spread[start: start + rows].to(device)
        truth, own = reference[picked].float(), log_probs[picked].float()
        kl.append((truth.exp() * (truth - own)).sum(-1))
        own_top = own.argmax(-1)
        disagree.append(own_top != truth.argmax(-1))
        correct.append(own_top == labels[start: start + rows])
    predictions = window.predictions.to(device)
    nll = -log_probs[predictions].float().gather(1, window.targets.to(device).long()[:, None])[:, 0]
    return PositionStats(nll.double().cpu(), *(torch.cat(parts).double().cpu() for parts in (kl, disagree, correct)))


def text_figures(stats: PositionStats, dense: PositionStats | None, floor: PositionStats | None,
                 settings: dict) -> dict:
    """A row's figures on one text (``Estimate`` dicts, shares as fractions). ``dense``: sdpa's numbers there, for
    the paired PPL ratio and accuracy change; ``floor``: the same, for the excess KL and top-1 disagreement (None:
    those figures are None)."""
    def estimate(values: torch.Tensor, transform: Any = None) -> dict:
        return bootstrap(values, settings["resamples"], settings["confidence"], settings["seed"], transform).to_dict()

    figures = {"ppl": estimate(stats.target_nll, torch.exp), "accuracy": estimate(stats.correct),
               "kl": estimate(stats.kl), "top1_disagreement": estimate(stats.disagree),
               "ppl_ratio": None, "accuracy_change": None, "excess_kl": None, "excess_top1": None,
               "targets": int(stats.target_nll.numel()), "positions": int(stats.kl.numel())}
    if dense is not None:
        figures.update(ppl_ratio=estimate(stats.target_nll - dense.target_nll, torch.exp),
                       accuracy_change=estimate(stats.correct - dense.correct))
    if floor is not None:
        figures.update(excess_kl=estimate(stats.kl - floor.kl), excess_top1=estimate(stats.disagree - floor.disagree))
    return figures


# -- tasks ----------------------------------------------------------------------------------------------------------


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


def task_prompts(suite: quality_tasks.TaskSuite, tasks: list[str], length: int, instances: int) -> dict[str, list]:
    """The prompts of one length: ``instances`` per task, the same for every method."""
    return {task: [suite.prompt(task, length, index) for index in range(instances)]
            for task in tqdm(tasks, desc=f"task prompts, {length} tokens", unit="task", leave=False)}


def task_results(model: Any, tokenizer: Any, prompts: dict[str, list], method: str, args: Any) -> dict:
    """Every task's answers and scores through ``method``, and its accuracy with Wilson's interval."""
    results = {}
    total = sum(len(items) for items in prompts.values())
    with tqdm(total=total, desc=f"tasks, {method}", unit="prompt", leave=False) as bar:
        for task, items in prompts.items():
            new_tokens = args.answer_tokens or quality_tasks.TASKS[task].answer_tokens
            answers, scores = [], []
            for prompt in items:
                answers.append(answer(model, tokenizer, prompt, method, new_tokens))
                scores.append(quality_tasks.score(prompt, answers[-1]))
                bar.update(1)
            share = sum(scores) / len(scores)
            results[task] = {"accuracy": wilson(share, len(scores), args.confidence).to_dict(), "scores": scores,
                             "answers": answers, "expected": [list(prompt.answers) for prompt in items]}
    return results


# -- texts ----------------------------------------------------------------------------------------------------------


@dataclass
class Text:
    """A held-out text: its 1-D token ids and what it is (the header's words)."""

    ids: torch.Tensor
    description: str


def held_out_document(name: str) -> Any:
    """The ``hf_sparse.tools.long_documents.Document`` called ``name`` of the held-out split (SystemExit naming those there
    are when it is not one)."""
    documents = [document for source in long_documents(split="heldout").values() for document in source]
    for document in documents:
        if document.name == name:
            return document
    raise SystemExit(f"--document {name!r} is not a held-out document of this environment's packages; held out: "
                     + ", ".join(document.name for document in documents))


def load_texts(tokenizer: Any, text_end: int, document: Any) -> dict[str, Text]:
    """The held-out prose and the held-out ``document`` (:func:`held_out_document`), tokenized; each holds at least
    ``text_end`` tokens."""
    try:
        prose = held_out_sequences(tokenizer, text_end, 1)[0]
    except ValueError as error:
        raise SystemExit(f"{error}: --text-end {text_end} is more than the prose holds") from None
    ids = torch.tensor(tokenizer(document.read(), add_special_tokens=False, verbose=False).input_ids)
    if ids.numel() < text_end:
        raise SystemExit(f"--document {document.name} holds {ids.numel()} tokens, fewer than --text-end {text_end}")
    python = ".".join(map(str, sys.version_info[:3]))
    return {"prose": Text(prose, f"stdlib_prose (Python {python}: pydoc topics, then stdlib docstrings), the window "
                                 f"ending at token {text_end}"),
            "document": Text(ids, f"{document.name} (long_documents(split='heldout'): {len(document.paths)} files of "
                                  f"{document.root or 'site-packages'} in path order, {ids.numel()} tokens), the "
                                  f"window ending at token {text_end}")}


# -- the model ---------------------------------------------------------------------------------------------------


@dataclass
class LoadedModel:
    """The rows' model (--dtype), its float32 reference (the same object when --dtype is float32), the tokenizer."""

    model: Any
    reference: Any
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


def _load_one(args: argparse.Namespace, length: int, dtype: torch.dtype) -> tuple[Any, Any, str]:
    """(model, tokenizer, description) of --model in ``dtype``, loaded as a user loads it (the loader casts, not
    this script), eval mode, sdpa attention, its rope scaled as --rope-scaling asks for ``length`` tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if args.long_context:
        extra = {"max_length": length}
        if args.long_context != "shipped":
            extra["adapter_path"] = args.long_context
        try:
            model, tokenizer = default_model.load_default_model(attn_implementation="sdpa", dtype=dtype,
                                                                device=args.device, long_context=True, **extra)
        except FileNotFoundError as error:
            raise SystemExit(f"--long-context: {error}") from None
        called = ", ".join(["long_context=True"] + [f"{key}={value}" for key, value in extra.items()])
        return model.eval(), tokenizer, f"the long-context SmolLM2-135M-Instruct (load_default_model({called}))"
    kind, factor = rope_factor(args.rope_scaling, length)
    if args.model == "default" and kind == "none":
        model, tokenizer = default_model.load_default_model(attn_implementation="sdpa", dtype=dtype, device=args.device)
        return model.eval(), tokenizer, "SmolLM2-135M-Instruct (hf_sparse.tools.default_model)"
    path = default_model.default_model_dir() if args.model == "default" else Path(args.model)
    if not Path(path).is_dir():
        raise SystemExit(f"--model {args.model}: not 'default' nor a folder holding a transformers model")
    config = AutoConfig.from_pretrained(path)
    if kind == "yarn":
        if factor is None:
            rope_scaling.apply_yarn(config, length)
        else:
            rope_scaling.apply_yarn(config, factor=factor)
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(path)
    name = "SmolLM2-135M-Instruct (hf_sparse.tools.default_model)" if args.model == "default" else str(path)
    return model.to(args.device).eval(), tokenizer, f"{name}, {config.num_hidden_layers} layers"


def load_model(args: argparse.Namespace, length: int) -> LoadedModel:
    """The model in --dtype and in float32, for ``length`` tokens (the longest of --lengths, or each length with
    yarn:per-length)."""
    reference, tokenizer, description = _load_one(args, length, torch.float32)
    model = reference if args.dtype == "float32" else _load_one(args, length, getattr(torch, args.dtype))[0]
    return LoadedModel(model, reference, tokenizer, f"{description}, {args.dtype} against float32",
                       _rope_description(model.config))


# -- the run -----------------------------------------------------------------------------------------------------


def _free(model: Any) -> None:
    graphs.release(model)  # a method's static cache and CUDA graphs
    if model.device.type == "cuda":  # caches in reference cycles hold GPU memory until collected
        gc.collect()
        torch.cuda.empty_cache()


def _settings(args: Any) -> dict:
    return {"resamples": args.resamples, "confidence": args.confidence, "seed": args.seed}


def measure_length(loaded: LoadedModel, windows: dict[str, Window], prompts: dict[str, list], methods: list[str],
                   args: Any, bar: Any, on_row: Any) -> None:
    """Every row of one length: float32 and sdpa (computed first), then each method; ``on_row(row)`` after each."""
    model, settings = loaded.model, _settings(args)
    length = next(iter(windows.values())).length
    reference = {name: reference_log_probs(loaded.reference, window) for name, window in windows.items()}
    dense_scored, dense_stats = {}, {}
    for method in methods:
        bar.set_postfix_str(f"{length} tokens, {method}")
        start = time.perf_counter()
        texts = {}
        for name, window in windows.items():
            scored = score_method(model, window, method_config_name(method), dense_scored.get(name))
            stats = position_stats(reference[name], scored.log_probs, window)
            if method == "sdpa":
                dense_scored[name], dense_stats[name] = scored, stats
            texts[name] = {**text_figures(stats, dense_stats[name], dense_stats[name], settings),
                           "density": scored.density, "dense_reason": scored.dense_reason, "scored": scored.scored,
                           **scored.extra}
        if method == "sdpa":  # float32 against itself, its PPL and accuracy against sdpa's
            own = {name: {**text_figures(position_stats(reference[name], reference[name], window), dense_stats[name],
                                         None, settings),
                          "density": None, "dense_reason": "float32 sdpa",
                          "scored": f"prefill in chunks of {REFERENCE_CHUNK} tokens over a KV cache"}
                   for name, window in windows.items()}
            on_row({"length": length, "method": REFERENCE, "config": None, "dtype": "float32", "texts": own,
                    "density": None, "tasks": {}, "seconds": 0.0})
        tasks = (task_results(model, loaded.tokenizer, prompts, method_config_name(method), args)
                 if prompts and method != "all-blocks" else {})
        _free(model)
        row = {"length": length, "method": method,
               "config": method_config_name(method) if method != "sdpa" else None, "dtype": args.dtype,
               "texts": texts, "density": texts["prose"]["density"], "tasks": tasks,
               "seconds": time.perf_counter() - start}
        on_row(row)
        bar.update(1)
        bar.write(f"{length:>7} {method}: " + summary_line(row))


def summary_line(row: dict) -> str:
    parts = []
    for name, figures in row["texts"].items():
        excess = ""
        if figures["excess_kl"] is not None:
            excess = (f", excess KL {figures['excess_kl']['value']:+.4f}, excess top-1 "
                      f"{100 * figures['excess_top1']['value']:+.2f} pts")
        parts.append(f"{name} PPL {figures['ppl']['value']:.3f}, accuracy {100 * figures['accuracy']['value']:.1f}%"
                     + excess)
    if row["tasks"]:
        parts.append("tasks " + " ".join(f"{task} {100 * result['accuracy']['value']:.0f}%"
                                         for task, result in row["tasks"].items()))
    return "; ".join(parts) + f" ({row['seconds']:.0f} s)"


def judge(rows: list[dict], budget: Budget, settings: dict) -> None:
    """Add ``budget`` ("reference", "pass", or "fail: ...") to each row, against the sdpa row of its length."""
    dense = {row["length"]: row for row in rows if row["method"] == "sdpa"}
    for row in rows:
        reference = dense.get(row["length"])
        if row["method"] == REFERENCE:
            row["budget"] = "reference (float32)"
        elif row["method"] == "sdpa":
            row["budget"] = "reference"
        elif reference is not None:
            failed = budget.failures(row, reference, settings)
            row["budget"] = "pass" if not failed else "fail: " + ", ".join(failed)


# -- the report --------------------------------------------------------------------------------------------------


def estimate_cell(data: dict | None, spec: str, scale: float = 1.0) -> str:
    """``value [low, high]`` of an ``Estimate`` dict, times ``scale``; "-" for none."""
    if data is None:
        return "-"
    estimate = Estimate.from_dict(data).scaled(scale)
    return f"{estimate.value:{spec}} [{estimate.low:{spec}}, {estimate.high:{spec}}]"


def density_cell(density: float | None) -> str:
    return "dense" if density is None else cell(density, ".3f")


def figures_table(rows: list[dict]) -> str:
    """One line per row and text: the next-token figures."""
    lines = [{"row": row, "text": name, **figures} for row in rows for name, figures in row["texts"].items()]
    return table([("tokens", lambda line: str(line["row"]["length"])), ("method", lambda line: line["row"]["method"]),
                  ("text", lambda line: line["text"]), ("PPL", lambda line: estimate_cell(line["ppl"], ".3f")),
                  ("/ dense", lambda line: estimate_cell(line["ppl_ratio"], ".4f")),
                  ("accuracy %", lambda line: estimate_cell(line["accuracy"], ".1f", 100)),
                  ("KL vs float32", lambda line: estimate_cell(line["kl"], ".4f")),
                  ("excess KL", lambda line: estimate_cell(line["excess_kl"], "+.4f")),
                  ("top-1 differs %", lambda line: estimate_cell(line["top1_disagreement"], ".2f", 100)),
                  ("excess top-1 %", lambda line: estimate_cell(line["excess_top1"], "+.2f", 100)),
                  ("density", lambda line: density_cell(line["density"]))], lines)


def tasks_table(rows: list[dict]) -> str:
    """One line per row: each task's accuracy (%, Wilson's interval), the prose forward's density, the budget."""
    tasks = list(dict.fromkeys(task for row in rows for task in row["tasks"]))

    def accuracy(task):
        return lambda row: estimate_cell(row["tasks"][task]["accuracy"], ".0f", 100) if task in row["tasks"] else "-"

    return table([("tokens", lambda row: str(row["length"])), ("method", lambda row: row["method"])]
                 + [(quality_tasks.TASKS[task].title if task in quality_tasks.TASKS else task, accuracy(task))
                    for task in tasks]
                 + [("density", lambda row: density_cell(row["density"])),
                    ("budget", lambda row: row.get("budget", "-"))], rows)


def _worst(row: dict, key: str) -> float | None:
    values = [figures[key]["value"] for figures in row["texts"].values() if figures.get(key) is not None]
    return max(values) if values else None


def plot(rows: list[dict], path: str, title: str) -> None:
    """Excess top-1 disagreement and excess KL (each text) and the mean task accuracy against length."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--png needs matplotlib: pip install 'hf-sparse[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    figure, axes = plt.subplots(1, 3, figsize=(17, 4.4))
    styles = {"prose": "-", "document": "--"}
    for index, method in enumerate(dict.fromkeys(row["method"] for row in rows if row["method"] != REFERENCE)):
        colour = f"C{index}"
        own = sorted((row for row in rows if row["method"] == method), key=lambda row: row["length"])
        for name in dict.fromkeys(text for row in own for text in row["texts"]):
            for axis, key, scale in ((axes[0], "excess_top1", 100), (axes[1], "excess_kl", 1)):
                points = [(row["length"], Estimate.from_dict(row["texts"][name][key]).scaled(scale)) for row in own
                          if name in row["texts"] and row["texts"][name][key] is not None]
                if points:
                    lengths = [length for length, _ in points]
                    values = [estimate.value for _, estimate in points]
                    errors = [[estimate.value - estimate.low for _, estimate in points],
                              [estimate.high - estimate.value for _, estimate in points]]
                    axis.errorbar(lengths, values, yerr=errors, marker="o", capsize=3, color=colour,
                                  linestyle=styles.get(name, ":"), label=f"{method} ({name})")
        scored = [row for row in own if row["tasks"]]
        if scored:
            means = [100 * sum(result["accuracy"]["value"] for result in row["tasks"].values()) / len(row["tasks"])
                     for row in scored]
            axes[2].plot([row["length"] for row in scored], means, marker="o", color=colour, label=method)
    axes[0].set_ylabel("excess top-1 disagreement with float32 (points over sdpa's)")
    axes[1].set_ylabel("excess KL(float32 || method) over sdpa's (nats)")
    axes[2].set_ylabel("mean task accuracy (%)")
    lengths = sorted({row["length"] for row in rows})
    for axis in axes:
        axis.set_xscale("log", base=2)
        axis.set_xticks(lengths, [f"{length // 1024}K" if length % 1024 == 0 else str(length) for length in lengths])
        axis.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        axis.set_xlabel("tokens of context (window length)")
        axis.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=7)
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
    """Excess top-1 disagreement (the worse text's) against prefill density (the prose forward's), one panel per
    length with a sparse row: each method setting a point (filled: within the budget), labelled with its TTFT
    speed-up over sdpa where ``speeds`` has it."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--tradeoff needs matplotlib: pip install 'hf-sparse[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sparse = [row for row in rows if row["method"] not in ("sdpa", REFERENCE) and row["density"] is not None]
    lengths = sorted({row["length"] for row in sparse})
    if not lengths:
        raise SystemExit("--tradeoff: no row ran sparse (every density is 'dense')")
    figure, axes = plt.subplots(1, len(lengths), figsize=(6.5 * len(lengths), 4.8), squeeze=False)
    colours = {"plas": "tab:blue", "xattn": "tab:orange", "star": "tab:green", "all-blocks": "tab:gray"}
    short = {"prefill_top_k=": "", "threshold=": "", "block_size=": "block ", "dense_layers=": "dense ", ":": ","}
    for axis, length in zip(axes[0], lengths):
        points = sorted((row for row in sparse if row["length"] == length), key=lambda row: _worst(row, "excess_top1"))
        for index, row in enumerate(points):
            family = row["method"] if row["method"] == "all-blocks" else row["method"].split("-")[0]
            passed = row.get("budget") == "pass"
            excess = 100 * _worst(row, "excess_top1")
            axis.scatter(row["density"], excess, s=46, color=colours.get(family, "tab:gray"),
                         facecolors=colours.get(family, "tab:gray") if passed else "none", zorder=3)
            speed = speeds.get((length, row["method"]))
            setting = family if family == "all-blocks" else " ".join(row["method"].split("-")[1:]) or "defaults"
            for long, brief in short.items():
                setting = setting.replace(long, brief)
            label = setting + (f"  {speed:.2f}x" if speed else "")
            axis.annotate(label, (row["density"], excess), fontsize=6.5, xytext=(5, 5 if index % 2 else -8),
                          textcoords="offset points", color=colours.get(family, "tab:gray"))
        if budget.excess_top1 is not None:
            axis.axhline(100 * budget.excess_top1, color="gray", linestyle="--", linewidth=1)
        axis.set_title(f"{length // 1024}K tokens" if length % 1024 == 0 else f"{length} tokens", fontsize=10)
        axis.set_xlabel("prefill density (attended / causal key blocks); label: setting, TTFT vs sdpa")
        axis.set_ylabel("excess top-1 disagreement with float32 (points)")
        axis.grid(True, alpha=0.3)
    handles = [plt.Line2D([], [], marker="o", linestyle="", color=colour, label=family)
               for family, colour in colours.items()]
    handles.append(plt.Line2D([], [], marker="o", linestyle="", color="black", markerfacecolor="none",
                              label="outside the budget (filled: within)"))
    axes[0][0].legend(handles=handles, fontsize=7, loc="upper right")
    save_figure(figure, path, "\n".join(textwrap.wrap(title, 160)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--lengths", type=int, nargs="+", default=DEFAULT_LENGTHS)
    parser.add_argument("--methods", type=quality_method, nargs="+", default=DEFAULT_METHODS,
                        help="sdpa (the dense reference, run first even when not named), all-blocks (the sparse "
                             "kernels at full density), plas, xattn, star, or NAME-field=value variants (as in "
                             "bench_generate.py: plas-prefill_top_k=[40:48])")
    parser.add_argument("--model", default="default",
                        help="'default' (the embedded SmolLM2-135M-Instruct) or a local folder of a transformers "
                             "model and its tokenizer")
    parser.add_argument("--long-context", nargs="?", const="shipped", default=None, metavar="ADAPTER",
                        help="the long-context default model: load_default_model(long_context=True, max_length=the "
                             "longest length), with the shipped adapter or this adapter file")
    parser.add_argument("--rope-scaling", type=rope_spec, default="none",
                        help="none; yarn (factor = the longest length / the trained length, one model for every "
                             "row); yarn:per-length (that factor at each length, the model reloaded); yarn:FACTOR")
    parser.add_argument("--targets", type=int, default=2048, help="scored target tokens (PPL)")
    parser.add_argument("--positions", type=int, default=2048,
                        help="positions of the accuracy, KL and top-1 figures")
    parser.add_argument("--skip", type=int, default=1024,
                        help="window tokens before the first compared position (at most half the window)")
    parser.add_argument("--text-end", type=int, default=None,
                        help="the windows end at this token of each text (default: max(131072, longest length))")
    parser.add_argument("--document", default=DEFAULT_DOCUMENT,
                        help="the held-out document (a name of hf_sparse.tools.long_documents.long_documents("
                             "split='heldout'); default %(default)s)")
    parser.add_argument("--tasks", nargs="+", choices=list(quality_tasks.TASKS), default=list(quality_tasks.TASKS),
                        help="the tasks to run (default: all)")
    parser.add_argument("--instances", type=int, default=50, help="prompts per task and length (0: no tasks)")
    parser.add_argument("--answer-tokens", type=int, default=None,
                        help="greedy new tokens per answer (default: each task's own, 16-48)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tasks and of the bootstrap")
    parser.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples of each interval")
    parser.add_argument("--confidence", type=float, default=0.95, help="the intervals' confidence")
    parser.add_argument("--budget", type=Budget.parse, default=Budget(),
                        help="ppl=RATIO,accuracy=POINTS,kl=NATS,top1=POINTS,tasks=POINTS (default ppl=1.01,"
                             "accuracy=0.5,kl=0.02,top1=2,tasks=3; any subset) or none")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="the rows' dtype (the reference is float32): default bfloat16 on CUDA, float32 on the "
                             "CPU")
    parser.add_argument("--json", default=None, help="every number, rewritten after each row (atomic)")
    parser.add_argument("--png", default=None, help="excess top-1, excess KL, task accuracy against length")
    parser.add_argument("--replot", metavar="JSON", nargs="+", default=None,
                        help="no run: the tables (judged by --budget) and --png of earlier runs' --json (several: "
                             "their rows together, each judged against its own run's sdpa)")
    parser.add_argument("--tradeoff", metavar="PNG", default=None,
                        help="with --replot: excess top-1 disagreement against prefill density per length, every "
                             "method setting a point marked within / outside the budget, with its TTFT speed-up from "
                             "--speed")
    parser.add_argument("--speed", metavar="JSON", nargs="+", default=[],
                        help="with --tradeoff: bench_generate.py --json files whose TTFT speed-ups (same length "
                             "and method name: a bare name means the defaults of the tree it ran on, so pair runs "
                             "of one set of defaults) label the points")
    args = parser.parse_args(argv)
    if (args.tradeoff or args.speed) and not args.replot:
        parser.error("--tradeoff and --speed draw earlier runs: give their JSON files with --replot")
    if args.png or args.tradeoff:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--png and --tradeoff need matplotlib: pip install 'hf-sparse[bench]'")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if any(length < 2 for length in args.lengths):
        parser.error("--lengths must be at least 2 tokens")
    if args.targets < 1 or args.positions < 1 or args.skip < 0 or args.instances < 0:
        parser.error("--targets and --positions must be positive, --skip and --instances not negative")
    if args.answer_tokens is not None and args.answer_tokens < 1:
        parser.error("--answer-tokens must be positive")
    if args.resamples < 1 or not 0.0 < args.confidence < 1.0:
        parser.error("--resamples must be positive and --confidence in (0, 1)")
    if args.long_context and (args.model != "default" or args.rope_scaling != "none"):
        parser.error("--long-context loads the default model with its own rope scaling: no --model / --rope-scaling")
    args.text_end = args.text_end or max(131072, *args.lengths)
    if max(args.lengths) > args.text_end:
        parser.error(f"--text-end {args.text_end} is shorter than the longest length {max(args.lengths)}")
    args.methods = ["sdpa"] + [method for method in dict.fromkeys(args.methods) if method != "sdpa"]
    args.tasks = list(dict.fromkeys(args.tasks))
    return args


def merged_runs(paths: list[str], budget: Budget) -> dict:
    """The runs of ``paths`` (``--json`` files) as one: the first file's header, texts and settings, every
    file's rows (each judged against the sdpa row of its own file and length; one float32 and one sdpa row per
    length kept)."""
    merged, runs = None, {}
    for path in paths:
        with open(path) as handle:
            data = json.load(handle)
        if any("texts" not in row for row in data["rows"]):
            raise SystemExit(f"--replot {path}: written by bench_quality.py before its float32 reference (no "
                             f"per-text figures, no tasks); this version cannot judge it: run it again")
        judge(data["rows"], budget, data["settings"])
        runs[f"{data['environment']['device']} {data['environment']['date'][:10]}"] = None
        if merged is None:
            merged = data
            continue
        kept = {(row["length"], row["method"]) for row in merged["rows"] if row["method"] in ("sdpa", REFERENCE)}
        merged["rows"] += [row for row in data["rows"] if (row["length"], row["method"]) not in kept]
    order = {REFERENCE: 0, "sdpa": 1, "all-blocks": 2}
    merged["rows"].sort(key=lambda row: (row["length"], order.get(row["method"], 3)))
    merged["judged"] = True
    if len(paths) > 1:
        merged["title"] = (f"{len(paths)} runs ({'; '.join(runs)}) | {merged['model']} | texts, positions and tasks "
                           f"as each run's settings say")
    return merged


def report(data: dict, budget: Budget, png: str | None) -> None:
    """The tables of a run's JSON ``data`` (rows judged against ``budget``), under its header and notes, last on
    stdout; the plot to ``png``."""
    rows, settings, texts = data["rows"], data["settings"], data["texts"]
    if not data.get("judged"):
        judge(rows, budget, settings)
    if png:
        plot(rows, png, data["title"])
    print(f"\n{data['title']} | texts: " + "; ".join(f"{name}: {text}" for name, text in texts.items()))
    interval = f"{100 * settings['confidence']:g}%"
    print(f"Next-token figures against the model in float32 (dense sdpa): PPL of {settings['targets']} targets before "
          f"token {settings['text_end']} of each text, '/ dense' its ratio to sdpa's; accuracy (top-1 = the text's "
          f"next token), KL(float32 || row) and top-1 disagreement with float32 at {settings['positions']} positions "
          f"spread over each window past its first min({settings['skip']}, L/2) tokens; excess: the row's minus "
          f"sdpa's (the floor: sdpa in {settings.get('dtype')}), paired; [{interval} bootstrap interval over "
          f"positions, {settings['resamples']} resamples]; density: attended / causal key blocks of the scoring "
          f"forward's sparse layers.")
    if any(isinstance(sparse_config(row.get("config") or row["method"]), hf_sparse.StarConfig) for row in rows
           if row["method"] not in ("sdpa", REFERENCE, "all-blocks")):
        print("star: PPL scores the targets as its query (context: the window before them); the figures at earlier "
              "positions are its predictions with the window up to each as the context and its token as the query.")
    print()
    print(figures_table(rows))
    if any(row["tasks"] for row in rows):
        print(f"\nTasks: accuracy % [{interval} Wilson interval] over {settings['instances']} prompts of each task "
              f"and length (quality_tasks.py), greedy answers through the method; budget: {budget.describe()}.")
    else:
        print(f"\nBudget: {budget.describe()}.")
    print()
    print(tasks_table([row for row in rows if row["method"] != REFERENCE]))


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
    document = held_out_document(args.document)  # before the model: a wrong name ends the run at once
    loaded = load_model(args, max(lengths) if not per_length else lengths[0])
    texts = load_texts(loaded.tokenizer, args.text_end, document)
    suite = quality_tasks.TaskSuite(loaded.tokenizer, args.seed) if args.instances else None
    env = environment()
    rope = "yarn, factor = each length / the trained length" if per_length else loaded.rope
    descriptions = {name: text.description for name, text in texts.items()}
    if suite is not None:
        descriptions["tasks"] = (f"{', '.join(args.tasks)}: {args.instances} prompts each per length, seed "
                                 f"{args.seed}; haystack: sentences from a seeded vocabulary (cwe: made-up words)")
    data = {"environment": env, "title": f"{header(env)} | {loaded.description} | rope scaling: {rope}",
            "model": loaded.description, "rope_scaling": args.rope_scaling, "texts": descriptions,
            "budget": args.budget.describe(),
            "settings": {key: value for key, value in vars(args).items() if key != "budget"}, "rows": []}
    print(data["title"], file=sys.stderr)

    def save(row: dict) -> None:
        data["rows"].append({**row, "rope": loaded.rope})
        judge(data["rows"], args.budget, _settings(args))
        if args.json:
            write_json(args.json, data)

    with tqdm(total=len(lengths) * len(args.methods), desc="quality", unit="row") as bar:
        for length in lengths:
            if per_length and length != lengths[0]:
                _free(loaded.model)
                loaded = load_model(args, length)
            try:
                windows = {name: scoring_window(text.ids, args.text_end, length, args.targets, args.positions,
                                                args.skip) for name, text in texts.items()}
            except ValueError as error:
                raise SystemExit(str(error)) from None
            try:
                prompts = task_prompts(suite, args.tasks, length, args.instances) if suite is not None else {}
            except ValueError as error:
                raise SystemExit(f"--lengths {length}: {error}") from None
            measure_length(loaded, windows, prompts, args.methods, args, bar, save)
    report(data, args.budget, args.png)
    return data["rows"]


if __name__ == "__main__":
    main()
