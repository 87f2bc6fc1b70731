"""PLAS's key scorer: a prefill ranks each query's key blocks by the block's largest logit in a few key directions.

Mean pooling scores a block by ``q . mean(keys)``, which averages away the block's best key; the true attention mass
is what a selection should keep (docs/gates.md). Each block's largest logit comes close to that mass, and in the top
``R`` principal directions of a layer's post-RoPE keys (per KV head, centred: the mean key adds the same to every
block of a query) it keeps most of it. On the long-context default model, 16 directions fitted on training code
give 0.44-0.58x mean pooling's next-token KL at a matched density at 32K and 64K over the last 256 positions of a
window; inside PLAS's whole prefill, under the quality budget, the scan costs more than the blocks it saves and at
128K it needs more density than mean pooling (docs/gates.md, "The key scorer"), so no directions are attached by
default.

* :func:`fit_key_directions`: the directions ``{layer: [kv_heads, R, head_dim]}`` from a model's keys on some windows.
* :func:`set_key_directions` / :func:`get_key_directions`: attach them to a model's attention modules (outside its
  state dict, as gates are). A PLAS prefill in a layer with directions selects through :func:`select_prefill`;
  decode keeps the summaries.
* :func:`block_scores`: ``[B, Hq, Sq, num_blocks]`` float32, each block's largest logit of the projected query
  and keys (``kernels.pooled_block_logits``), blocks counted from each row's first real key.
* :func:`select_prefill`: those scores in chunks of whole query tiles (each chunk's scores at most
  :data:`CHUNK_BYTES`), each chunk selected by ``kernels.select_blocks_from_logits`` (PLAS's threshold top-k,
  forced blocks, tile union).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Collection, Mapping

import torch

from . import kernels
from .gates import attached_on_device
from .selection import BlockSelection, RowLayout, row_starts

#: Where the directions sit on an attention module (outside its state dict).
_ATTR = "_hf_sparse_key_directions"
#: Largest float32 score tensor of one chunk of queries (all heads, every block).
CHUNK_BYTES = 256 * 2 ** 20


def get_key_directions(module: torch.nn.Module) -> torch.Tensor | None:
    """The key directions ``[kv_heads, R, head_dim]`` attached to an attention module, on its device (moved once,
    on first use, after ``model.to(device)``), or ``None``."""
    return attached_on_device(module, _ATTR)


def set_key_directions(model: torch.nn.Module, directions: Mapping[int, torch.Tensor] | None) -> None:
    """Attach ``{layer: [kv_heads, R, head_dim]}`` to the model's attention modules (``None``: remove them all).
    Layers not named keep none. Raises ``ValueError`` naming a layer the model lacks or a tensor of the wrong
    shape (its KV heads or head dim not the model's), before attaching anything."""
    from .gates import attention_modules, gate_spec

    modules = attention_modules(model)
    if directions is None:
        for module in modules.values():
            module.__dict__.pop(_ATTR, None)
        return
    spec = gate_spec(model)
    problem = directions_problem(directions, spec.kv_heads, spec.head_dim, modules.keys())
    if problem:
        raise ValueError(problem)
    checked = {layer: tensor.detach().float() for layer, tensor in directions.items()}
    for layer, module in modules.items():
        if layer in checked:
            module.__dict__[_ATTR] = checked[layer]
        else:
            module.__dict__.pop(_ATTR, None)


def directions_problem(directions: Mapping[int, torch.Tensor], kv_heads: int, head_dim: int,
                       layers: range | Collection[int]) -> str | None:
    """What makes ``{layer: [kv_heads, R, head_dim]}`` key directions unusable for a model whose attention
    layers are ``layers`` (a layer it lacks, another shape, several ranks R, not finite floats), or ``None``: the one
    check of attaching, writing and reading them."""
    for layer, tensor in sorted(directions.items()):
        if layer not in layers:
            named = f"0..{layers[-1]}" if isinstance(layers, range) and layers else ", ".join(map(str, sorted(layers)))
            return f"key directions for layer {layer}, but the model's attention layers are {named}"
        if tensor.dim() != 3 or (tensor.shape[0], tensor.shape[2]) != (kv_heads, head_dim) or tensor.shape[1] < 1:
            return (f"layer {layer}: key directions of shape {tuple(tensor.shape)}, expected [kv_heads={kv_heads}, "
                    f"R >= 1, head_dim={head_dim}]")
        if not tensor.is_floating_point() or not bool(torch.isfinite(tensor.float()).all()):
            return f"layer {layer}: key directions are not finite floats"
    ranks = sorted({tensor.shape[1] for tensor in directions.values()})
    if len(ranks) > 1:
        return f"key directions of several ranks {ranks}: one rank per model"
    return None


@torch.no_grad()
def fit_key_directions(model: Any, windows: torch.Tensor, rank: int, layers: list[int] | None = None,
                       progress: bool = True) -> dict[int, torch.Tensor]:
    """Per layer, the top ``rank`` principal directions ``[kv_heads, rank, head_dim]`` (float32, orthonormal rows)
    of the post-RoPE keys of ``windows`` (``[N, L]`` token ids, one forward each with dense attention), centred per
    KV head. ``layers``: which (default: every attention layer)."""
    from tqdm.auto import tqdm

    from .gates import attention_modules, gate_spec
    from .training import probe_layers

    if windows.dim() != 2 or windows.shape[0] < 1:
        raise ValueError(f"windows must be [N >= 1, L] token ids, got {tuple(windows.shape)}")
    head_dim = gate_spec(model).head_dim
    if not 1 <= rank <= head_dim:
        raise ValueError(f"rank must be 1..{head_dim} (the head dim), got {rank}")
    layers = sorted(attention_modules(model)) if layers is None else sorted(layers)
    moments: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}

    def collect(layer: int, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor) -> None:
        keys = key.float()[0]  # [Hkv, L, D] of the window
        total, outer, count = moments.get(layer, (0, 0, 0))
        moments[layer] = (total + keys.sum(1), outer + keys.mT @ keys, count + keys.shape[1])

    device = next(model.parameters()).device
    for window in tqdm(windows, desc="fitting key directions", unit="window", disable=not progress):
        probe_layers(model, window[None].to(device), layers, collect)
    directions = {}
    for layer, (total, outer, count) in moments.items():
        mean = total / count
        covariance = outer / count - mean[:, :, None] * mean[:, None, :]
        vectors = torch.linalg.eigh(covariance).eigenvectors  # ascending eigenvalues
        directions[layer] = vectors[..., -rank:].flip(-1).mT.contiguous().cpu()
    return directions


