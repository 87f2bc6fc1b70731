"""Fitting PLAS's key directions (:mod:`hf_sparse.key_scorer`): each layer's top principal directions of its
post-RoPE keys on windows of text, written into the model's gate file (``hf-sparse fit-key-scorer``)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..gate_files import GATE_FILENAME, save_gates
from ..gates import attention_modules, gate_spec, set_key_directions
from .default_model import load_default_model
from .eval import stdlib_training_files
from .probe import probe_layers
from .text_data import pack_sequences, read_text_files, token_stream


@torch.no_grad()
def fit_key_directions(model: Any, windows: torch.Tensor, rank: int, layers: list[int] | None = None,
                       progress: bool = True) -> dict[int, torch.Tensor]:
    """Per layer, the top ``rank`` principal directions ``[kv_heads, rank, head_dim]`` (float32, orthonormal rows)
    of the post-RoPE keys of ``windows`` (``[N, L]`` token ids, one forward each with dense attention), centred per
    KV head. ``layers``: which (default: every attention layer)."""

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


def add_fit_key_scorer_command(subparsers: Any) -> Any:
    """Add ``fit-key-scorer`` to the ``hf-sparse`` command's subparsers."""

    parser = subparsers.add_parser(
        "fit-key-scorer", help="fit PLAS's key directions (a block scorer that sees the keys) on text files",
        description="Fit each layer's key directions on windows of text (one dense forward each) and write them "
                    f"to --out/{GATE_FILENAME} (gate file version 2; hf_sparse.load_gates attaches them).")
    parser.add_argument("--model", default="default", help="local folder or Hub id; 'default' = embedded SmolLM2-135M")
    parser.add_argument("--long-context", action="store_true",
                        help="with --model default: the long-context default model (YaRN and the shipped adapter)")
    parser.add_argument("--data", nargs="+", default=["stdlib"],
                        help="text files, globs (** allowed) or folders; 'stdlib' (default) = the standard library's "
                             "package sources (hf_sparse.tools.eval.stdlib_training_files)")
    parser.add_argument("--rank", type=int, default=16, help="directions per KV head (default 16)")
    parser.add_argument("--windows", type=int, default=4, help="windows of text (default 4)")
    parser.add_argument("--length", type=int, default=32768, help="tokens per window (default 32768)")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(run=_run_fit_key_scorer)
    return parser


def _run_fit_key_scorer(args: Any) -> int:

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
