"""Fidelity of sparse attention against dense attention on one input: next-token KL, top-1, recall, density."""
from __future__ import annotations

import ast
import contextlib
import glob
import os
import sysconfig
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from ..config import CONFIG_KEY, PLASConfig
from ..integration import configure
from ..recording import LayerRecord, record_sparsity

_QUERY_CHUNK = 512


def stdlib_text(min_chars: int) -> str:
    """Deterministic natural-ish text: the standard library's own ``*.py`` files in sorted order, until at least
    ``min_chars`` characters (all of them if they hold fewer)."""
    parts, total = [], 0
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as handle:
            parts.append(handle.read())
        total += len(parts[-1])
        if total >= min_chars:
            break
    return "".join(parts)


def stdlib_prose() -> str:
    """English prose from the standard library, never code: the Python reference's topic texts
    (``pydoc_data.topics``, sorted by topic) followed by the docstrings (module, class, function) of the
    top-level ``*.py`` files in sorted order. The held-out text of gate training, whose data is code
    (:func:`stdlib_training_files`). It is the running interpreter's: other Python versions give other text."""
    root = sysconfig.get_paths()["stdlib"]
    with open(os.path.join(root, "pydoc_data", "topics.py"), encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    topics = next((ast.literal_eval(node.value) for node in tree.body
                   if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "topics"), None)
    if not isinstance(topics, dict):
        raise ValueError(f"{root}/pydoc_data/topics.py holds no `topics` dict: this Python's layout is not supported")
    parts = [topics[name].strip() for name in sorted(topics)]
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as handle:
            try:
                module = ast.parse(handle.read())
            except SyntaxError:
                continue
        for node in [module, *ast.walk(module)]:
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 200:
                    parts.append(doc.strip())
    return "\n\n".join(dict.fromkeys(parts))


def stdlib_training_files() -> list[str]:
    """The standard library's ``*.py`` files below its top level (packages and their tests), sorted: gate
    training's data. Disjoint from :func:`stdlib_text` (top-level files) and :func:`stdlib_prose` (which reads
    ``pydoc_data`` and top-level docstrings); installed packages (``site-packages``) are left out."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for path in glob.glob(os.path.join(root, "*", "**", "*.py"), recursive=True):
        parts = os.path.relpath(path, root).split(os.sep)
        if parts[0] in ("site-packages", "dist-packages", "pydoc_data") or not os.path.isfile(path):
            continue
        files.append(path)
    return sorted(files)


def held_out_sequences(tokenizer: Any, length: int, count: int) -> torch.Tensor:
    """``[count, length]`` token ids: consecutive disjoint windows of :func:`stdlib_prose`."""
    ids = tokenizer(stdlib_prose(), add_special_tokens=False, return_tensors="pt").input_ids[0]
    if ids.numel() < length * count:
        raise ValueError(f"the standard library's prose holds {ids.numel()} tokens, fewer than {count} sequences "
                         f"of {length}")
    return ids[: length * count].view(count, length).clone()


@dataclass
class LayerFidelity:
    """One layer's prefill: fraction of causal blocks attended, dense attention mass on them, and
    the attention-level KL ``mean(-log recall)`` (dense vs dense-restricted-to-selection)."""

    layer_idx: int
    density: float
    recall: float
    attention_kl: float
    dense_reason: str | None = None


@dataclass
class FidelityReport:
    """Overall next-token agreement with dense attention, plus the per-layer breakdown."""

    num_tokens: int
    positions: int
    kl: float
    top1_agreement: float
    kl_last: float  # at the last position (the prompt's next token; Star's query phase)
    density: float
    recall: float
    layers: list[LayerFidelity] = field(default_factory=list)

    def table(self) -> str:
        """A plain-text table (what ``hf-sparse eval`` prints)."""
        lines = [
            f"tokens {self.num_tokens}, positions scored {self.positions}",
            f"next-token KL(dense||sparse) {self.kl:.5f}   at the last position {self.kl_last:.5f}   "
            f"top-1 agreement {self.top1_agreement:.4f}   density {self.density:.3f}   recall {self.recall:.4f}",
            f"{'layer':>5} {'density':>8} {'recall':>8} {'attn KL':>8}  note",
        ]
        for layer in self.layers:
            note = f"dense: {layer.dense_reason}" if layer.dense_reason else ""
            lines.append(f"{layer.layer_idx:>5} {layer.density:>8.3f} {layer.recall:>8.4f} {layer.attention_kl:>8.4f}  {note}")
        return "\n".join(lines)


def compare_table(reports: dict[str, "FidelityReport"]) -> str:
    """Reports side by side, one column each (``hf-sparse eval --gates``): KL, top-1 agreement, density, recall."""
    names = list(reports)
    width = max(12, *(len(name) for name in names))
    first = reports[names[0]]
    lines = [f"tokens {first.num_tokens}, positions scored {first.positions}",
             f"{'':<30}" + "".join(f"{name:>{width + 2}}" for name in names)]
    for label, value in (("next-token KL(dense||sparse)", lambda r: f"{r.kl:.5f}"),
                         ("KL at the last position", lambda r: f"{r.kl_last:.5f}"),
                         ("top-1 agreement", lambda r: f"{r.top1_agreement:.4f}"),
                         ("density", lambda r: f"{r.density:.3f}"), ("recall", lambda r: f"{r.recall:.4f}")):
        lines.append(f"{label:<30}" + "".join(f"{value(reports[name]):>{width + 2}}" for name in names))
    return "\n".join(lines)


@contextlib.contextmanager
def _attention(model: Any, implementation: str, config: Any = None) -> Iterator[None]:
    previous_impl = model.config._attn_implementation
    previous_cfg = getattr(model.config, CONFIG_KEY, None)
    try:
        if config is not None:
            configure(model, config)
        elif model.config._attn_implementation != implementation:
            model.set_attn_implementation(implementation)
        yield
    finally:
        if model.config._attn_implementation != previous_impl:
            model.set_attn_implementation(previous_impl)
        if previous_cfg is None:
            if hasattr(model.config, CONFIG_KEY):
                delattr(model.config, CONFIG_KEY)
        else:
            setattr(model.config, CONFIG_KEY, previous_cfg)


def _layer_recall(record: LayerRecord) -> tuple[float, float]:
    """Mean dense attention mass on the selected blocks, and mean ``-log`` of it, over valid queries and heads."""
    query, key, _value, kv_start = record.inputs
    selection = record.selection
    batch, q_heads, num_queries, head_dim = query.shape
    key_length = key.shape[2]
    q_offset = key_length - num_queries
    block_size = selection.block_size
    num_blocks = -(-(key_length - int(kv_start.min())) // block_size)
    group = q_heads // key.shape[1]
    keys = key.float().repeat_interleave(group, dim=1)
    block_mask = selection.to_mask(num_blocks).repeat_interleave(q_heads // selection.num_heads, dim=1)
    pad_q = (kv_start - q_offset).clamp(0, num_queries)
    slots = torch.arange(key_length, device=query.device)
    slot_block = torch.div(slots[None, :] - kv_start[:, None], block_size, rounding_mode="floor").clamp(0, num_blocks - 1)
    total = log_total = 0.0
    count = 0
    for q0 in range(0, num_queries, _QUERY_CHUNK):
        q1 = min(num_queries, q0 + _QUERY_CHUNK)
        query_ids = torch.arange(q0, q1, device=query.device)
        q_slot = q_offset + query_ids
        visible = (slots[None, :] <= q_slot[:, None])[None] & (slots[None, None, :] >= kv_start[:, None, None])
        scores = torch.matmul(query[:, :, q0:q1].float(), keys.transpose(-1, -2)) / head_dim**0.5
        probs = torch.softmax(scores.masked_fill(~visible[:, None], float("-inf")), dim=-1).nan_to_num(0.0)
        real = query_ids[None, :] >= pad_q[:, None]  # [B, q]
        tiles = torch.div(query_ids[None, :] - pad_q[:, None], selection.query_tile, rounding_mode="floor")
        tiles = tiles.clamp(0, selection.num_query_tiles - 1)
        chosen_blocks = torch.gather(block_mask, 2, tiles[:, None, :, None].expand(-1, q_heads, -1, num_blocks))
        chosen_slots = torch.gather(chosen_blocks, 3, slot_block[:, None, None, :].expand(-1, q_heads, q1 - q0, -1))
        recall = (probs * chosen_slots).sum(-1)
        valid = real[:, None].expand_as(recall)
        recall = recall[valid].clamp(1e-12, 1.0)
        total += float(recall.sum())
        log_total += float(-recall.log().sum())
        count += recall.numel()
    return total / max(count, 1), log_total / max(count, 1)


@torch.no_grad()
def fidelity(model: Any, input_ids: torch.Tensor, config: Any = None, last_n: int = 256,
             attention_mask: torch.Tensor | None = None, with_recall: bool = True) -> FidelityReport:
    """Compare the model's next-token distributions with ``config``'s sparse attention (a PLASConfig, the
    default, XAttnConfig or StarConfig) against dense sdpa.

    KL and top-1 agreement are taken over the last ``last_n`` positions of every row (``kl_last``: KL at the last
    one, the prompt's next token); density and recall
    over all sparse prefill layers (``with_recall=False`` skips the dense attention pass that recall
    needs and reports recall as NaN). The model's own attention setting is restored afterwards.
    """
    config = config if config is not None else PLASConfig()
    positions = min(last_n, input_ids.shape[1])
    with _attention(model, "sdpa"):
        dense_logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=positions).logits.float()
    with _attention(model, config.method, config), record_sparsity(keep_inputs=with_recall) as recorder:
        sparse_logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=positions).logits.float()
    dense_lp = torch.log_softmax(dense_logits[:, -positions:], dim=-1)
    sparse_lp = torch.log_softmax(sparse_logits[:, -positions:], dim=-1)
    kl_per_position = (dense_lp.exp() * (dense_lp - sparse_lp)).sum(-1)
    kl, kl_last = kl_per_position.mean().item(), kl_per_position[:, -1].mean().item()
    top1 = (dense_lp.argmax(-1) == sparse_lp.argmax(-1)).float().mean().item()
    layers = []
    attended = causal = 0.0
    for rec in recorder.records:
        if rec.dense_reason is not None:
            layers.append(LayerFidelity(rec.layer_idx, 1.0, 1.0, 0.0, rec.dense_reason))
            continue
        recall, attn_kl = _layer_recall(rec) if with_recall else (float("nan"), float("nan"))
        attended += float(rec.attended_blocks)
        causal += float(rec.causal_blocks)
        layers.append(LayerFidelity(rec.layer_idx, float(rec.attended_blocks) / max(float(rec.causal_blocks), 1.0),
                                    recall, attn_kl))
    sparse_layers = [layer for layer in layers if layer.dense_reason is None]
    mean_recall = sum(layer.recall for layer in sparse_layers) / len(sparse_layers) if sparse_layers else 1.0
    return FidelityReport(
        num_tokens=input_ids.shape[1], positions=positions, kl=kl, top1_agreement=top1, kl_last=kl_last,
        density=attended / causal if causal else 1.0, recall=mean_recall, layers=layers,
    )


# -- pass-key retrieval -------------------------------------------------------------------------------------------

#: The demo's haystack (``examples/generate.py``): these sentences repeated to any length.
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
#: What the prompt says before the haystack, and the question after it.
PASSKEY_INSTRUCTION = "There is a pass key hidden in the following text. Find it and memorize it.\n\n"
PASSKEY_QUESTION = "\n\nWhat is the pass key? Answer with the number only."
#: A completion cue after the question, for a tokenizer without a chat template (base models).
PASSKEY_CUE = "\n\nThe pass key is"
_HAYSTACK_MARK = "<<hf_sparse haystack>>"
_SENTENCE_SEARCH = 32  # tokens either side of the requested depth searched for a sentence start (at most 2%)


def passkey_needle(key: str) -> str:
    """The sentences that hide ``key`` in a haystack."""
    return f"The pass key is {key}. Remember it. {key} is the pass key. "


def passkey_found(answer: str, key: str) -> bool:
    """Whether ``key``'s digits appear, in order and together, among the digits of ``answer`` ("12,345" and
    "1 2 3 4 5" count for 12345)."""
    if not key.isdigit():
        raise ValueError(f"a pass key is digits only, got {key!r}")
    return key in "".join(character for character in answer if character.isdigit())


def filler_ids(tokenizer: Any, min_tokens: int) -> torch.Tensor:
    """1-D token ids of :data:`PASSKEY_FILLER` repeated to at least ``min_tokens`` tokens (tokenized as one text)."""
    per_filler = len(tokenizer(PASSKEY_FILLER, add_special_tokens=False).input_ids)
    repeats = -(-min_tokens // max(per_filler - 1, 1)) + 1
    ids = tokenizer(PASSKEY_FILLER * repeats, add_special_tokens=False, return_tensors="pt").input_ids[0]
    return ids[:max(min_tokens, 1)]


@dataclass
class PasskeyPrompt:
    """A pass-key prompt of an exact token length.

    Attributes:
        input_ids: ``[1, length]`` token ids: instruction, haystack with the needle inside, question.
        key: the hidden digits.
        haystack_start: index of the haystack's first token (the instruction comes before it).
        context_length: tokens up to the end of the haystack; the question follows (Star's context and query).
        needle_start: index of the needle's first token.
        depth: where the needle starts, as a fraction of the haystack's tokens.
    """

    input_ids: torch.Tensor
    key: str
    haystack_start: int
    context_length: int
    needle_start: int
    depth: float


def _sentence_start(tokenizer: Any, ids: torch.Tensor, around: int) -> int:
    """The token index nearest ``around`` at which a sentence starts (the token before it ends in ``.``, ``!``,
    ``?`` or a newline), within :data:`_SENTENCE_SEARCH` tokens or 2% of ``ids``; ``around`` itself when none is
    that near."""
    radius = min(_SENTENCE_SEARCH, ids.numel() // 50)
    for offset in sorted(range(-radius, radius + 1), key=abs):
        index = around + offset
        if 0 < index < ids.numel() and tokenizer.decode(ids[index - 1: index]).rstrip(" ").endswith(
                (".", "!", "?", "\n")):
            return index
    return around


def passkey_prompt(tokenizer: Any, haystack_ids: torch.Tensor, length: int, depth: float, key: str) -> PasskeyPrompt:
    """A prompt of exactly ``length`` tokens asking for ``key``, hidden at ``depth`` (0-1) of a haystack cut from
    the start of ``haystack_ids`` (1-D token ids: :func:`filler_ids`, or any tokenized text).

    The prompt is the demo's (``examples/generate.py``): instruction, haystack, question, in the tokenizer's chat
    template as one user message when it has one, else as plain text ending in :data:`PASSKEY_CUE`. The needle
    goes in at the sentence start nearest the requested depth.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    if getattr(tokenizer, "chat_template", None):
        message = PASSKEY_INSTRUCTION + _HAYSTACK_MARK + PASSKEY_QUESTION
        text = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                             add_generation_prompt=True)
        special = False  # the template writes its own special tokens
    else:
        text, special = PASSKEY_INSTRUCTION + _HAYSTACK_MARK + PASSKEY_QUESTION + PASSKEY_CUE, True
    if text.count(_HAYSTACK_MARK) != 1:
        raise ValueError("the tokenizer's chat template does not keep the user message as written")
    before, after = text.split(_HAYSTACK_MARK)
    prefix = tokenizer(before, add_special_tokens=special).input_ids
    suffix = tokenizer(after, add_special_tokens=False).input_ids
    needle = tokenizer(" " + passkey_needle(key).strip(), add_special_tokens=False).input_ids
    room = length - len(prefix) - len(needle) - len(suffix)
    if room < 1:
        raise ValueError(f"a pass-key prompt of {length} tokens leaves no room for a haystack: instruction, needle "
                         f"and question take {length - room} tokens")
    if haystack_ids.dim() != 1 or haystack_ids.numel() < room:
        raise ValueError(f"the haystack must be 1-D token ids of at least {room} tokens, got shape "
                         f"{tuple(haystack_ids.shape)}")
    haystack = haystack_ids[:room].cpu()
    cut = _sentence_start(tokenizer, haystack, round(depth * room))
    ids = torch.cat([torch.tensor(prefix), haystack[:cut], torch.tensor(needle), haystack[cut:],
                     torch.tensor(suffix)]).long()[None]
    return PasskeyPrompt(ids, key, len(prefix), len(prefix) + room + len(needle), len(prefix) + cut, cut / room)