def _projected(query: torch.Tensor, key: torch.Tensor, directions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P q, P k)``: queries ``[B, Hq, Sq, R]`` and keys ``[B, Hkv, Sk, R]`` in their KV head's directions ``P``."""
    kv_heads, group = key.shape[1], query.shape[1] // key.shape[1]
    if directions.shape[0] != kv_heads or directions.shape[2] != query.shape[-1]:
        raise ValueError(f"key directions {tuple(directions.shape)} do not match [kv_heads={kv_heads}, R, "
                         f"head_dim={query.shape[-1]}]")
    basis = directions.to(device=query.device, dtype=query.dtype)
    return (torch.einsum("bhsd,hrd->bhsr", query, basis.repeat_interleave(group, 0)),
            torch.einsum("bhsd,hrd->bhsr", key, basis))


def block_scores(query: torch.Tensor, key: torch.Tensor, directions: torch.Tensor, block_size: int, scale: float,
                 q_offset: int, kv_start: torch.Tensor | RowLayout) -> torch.Tensor:
    """``[B, Hq, Sq, num_blocks]`` float32: each block's largest ``scale * (P q) . (P k)`` over its keys at or before
    the query's slot (``P``: the query's KV head's directions), blocks counted from each row's first real key
    (``kv_start``; a padded row's blocks past its keys are ``-inf``)."""
    return _scores(*_projected(query, key, directions), block_size, scale, q_offset, kv_start)


