"""Block scorers for PLAS's prefill selection: what, other than a gate's compressed keys, could rank key blocks.

A scorer is ``score(query, key, block, scale, slots) -> [B, Hq, Sq, num_blocks]`` float32 block logits for queries
``[B, Hq, Sq, D]`` at key slots ``slots`` (``[Sq]``) over the layer's keys ``[B, Hkv, Sk, D]`` (post-RoPE, unpadded
rows). :func:`scored_selection` makes PLAS's prefill rank blocks by one (the PyTorch reference of the rest of the
selection: threshold top-k, forced blocks, tile union). These are measurements of ranking quality on the PyTorch
path (``studies/gate_gains.py --scorers``), not kernels. ``SCORERS`` lists them; a spec on the command line is
``NAME:BLOCK`` or ``NAME:BLOCK:R`` for those that take a size R.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import torch

from hf_sparse.kernels.reference import block_summaries, causal_logits, pooled_block_logits


def padded_blocks(key, block):
    """``[B, Hkv, num_blocks, block, D]`` float32 keys, the last block filled up with copies of the last key (which
    changes no per-block max or min)."""
    num_blocks = -(-key.shape[2] // block)
    padded = torch.cat([key, key[:, :, -1:].expand(-1, -1, num_blocks * block - key.shape[2], -1)], 2)
    return padded.float().unflatten(2, (num_blocks, block))


def mean_key(query, key, block, scale, slots):
    """``q . mean(block's keys)``: mean pooling on this path (to combine with a query stride)."""
    return subblock_max(block)(query, key, block, scale, slots)


def oracle(query, key, block, scale, slots):
    """Each query's log attention mass per block: the best any block scorer could rank by."""
    return pooled_block_logits(query, key, block, scale, slots, "sum")


def max_logit(query, key, block, scale, slots):
    """Each query's largest true logit per block: a perfect max-type scorer."""
    return pooled_block_logits(query, key, block, scale, slots, "max")


def bounds(query, key, block, scale, slots):
    """Quest's bound: the largest ``q . k`` a key within the block's per-channel key range could reach,
    ``q+ . max(k) + q- . min(k)`` (one dot product of width 2D)."""
    blocks = padded_blocks(key, block)
    summaries = torch.cat([blocks.amax(3), blocks.amin(3)], -1).repeat_interleave(query.shape[1] // key.shape[1], 1)
    q = query.float()
    return torch.matmul(torch.cat([q.clamp(min=0), q.clamp(max=0)], -1), summaries.transpose(-1, -2)) * scale


def subblock_max(sub):
    """The largest ``q . mean(keys)`` over the block's sub-blocks of ``sub`` keys (mean pooling's summaries at
    ``sub``, maxed per block: what ``block / sub`` summaries per block would rank by)."""
    def score(query, key, block, scale, slots):
        start = torch.zeros(key.shape[0], dtype=torch.long, device=key.device)
        means = block_summaries(key, None, start, sub).float().repeat_interleave(query.shape[1] // key.shape[1], 1)
        logits = torch.matmul(query.float(), means.transpose(-1, -2)) * scale
        ratio, num_blocks = block // sub, -(-key.shape[2] // block)
        logits = torch.nn.functional.pad(logits, (0, num_blocks * ratio - logits.shape[-1]), value=float("-inf"))
        return logits.unflatten(-1, (num_blocks, ratio)).amax(-1)
    return score


def chosen_keys(r, rank):
    """The largest ``q . k`` over the ``r`` keys of each block that ``rank(query, key, scale, slots)`` (``[B, Hkv,
    Sk]``) puts highest."""
    def score(query, key, block, scale, slots):
        blocks = padded_blocks(key, block)
        num_blocks, dim = blocks.shape[2], key.shape[-1]
        weight = rank(query, key, scale, slots)
        weight = torch.nn.functional.pad(weight, (0, num_blocks * block - key.shape[2]), value=float("-inf"))
        chosen = weight.unflatten(2, (num_blocks, block)).topk(r, -1).indices  # [B, Hkv, nb, r]
        keys = blocks.gather(3, chosen[..., None].expand(-1, -1, -1, -1, dim)).flatten(2, 3)
        logits = torch.matmul(query.float(), keys.repeat_interleave(query.shape[1] // key.shape[1], 1).mT) * scale
        return logits.unflatten(-1, (num_blocks, r)).amax(-1)
    return score


def key_norm(query, key, scale, slots):
    """Keys ranked by their norm (query-independent)."""
    return key.float().norm(dim=-1)


def most_attended(query, key, scale, slots):
    """Keys ranked by the largest attention probability any of these queries (of the key's GQA group) gives them:
    an oracle for which keys to keep."""
    probs = torch.softmax(causal_logits(query, key, scale, slots), -1).amax(2)  # [B, Hq, Sk]
    return probs.unflatten(1, (key.shape[1], -1)).amax(2)


def low_rank_max(basis):
    """Each block's largest logit in a few dimensions: queries and keys projected on ``basis(key)`` (``[Hkv, R,
    D]`` orthonormal rows), the max taken over every key of the block."""
    def score(query, key, block, scale, slots):
        directions = basis(key)
        q = torch.matmul(query.float(), directions.repeat_interleave(query.shape[1] // key.shape[1], 0).mT)
        k = torch.matmul(key.float(), directions.mT)
        return pooled_block_logits(q, k, block, scale, slots, "max")
    return score


def own_key_basis(r):
    """The top ``r`` principal directions of the layer's own keys (batch 1), per KV head (centred: the mean key adds
    the same to every block of a query)."""
    def basis(key):
        keys = key.float()[0]
        return torch.linalg.svd(keys - keys.mean(1, keepdim=True), full_matrices=False).Vh[:, :r]
    return basis


class LayerCursor:
    """Which attention layer of ``model`` runs now (forward pre-hooks on its ``self_attn`` modules)."""

    def __init__(self, model) -> None:
        self.layer = None
        self.handles = [layer.self_attn.register_forward_pre_hook(self._enter) for layer in model.model.layers]

    def _enter(self, module, args) -> None:
        self.layer = module.layer_idx


def fit_key_bases(model, tokenizer, rank, length, count, device):
    """Per layer, ``[kv_heads, rank, head_dim]``: the top principal directions of the post-RoPE keys of ``count``
    windows of ``length`` tokens of gate training's data (``hf_sparse.tools.eval.stdlib_training_files``: the standard
    library's code, disjoint from the held-out prose)."""
    from hf_sparse.tools.eval import stdlib_training_files
    from hf_sparse.tools.probe import probe_layers
    from hf_sparse.tools.text_data import pack_sequences, read_text_files, token_stream

    ids = pack_sequences(token_stream(read_text_files(stdlib_training_files()), tokenizer, length * count), length)
    moments = {}  # layer: (sum of keys [Hkv, D], sum of outer products [Hkv, D, D], count)

    def collect(layer, module, query, key):
        keys = key.float()[0]
        total, outer, n = moments.get(layer, (0, 0, 0))
        moments[layer] = (total + keys.sum(1), outer + keys.mT @ keys, n + keys.shape[1])

    for window in ids[:count].to(device):
        probe_layers(model, window[None], list(range(model.config.num_hidden_layers)), collect)
    bases = {}
    for layer, (total, outer, n) in moments.items():
        mean = total / n
        vectors = torch.linalg.eigh(outer / n - mean[:, :, None] * mean[:, None, :]).eigenvectors  # ascending
        bases[layer] = vectors[..., -rank:].flip(-1).mT.contiguous()
    return bases


@dataclass(frozen=True)
class Scorer:
    label: str
    block: int
    score: Callable


#: name: (takes R, what it ranks by)
SCORERS = {
    "mean": (False, "q . mean key, as mean pooling (with --query-stride)"),
    "oracle": (False, "true attention mass per block (the ceiling)"),
    "max-logit": (False, "each block's true largest logit"),
    "bounds": (False, "Quest's per-channel key bound"),
    "subblock-max": (True, "largest q . mean over sub-blocks of R keys"),
    "norm-keys": (True, "largest q . k over the block's R largest-norm keys"),
    "attended-keys": (True, "largest q . k over the block's R most attended keys (oracle choice)"),
    "low-rank": (True, "largest logit in the top R principal directions of the layer's own keys"),
    "fitted-low-rank": (True, "largest logit in R directions fitted on training code (--fit-windows)"),
}


def parse_spec(spec: str) -> tuple[str, int, int | None]:
    """``NAME:BLOCK[:R]`` -> (name, block, R or None); ValueError naming the problem."""
    name, *numbers = spec.split(":")
    if name not in SCORERS:
        raise ValueError(f"unknown scorer {name!r} in {spec!r}; known: {', '.join(SCORERS)}")
    if len(numbers) != (2 if SCORERS[name][0] else 1) or not all(n.isdigit() and int(n) > 0 for n in numbers):
        form = f"{name}:BLOCK:R" if SCORERS[name][0] else f"{name}:BLOCK"
        raise ValueError(f"scorer {spec!r}: expected {form} with positive integers")
    if name == "subblock-max" and int(numbers[0]) % int(numbers[1]):
        raise ValueError(f"scorer {spec!r}: {numbers[1]} does not divide the block size {numbers[0]}")
    return name, int(numbers[0]), int(numbers[1]) if len(numbers) == 2 else None


def build_scorers(specs, query_stride, fitted_bases=None, cursor=None) -> list[Scorer]:
    """The parsed ``specs`` (``fitted_bases`` / ``cursor``: from :func:`fit_key_bases` and a :class:`LayerCursor`,
    needed by ``fitted-low-rank``)."""
    out = []
    for spec in specs:
        name, block, r = parse_spec(spec)
        if name == "fitted-low-rank":
            score = low_rank_max(lambda key, r=r: fitted_bases[cursor.layer][:, :r].to(key.device))
        else:
            score = {"mean": lambda: mean_key, "oracle": lambda: oracle, "max-logit": lambda: max_logit,
                     "bounds": lambda: bounds,
                     "subblock-max": lambda: subblock_max(r), "norm-keys": lambda: chosen_keys(r, key_norm),
                     "attended-keys": lambda: chosen_keys(r, most_attended),
                     "low-rank": lambda: low_rank_max(own_key_basis(r))}[name]()
        label = name.replace("-", " ") + (f" {r}" if r else "")
        label += f", 1 query in {query_stride}" if query_stride > 1 else ""
        out.append(Scorer(label, block, score))
    return out


def scored_select_prefill(method, score, stride, query, summaries, key, *, scale, q_offset, kv_start,
                          call_length=None, **unused):
    """PLAS's prefill selection (threshold top-k, forced blocks, tile union; PyTorch reference, unpadded inputs)
    with each query's blocks ranked by ``score`` instead of the summaries; with ``stride`` > 1 only the queries
    that search with ``PLASConfig.query_stride`` (every ``stride``-th of a tile and its last) select, each tile
    taking the union of those, and the forced blocks of every query. The top-k range is the call's
    (``call_length``, as ``PLASMethod.select_prefill``'s)."""
    from hf_sparse.kernels import reference
    from hf_sparse.selection import BlockSelection

    config = method.config
    batch, q_heads, num_queries, _ = query.shape
    block, tile = config.block_size, config.query_union
    key_length = key.shape[2]
    top_k = config.top_k("prefill", call_length or key_length)
    num_blocks = -(-key_length // block)
    mask = torch.zeros(batch, q_heads, -(-num_queries // tile), num_blocks, dtype=torch.bool, device=query.device)
    block_ids = torch.arange(num_blocks, device=query.device)
    for q0 in range(0, num_queries, 512):
        q1 = min(num_queries, q0 + 512)
        available = reference.block_availability(q1 - q0, num_blocks, q_offset + q0, kv_start, block, key_length)
        within = torch.arange(q0, q1, device=query.device) % tile  # searching rows as reference.select_blocks's
        rows = torch.nonzero((within % stride == stride - 1) | (within == tile - 1)
                             | (torch.arange(q0, q1, device=query.device) == num_queries - 1))[:, 0]
        logits = score(query[:, :, q0:q1][:, :, rows], key, block, scale, q_offset + q0 + rows)[..., :num_blocks]
        logits = logits.masked_fill(~available[:, None, rows], float("-inf"))
        chosen = torch.zeros(batch, q_heads, q1 - q0, num_blocks, dtype=torch.bool, device=query.device)
        chosen[:, :, rows] = reference.threshold_topk(logits, available[:, None, rows], top_k, config.search_steps)
        own = (q_offset + torch.arange(q0, q1, device=query.device)) // block
        forced = (block_ids[None, :] == own[:, None]) | (block_ids < config.sink_blocks)[None, :]
        chosen |= (forced[None] & available)[:, None]
        for t in range(q0 // tile, -(-q1 // tile)):
            lo, hi = max(q0, t * tile) - q0, min(q1, (t + 1) * tile) - q0
            mask[:, :, t] |= chosen[:, :, lo:hi].any(2)
    return BlockSelection.from_mask(mask, block_size=block, query_tile=tile)


@contextlib.contextmanager
def scored_selection(score, stride=1):
    """Within: PLAS's prefill ranks blocks by ``score`` (:func:`scored_select_prefill`)."""
    from hf_sparse.methods.plas import PLASMethod

    original = PLASMethod.select_prefill
    PLASMethod.select_prefill = functools.partialmethod(scored_select_prefill, score, stride)
    try:
        yield
    finally:
        PLASMethod.select_prefill = original