def _scores(projected_query: torch.Tensor, projected_key: torch.Tensor, block_size: int, scale: float,
            q_offset: int, kv_start: torch.Tensor | RowLayout) -> torch.Tensor:
    starts = row_starts(kv_start)
    key_length = projected_key.shape[2]
    if not bool((starts != 0).any()):
        return kernels.pooled_block_logits(projected_query, projected_key, block_size, scale, q_offset, "max")
    num_blocks = kernels.reference.num_row_blocks(key_length, kv_start, block_size)
    out = torch.full((*projected_query.shape[:3], num_blocks), float("-inf"), device=projected_query.device)
    for row, start in enumerate(starts.tolist()):  # a padded row: its blocks start at its first real key
        first = max(0, start - q_offset)  # its queries before that are padding (no score)
        if first >= projected_query.shape[2] or start >= key_length:
            continue
        scores = kernels.pooled_block_logits(projected_query[row:row + 1, :, first:],
                                             projected_key[row:row + 1, :, start:], block_size, scale,
                                             q_offset + first - start, "max")
        out[row, :, first:, :scores.shape[-1]] = scores[0]
    return out


def select_prefill(query: torch.Tensor, key: torch.Tensor, directions: torch.Tensor, *, scale: float, q_offset: int,
                   kv_start: RowLayout, block_size: int, top_k: tuple[int, int], query_tile: int, sink_blocks: int,
                   search_steps: int, query_stride: int) -> BlockSelection:
    """PLAS's prefill selection (per query head, tiles of ``query_tile`` queries) with blocks ranked by
    :func:`block_scores`: chunks of whole tiles, each chunk's scores at most :data:`CHUNK_BYTES`; with
    ``query_stride`` > 1 only the searching queries are scored (rows without padding). A left-padded batch, whose
    tiles start at each row's first real query, is one chunk with every query scored: ``[B, Hq, Sq, blocks]``
    float32 scores at once (about 4.5 GiB per row at 128K tokens, 9 query heads, block 128; a warning says so past
    :data:`CHUNK_BYTES`). On the PyTorch path (the CPU) the scores of a chunk come from its whole logit matrix,
    ``block_size`` times larger, so its chunks are ``block_size`` times smaller."""
    batch, q_heads, num_queries, _ = query.shape
    key_length = key.shape[2]
    num_blocks = kernels.reference.num_row_blocks(key_length, kv_start, block_size)
    padded = bool((row_starts(kv_start) != 0).any())
    stride = 1 if padded else min(query_stride, query_tile)
    per_query = batch * q_heads * max(num_blocks, 1) * 4 * -(-query_tile // stride) / query_tile
    if kernels.backend_for(query) != "triton":  # the reference pools a [.., Sq, Sk] logit matrix
        per_query *= block_size
    if padded and per_query * num_queries > CHUNK_BYTES:
        from .plan import warn_once  # (plan imports the methods, which import this module)

        warn_once("key scorer padded chunk", "hf_sparse's key scorer scores a left-padded batch in one chunk: %.1f GiB "
                  "of block scores at once; run long prompts one row at a time", per_query * num_queries / 2 ** 30)
    chunk = num_queries if padded else max(query_tile, int(CHUNK_BYTES // per_query) // query_tile * query_tile)
    arguments = dict(kv_heads=key.shape[1], kv_start=kv_start, block_size=block_size, top_k=top_k,
                     query_tile=query_tile, head_union=False, sink_blocks=sink_blocks, search_steps=search_steps,
                     key_length=key_length, query_stride=query_stride)
    projected_query, projected_key = _projected(query, key, directions)
    parts = []
    for first in range(0, num_queries, chunk):
        last = min(num_queries, first + chunk)
        if stride > 1:
            rows = kernels.reference.searching_queries(last - first, query_tile, stride).to(query.device) + first
            scores = kernels.pooled_block_logits(projected_query[:, :, rows], projected_key, block_size, scale,
                                                 rows + q_offset, "max")
        else:
            scores = _scores(projected_query[:, :, first:last], projected_key, block_size, scale, q_offset + first,
                             kv_start)
        parts.append(kernels.select_blocks_from_logits(scores, q_offset=q_offset + first, num_queries=last - first,
                                                       **arguments))
    if len(parts) == 1:
        return parts[0]
    return BlockSelection(indices=torch.cat([part.indices for part in parts], 2),
                          counts=torch.cat([part.counts for part in parts], 2), block_size=block_size,
                          query_tile=query_tile)


def add_fit_key_scorer_command(subparsers: Any) -> Any:
    """Add ``fit-key-scorer`` to the ``hf-sparse`` command's subparsers."""
    from .gates import GATE_FILENAME

    parser = subparsers.add_parser(
        "fit-key-scorer", help="fit PLAS's key directions (a block scorer that sees the keys) on text files",
        description="Fit each layer's key directions on windows of text (one dense forward each) and write them "
                    f"to --out/{GATE_FILENAME} (gate file version 2; hf_sparse.load_gates attaches them).")
    parser.add_argument("--model", default="default", help="local folder or Hub id; 'default' = embedded SmolLM2-135M")
    parser.add_argument("--long-context", action="store_true",
                        help="with --model default: the long-context default model (YaRN and the shipped adapter)")
    parser.add_argument("--data", nargs="+", default=["stdlib"],
                        help="text files, globs (** allowed) or folders; 'stdlib' (default) = the standard library's "
                             "package sources (hf_sparse.eval.stdlib_training_files)")
    parser.add_argument("--rank", type=int, default=16, help="directions per KV head (default 16)")
    parser.add_argument("--windows", type=int, default=4, help="windows of text (default 4)")
    parser.add_argument("--length", type=int, default=32768, help="tokens per window (default 32768)")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(run=_run_fit_key_scorer)
    return parser


def _run_fit_key_scorer(args: Any) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .eval import stdlib_training_files
    from .gates import GATE_FILENAME, save_gates
    from .training import pack_sequences, read_text_files, token_stream

    if args.rank < 1 or args.windows < 1 or args.length < 2:
        raise SystemExit("--rank, --windows must be >= 1 and --length >= 2")
    if args.long_context and args.model != "default":
        raise SystemExit("--long-context needs --model default")
    if (Path(args.out) / GATE_FILENAME).exists():
        raise SystemExit(f"{Path(args.out) / GATE_FILENAME} exists: give --out a folder without a gate file (its "
                         "gates would be lost)")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if args.model == "default":
        from .default_model import load_default_model

        try:
            model, tokenizer = load_default_model("sdpa", dtype, device, max_length=args.length,
                                                  long_context=args.long_context)
        except FileNotFoundError as error:
            raise SystemExit(str(error)) from None
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa").to(device)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    model.eval()
    patterns = [path for item in args.data for path in (stdlib_training_files() if item == "stdlib" else [item])]
    ids = pack_sequences(token_stream(read_text_files(patterns), tokenizer, args.length * args.windows), args.length)
    if ids.shape[0] < args.windows:
        raise SystemExit(f"--data holds {ids.shape[0]} windows of {args.length} tokens, {args.windows} asked")
    directions = fit_key_directions(model, ids[:args.windows], args.rank, progress=not args.no_progress)
    set_key_directions(model, directions)
    path = save_gates(model, args.out, GATE_FILENAME)
    print(f"fitted {len(directions)} layer(s) x {args.rank} key directions on {args.windows} windows of "
          f"{args.length} tokens; wrote {path}")
    return 0
