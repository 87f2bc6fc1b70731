"""The long-context adapter: low-rank (LoRA) updates of every decoder projection, trained with YaRN at long
sequence lengths, stored in one small safetensors file and merged into the weights at load.

Three parts:

* **The adapter file** (:func:`save_adapter`, :func:`load_adapter`, :func:`merge_adapter`): per decoder layer and
  per linear projection (``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj``) the factors ``A`` ``[rank,
  in]`` and ``B`` ``[out, rank]``, optionally the trained RMSNorm weights, and in the safetensors header the format
  version, base model id, the rope parameters it was trained with, rank, alpha, trained sequence lengths and tokens.
  Merging adds ``(alpha / rank) * B @ A`` to each weight in float32 and casts back.
* **Training data** (:func:`long_documents`, :class:`LongDocumentStream`): long documents from installed packages'
  Python sources (site-packages, one package's files concatenated in path order; never the standard library, whose
  texts are the evaluation data, nor hf_sparse) and from an optional folder of prose (``.txt`` / ``.txt.xz``),
  packed into sequences separated by the EOS token, with a share of synthetic retrieval sequences.
* **Training** (:func:`train_long_context`, ``hf-sparse train-long-context``): LoRA with frozen base weights, the
  loss computed over chunks of the sequence (:func:`causal_lm_loss`), gradient checkpointing, AdamW with warm-up
  and decay, budgets in steps, tokens and wall-clock minutes, checkpoints to resume from, a JSON-lines log.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import lzma
import math
import os
import random
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .gates import save_safetensors_atomic
from .rope_scaling import check_context_length, rope_parameters

logger = logging.getLogger(__name__)

ADAPTER_FORMAT = "hf_sparse.long_context_adapter"
#: The adapter file version this code writes and reads.
ADAPTER_VERSION = 1
CHECKPOINT_FORMAT = "hf_sparse.long_context_checkpoint"
#: The linear projections of a decoder layer that get a low-rank update.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Where the shipped adapter of the default model lives (package data).
SHIPPED_ADAPTER = Path(__file__).parent / "data" / "smollm2_long_context.safetensors"
_REQUIRED_METADATA = ("format", "format_version", "base_model", "rope_parameters", "rank", "alpha", "projections",
                      "seq_length", "tokens_trained")


class AdapterError(ValueError):
    """An adapter file that cannot be read, or that does not fit the model."""


# -- LoRA -----------------------------------------------------------------------------------------------------
class LoRALinear(nn.Module):
    """``base(x) + (alpha / rank) * x A^T B^T`` with ``base`` frozen; ``A`` starts uniform in ``±1/sqrt(in)``
    (PyTorch's own ``nn.Linear`` initialisation), ``B`` at zero, so the wrapped layer starts equal to ``base``.
    The factors are float32 (the optimiser's master copy) and cast to the input's dtype in the forward."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.base = base
        self.rank, self.alpha = rank, float(alpha)
        self.scaling = self.alpha / rank
        bound = 1.0 / math.sqrt(base.in_features)
        initial = (torch.rand(rank, base.in_features, generator=generator) * 2 - 1) * bound
        self.lora_A = nn.Parameter(initial.to(base.weight.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(x, self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype))
        return self.base(x) + update * self.scaling


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM (``model.get_decoder().layers``)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no decoder layer list (model.get_decoder().layers)")
    return layers


def projection_modules(model: nn.Module, projections: Sequence[str] = PROJECTIONS) -> dict[str, nn.Module]:
    """``"layers.{i}.{path}"`` -> the linear projection (or its :class:`LoRALinear` wrapper) of every decoder layer,
    for each module whose attribute name is in ``projections``."""
    found: dict[str, nn.Module] = {}
    for index, layer in enumerate(decoder_layers(model)):
        for path, module in layer.named_modules():
            if path.rsplit(".", 1)[-1] in projections and isinstance(module, (nn.Linear, LoRALinear)):
                found[f"layers.{index}.{path}"] = module
    if not found:
        raise ValueError(f"{type(model).__name__}'s decoder layers have none of the projections {list(projections)}")
    return found


def norm_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``"layers.{i}.{path}"`` -> every normalisation module (a name containing "norm" and a 1-D weight) of the
    decoder layers, and ``"norm"`` -> the final norm."""
    found: dict[str, nn.Module] = {}
    for index, layer in enumerate(decoder_layers(model)):
        for path, module in layer.named_modules():
            weight = getattr(module, "weight", None)
            if "norm" in path.rsplit(".", 1)[-1] and isinstance(weight, nn.Parameter) and weight.dim() == 1:
                found[f"layers.{index}.{path}"] = module
    final = getattr(model.get_decoder(), "norm", None)
    if isinstance(getattr(final, "weight", None), nn.Parameter):
        found["norm"] = final
    return found


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    """Replace ``layers.{i}.{path}`` below the decoder with ``module``."""
    _, index, path = name.split(".", 2)
    parent_path, _, attribute = path.rpartition(".")
    layer = decoder_layers(root)[int(index)]
    parent = layer.get_submodule(parent_path) if parent_path else layer
    setattr(parent, attribute, module)


def attach_lora(model: nn.Module, rank: int = 16, alpha: float = 32.0, seed: int = 0,
                projections: Sequence[str] = PROJECTIONS) -> dict[str, LoRALinear]:
    """Wrap every projection of every decoder layer in a :class:`LoRALinear` (in place); name -> wrapper. The
    initial ``A`` factors come from ``seed`` (same seed, same start)."""
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive integer, got {rank!r}")
    generator = torch.Generator().manual_seed(seed)
    wrappers = {}
    for name, module in projection_modules(model, projections).items():
        if isinstance(module, LoRALinear):
            raise ValueError(f"{name} already carries a LoRA update: detach_lora(model) first")
        wrappers[name] = LoRALinear(module, rank, alpha, generator)
        _set_submodule(model, name, wrappers[name])
    return wrappers


def detach_lora(model: nn.Module) -> None:
    """Put the original projections back in place of their :class:`LoRALinear` wrappers (the update is dropped)."""
    for name, module in projection_modules(model).items():
        if isinstance(module, LoRALinear):
            _set_submodule(model, name, module.base)


# -- the adapter file -----------------------------------------------------------------------------------------
@dataclass
class LongContextAdapter:
    """A long-context adapter in memory: ``lora`` maps ``"layers.{i}.{path}"`` to ``(A [rank, in], B [out, rank])``;
    ``norms`` maps norm module names (:func:`norm_modules`) to trained weights (empty when norms were frozen)."""

    lora: dict[str, tuple[torch.Tensor, torch.Tensor]]
    norms: dict[str, torch.Tensor]
    rank: int
    alpha: float
    rope_parameters: dict[str, Any]
    base_model: str
    seq_lengths: list[int]
    tokens_trained: int
    projections: list[str] = field(default_factory=lambda: list(PROJECTIONS))
    training: dict[str, Any] = field(default_factory=dict)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def seq_length(self) -> int:
        """The longest trained sequence."""
        return max(self.seq_lengths)


def adapter_from_lora(wrappers: Mapping[str, LoRALinear], norms: Mapping[str, nn.Module] | None, *,
                      rope: Mapping[str, Any], base_model: str, seq_lengths: Sequence[int], tokens_trained: int,
                      training: Mapping[str, Any] | None = None) -> LongContextAdapter:
    """A :class:`LongContextAdapter` holding copies (float32, CPU) of the wrappers' factors and the norms' weights."""
    first = next(iter(wrappers.values()))
    lora = {name: (w.lora_A.detach().float().cpu().clone(), w.lora_B.detach().float().cpu().clone())
            for name, w in wrappers.items()}
    norm_weights = {name: module.weight.detach().float().cpu().clone() for name, module in (norms or {}).items()}
    projections = sorted({name.rsplit(".", 1)[-1] for name in wrappers}, key=lambda p: (PROJECTIONS + (p,)).index(p))
    return LongContextAdapter(lora, norm_weights, first.rank, first.alpha, dict(rope), base_model,
                              sorted({int(n) for n in seq_lengths}), int(tokens_trained), projections,
                              dict(training or {}))


def save_adapter(adapter: LongContextAdapter, path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``adapter`` to ``path`` (safetensors, atomically); LoRA factors in ``dtype`` (bfloat16 keeps the
    SmolLM2 adapter at rank 16 under 10 MB; merging computes in float32 either way), norms in float32."""
    tensors: dict[str, torch.Tensor] = {}
    for name, (lora_a, lora_b) in adapter.lora.items():
        tensors[f"{name}.lora_A"] = lora_a.detach().to("cpu", dtype).contiguous()
        tensors[f"{name}.lora_B"] = lora_b.detach().to("cpu", dtype).contiguous()
    for name, weight in adapter.norms.items():
        tensors[f"{name}.weight"] = weight.detach().to("cpu", torch.float32).contiguous()
    metadata = {
        "format": ADAPTER_FORMAT,
        "format_version": str(ADAPTER_VERSION),
        "base_model": adapter.base_model,
        "rope_parameters": json.dumps(adapter.rope_parameters, sort_keys=True),
        "rank": str(adapter.rank),
        "alpha": repr(float(adapter.alpha)),
        "projections": json.dumps(list(adapter.projections)),
        "seq_length": str(adapter.seq_length),
        "seq_lengths": json.dumps(list(adapter.seq_lengths)),
        "tokens_trained": str(adapter.tokens_trained),
        "training": json.dumps(adapter.training, sort_keys=True),
    }
    return save_safetensors_atomic(tensors, path, metadata)


def load_adapter(path: str | os.PathLike) -> LongContextAdapter:
    """Read an adapter file written by :func:`save_adapter`; :class:`AdapterError` (naming the problem) for a file
    of another format or version, missing or unreadable metadata, or tensors that do not form rank-``rank`` pairs."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no long-context adapter at {path}")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except (SafetensorError, OSError, ValueError) as error:
        raise AdapterError(f"{path} is not a readable safetensors file: {error}") from None
    if metadata.get("format") != ADAPTER_FORMAT:
        raise AdapterError(f"{path} is not a long-context adapter (format {metadata.get('format')!r}, "
                           f"expected {ADAPTER_FORMAT!r})")
    version = metadata.get("format_version")
    if version != str(ADAPTER_VERSION):
        raise AdapterError(f"{path} has adapter format version {version!r}; this hf_sparse reads version "
                           f"{ADAPTER_VERSION} only")
    missing = [key for key in _REQUIRED_METADATA if key not in metadata]
    if missing:
        raise AdapterError(f"{path} lacks the metadata {', '.join(missing)}")
    try:
        rank, alpha = int(metadata["rank"]), float(metadata["alpha"])
        rope = json.loads(metadata["rope_parameters"])
        projections = json.loads(metadata["projections"])
        seq_lengths = json.loads(metadata.get("seq_lengths", "[]")) or [int(metadata["seq_length"])]
        tokens_trained = int(metadata["tokens_trained"])
        training = json.loads(metadata.get("training", "{}"))
    except (ValueError, TypeError) as error:
        raise AdapterError(f"{path} has unreadable metadata: {error}") from None
    if rank < 1 or not isinstance(rope, dict) or not rope.get("rope_type") or not isinstance(projections, list):
        raise AdapterError(f"{path} has invalid metadata: rank {rank}, rope_parameters {rope!r}, "
                           f"projections {projections!r}")
    lora: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    norms: dict[str, torch.Tensor] = {}
    for name in sorted(tensors):
        stem, _, kind = name.rpartition(".")
        if kind == "lora_A":
            if f"{stem}.lora_B" not in tensors:
                raise AdapterError(f"{path}: {name} has no matching {stem}.lora_B")
            lora_a, lora_b = tensors[name], tensors[f"{stem}.lora_B"]
            if lora_a.dim() != 2 or lora_b.dim() != 2 or lora_a.shape[0] != rank or lora_b.shape[1] != rank:
                raise AdapterError(f"{path}: {stem} has factors A {tuple(lora_a.shape)} and B {tuple(lora_b.shape)}, "
                                   f"not [rank, in] and [out, rank] with rank {rank}")
            lora[stem] = (lora_a, lora_b)
        elif kind == "lora_B":
            if f"{stem}.lora_A" not in tensors:
                raise AdapterError(f"{path}: {name} has no matching {stem}.lora_A")
        elif kind == "weight" and tensors[name].dim() == 1:
            norms[stem] = tensors[name]
        else:
            raise AdapterError(f"{path}: unexpected tensor {name} {tuple(tensors[name].shape)}")
    if not lora:
        raise AdapterError(f"{path} holds no LoRA factors")
    return LongContextAdapter(lora, norms, rank, alpha, rope, metadata["base_model"], [int(n) for n in seq_lengths],
                              tokens_trained, projections, training)


def check_adapter_fits(model: nn.Module, adapter: LongContextAdapter) -> None:
    """:class:`AdapterError` unless the adapter updates exactly the model's projections named in its metadata, with
    factor shapes that fit their weights, and its norms exist in the model with the same shapes."""
    targets = projection_modules(model, adapter.projections)
    missing, extra = sorted(set(targets) - set(adapter.lora)), sorted(set(adapter.lora) - set(targets))
    if missing or extra:
        raise AdapterError(f"the adapter does not fit {type(model).__name__}: "
                           f"{len(missing)} projections without factors (first {missing[:3]}), {len(extra)} factors "
                           f"for projections the model lacks (first {extra[:3]})")
    for name, (lora_a, lora_b) in adapter.lora.items():
        module = targets[name]
        base = module.base if isinstance(module, LoRALinear) else module
        expected = (base.out_features, base.in_features)
        if (lora_b.shape[0], lora_a.shape[1]) != expected:
            raise AdapterError(f"the adapter's {name} is for a [{lora_b.shape[0]}, {lora_a.shape[1]}] weight, the "
                               f"model's is {list(expected)}: it was trained for another model")
    model_norms = norm_modules(model)
    for name, weight in adapter.norms.items():
        if name not in model_norms:
            raise AdapterError(f"the adapter has a norm {name} that the model lacks")
        if tuple(model_norms[name].weight.shape) != tuple(weight.shape):
            raise AdapterError(f"the adapter's norm {name} has shape {tuple(weight.shape)}, the model's "
                               f"{tuple(model_norms[name].weight.shape)}")


@torch.no_grad()
def merge_adapter(model: nn.Module, adapter: LongContextAdapter) -> nn.Module:
    """Add ``(alpha / rank) * B @ A`` to every adapted weight (float32 sum, cast back to the weight's dtype) and
    copy the adapter's norm weights; returns ``model``. The rope parameters are not touched: they belong in the
    config before the model is built (:func:`hf_sparse.rope_scaling.apply_rope_parameters`)."""
    check_adapter_fits(model, adapter)
    scaling = adapter.scaling
    for name, module in projection_modules(model, adapter.projections).items():
        weight = (module.base if isinstance(module, LoRALinear) else module).weight
        lora_a, lora_b = (factor.to(weight.device, torch.float32) for factor in adapter.lora[name])
        weight.copy_((weight.float() + scaling * (lora_b @ lora_a)).to(weight.dtype))
    model_norms = norm_modules(model)
    for name, value in adapter.norms.items():
        target = model_norms[name].weight
        target.copy_(value.to(target.device, target.dtype))
    return model


# -- training data --------------------------------------------------------------------------------------------
#: Packages and modules that copy or backport standard-library modules (whose texts are evaluation data): left
#: out wherever they are, vendored copies included (``pip/_vendor/typing_extensions.py``).
STDLIB_BACKPORTS = ("typing_extensions", "typing", "importlib_metadata", "importlib_resources", "zipp", "tomli",
                    "exceptiongroup", "backports", "dataclasses", "enum34", "singledispatch", "contextlib2",
                    "pathlib2", "configparser", "argparse", "funcsigs", "subprocess32", "mock", "pickle5",
                    "statistics", "_distutils", "_distutils_hack")
#: Default cap of one document's characters: a package's files are cut into documents of at most this many (at
#: file boundaries), which bounds the memory and time of tokenizing one (about 0.6M tokens at 2M characters).
MAX_DOCUMENT_CHARS = 2_000_000
_PROSE_SUFFIXES = (".txt", ".txt.xz")
#: Characters per piece when a document is tokenized (pieces cut at line ends, encoded as one parallel batch).
_TOKENIZE_PIECE_CHARS = 65_536


@dataclass(frozen=True)
class Document:
    """One training document: the files ``paths`` joined in order (code files under a ``# path`` header line)."""

    name: str
    paths: tuple[str, ...]
    root: str = ""
    kind: str = "code"

    def read(self) -> str:
        parts = []
        for path in self.paths:
            opener = lzma.open if path.endswith(".xz") else open
            with opener(path, "rt", encoding="utf-8", errors="replace") as handle:
                text = handle.read()
            if self.kind == "code":
                text = f"# {os.path.relpath(path, self.root) if self.root else path}\n{text}"
            parts.append(text.strip("\n"))
        return "\n\n".join(parts)


@functools.lru_cache(maxsize=1)
def _stdlib_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple(sorted({os.path.realpath(paths[key]) for key in ("stdlib", "platstdlib") if paths.get(key)}))


def is_stdlib_path(path: str) -> bool:
    """Whether ``path`` is a file of the standard library (installed packages below it do not count)."""
    real = os.path.realpath(path)
    for root in _stdlib_roots():
        if real.startswith(root + os.sep):
            first = os.path.relpath(real, root).split(os.sep)[0]
            if first not in ("site-packages", "dist-packages"):
                return True
    return False


def _chunked(name: str, files: Sequence[tuple[str, int]], max_chars: int, root: str, kind: str) -> list[Document]:
    """``files`` ((path, size), in order) cut at file boundaries into documents of at most ``max_chars`` (a larger
    single file stays whole)."""
    documents, current, size = [], [], 0
    for path, length in files:
        if current and size + length > max_chars:
            documents.append(current)
            current, size = [], 0
        current.append(path)
        size += length
    if current:
        documents.append(current)
    return [Document(f"{name}#{i}", tuple(paths), root, kind) for i, paths in enumerate(documents)]


def package_documents(site_packages: str | os.PathLike | None = None,
                      max_document_chars: int = MAX_DOCUMENT_CHARS) -> list[Document]:
    """Documents of the installed packages' ``*.py`` files in ``site_packages`` (default: this interpreter's
    purelib): per top-level package its files in path order (top-level modules together), cut into documents of
    at most ``max_document_chars``. Left out: anything in the standard library, hf_sparse itself,
    :data:`STDLIB_BACKPORTS`, metadata folders and editable-install hooks."""
    root = os.path.realpath(site_packages or sysconfig.get_paths()["purelib"])
    if not os.path.isdir(root):
        raise FileNotFoundError(f"no site-packages folder at {root}")
    own = os.path.realpath(Path(__file__).parent)
    groups: dict[str, list[tuple[str, int]]] = {}
    for entry in sorted(os.listdir(root)):
        full = os.path.join(root, entry)
        stem = entry[:-3] if entry.endswith(".py") else entry
        if (entry.startswith(("__", ".")) or entry.endswith((".dist-info", ".egg-info", ".libs", ".pth"))
                or stem in STDLIB_BACKPORTS or stem.startswith("hf_sparse")):
            continue
        if os.path.isdir(full):
            found = []
            for folder, subfolders, files in os.walk(full):
                subfolders[:] = sorted(d for d in subfolders if d != "__pycache__" and d not in STDLIB_BACKPORTS)
                found.extend(os.path.join(folder, f) for f in sorted(files)
                             if f.endswith(".py") and f[:-3] not in STDLIB_BACKPORTS)
            group = entry
        elif entry.endswith(".py"):
            found, group = [full], "top-level modules"
        else:
            continue
        for path in found:
            real = os.path.realpath(path)
            if not os.path.isfile(real) or is_stdlib_path(real) or real.startswith(own + os.sep):
                continue
            groups.setdefault(group, []).append((path, os.path.getsize(real)))
    documents = []
    for group, files in groups.items():
        documents.extend(_chunked(f"code:{group}", files, max_document_chars, root, "code"))
    return documents


def prose_documents(folder: str | os.PathLike, max_document_chars: int = MAX_DOCUMENT_CHARS) -> list[Document]:
    """Documents of the ``.txt`` / ``.txt.xz`` files below ``folder``: the files of one sub-folder (a Debian
    package's manuals, say) concatenated in path order, cut into documents of at most ``max_document_chars``
    (sizes of ``.xz`` files are estimated at 4x their compressed size)."""
    folder = os.path.realpath(folder)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"no prose folder at {folder}")
    groups: dict[str, list[tuple[str, int]]] = {}
    for directory, subfolders, files in os.walk(folder):
        subfolders.sort()
        for name in sorted(files):
            if not name.endswith(_PROSE_SUFFIXES):
                continue
            path = os.path.join(directory, name)
            if is_stdlib_path(path):
                continue
            size = os.path.getsize(path) * (4 if name.endswith(".xz") else 1)
            groups.setdefault(os.path.relpath(directory, folder), []).append((path, size))
    if not groups:
        raise FileNotFoundError(f"{folder} holds no {' or '.join(_PROSE_SUFFIXES)} files")
    documents = []
    for group, files in groups.items():
        documents.extend(_chunked(f"prose:{group}", files, max_document_chars, folder, "prose"))
    return documents


def _held_out(document: Document, share: float) -> bool:
    digest = hashlib.sha256(document.name.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


def long_documents(data_dir: str | os.PathLike | None = None, *, packages: bool = True,
                   site_packages: str | os.PathLike | None = None, max_document_chars: int = MAX_DOCUMENT_CHARS,
                   split: str = "train", heldout_share: float = 0.02) -> dict[str, list[Document]]:
    """The long-context training documents by source: ``"code"`` (:func:`package_documents`, unless
    ``packages=False``) and ``"prose"`` (:func:`prose_documents` of ``data_dir``, when given).

    ``split``: ``"train"`` or ``"heldout"``: each document is held out, by a hash of its name, with probability
    ``heldout_share`` (the same documents on every machine with the same packages), ``"all"`` keeps every one."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
    if not 0.0 <= heldout_share < 1.0:
        raise ValueError(f"heldout_share must be in [0, 1), got {heldout_share!r}")
    sources: dict[str, list[Document]] = {}
    if packages:
        sources["code"] = package_documents(site_packages, max_document_chars)
    if data_dir is not None:
        sources["prose"] = prose_documents(data_dir, max_document_chars)
    if not sources:
        raise ValueError("no training source: enable packages or give data_dir")
    if split != "all":
        keep = split == "heldout"
        sources = {name: [d for d in docs if _held_out(d, heldout_share) == keep] for name, docs in sources.items()}
    return {name: docs for name, docs in sources.items() if docs}


def _tokenize(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text``, encoded in pieces of about :data:`_TOKENIZE_PIECE_CHARS` cut after a line end (one
    batch, which fast tokenizers encode in parallel; only a piece boundary can tokenize differently)."""
    pieces, start = [], 0
    while start < len(text):
        end = min(len(text), start + _TOKENIZE_PIECE_CHARS)
        if end < len(text):
            cut = text.rfind("\n", start, end)
            end = cut + 1 if cut > start else end
        pieces.append(text[start:end])
        start = end
    if not pieces:
        return []
    encoded = tokenizer(pieces, add_special_tokens=False, verbose=False).input_ids
    return [token for piece in encoded for token in piece]


class _Cursor:
    """A position in an endless, seeded walk over one source's documents (each followed by the EOS token): the
    order is a fresh seeded shuffle each epoch; the state is (epoch, position in the order, token offset)."""

    def __init__(self, documents: Sequence[Document], tokenizer: Any, seed: int, name: str) -> None:
        self.documents, self.tokenizer, self.seed, self.name = list(documents), tokenizer, seed, name
        self.epoch = self.position = self.offset = 0
        self._order: tuple[int, list[int]] | None = None
        self._tokens: tuple[tuple[int, int], list[int]] | None = None

    def _document_index(self) -> int:
        if self._order is None or self._order[0] != self.epoch:
            order = list(range(len(self.documents)))
            random.Random(f"{self.seed}:{self.name}:{self.epoch}").shuffle(order)
            self._order = (self.epoch, order)
        return self._order[1][self.position]

    def _current(self) -> list[int]:
        key = (self.epoch, self.position)
        if self._tokens is None or self._tokens[0] != key:
            document = self.documents[self._document_index()]
            tokens = _tokenize(self.tokenizer, document.read()) + [self.tokenizer.eos_token_id]
            self._tokens = (key, tokens)
        return self._tokens[1]

    def take(self, count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count:
            tokens = self._current()
            piece = tokens[self.offset: self.offset + count - len(out)]
            out.extend(piece)
            self.offset += len(piece)
            if self.offset >= len(tokens):
                self.offset, self.position = 0, self.position + 1
                if self.position == len(self.documents):
                    self.position, self.epoch = 0, self.epoch + 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "offset": self.offset}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.epoch, self.position, self.offset = int(state["epoch"]), int(state["position"]), int(state["offset"])


#: The phrasings of synthetic retrieval sequences (none is the demo's pass-key text or its filler).
RETRIEVAL_KEYS = ("access code", "secret number", "reference number", "ticket number", "locker combination",
                  "order number", "verification code", "serial number")
RETRIEVAL_STATEMENTS = ("The {key} is {number}.", "Remember this: the {key} is {number}.",
                        "Note for later - {key}: {number}.", "Please keep in mind that the {key} is {number}.",
                        "Important: the {key} you will need is {number}.", "({key}: {number})")
RETRIEVAL_QUESTIONS = ("What is the {key} mentioned in the text above? The {key} is",
                       "Question: what was the {key}? Answer: the {key} is",
                       "Recall the {key} that was stated earlier. The {key} is",
                       "Which {key} was given above? It was")


def retrieval_sequence(haystack: Callable[[int], list[int]], tokenizer: Any, length: int,
                       rng: random.Random) -> tuple[list[int], str]:
    """``length`` token ids: a random 5-7-digit number stated once at a random depth of a haystack (``haystack(n)``
    gives its ``n`` tokens: the training prose) and asked for at the end, followed by the answer and EOS; returns
    the ids and the number. Trained with the ordinary LM loss: the answer is part of the sequence."""
    digits = rng.randint(5, 7)
    number = str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))
    key = rng.choice(RETRIEVAL_KEYS)
    statement = "\n" + rng.choice(RETRIEVAL_STATEMENTS).format(key=key, number=number) + "\n"
    question = "\n\n" + rng.choice(RETRIEVAL_QUESTIONS).format(key=key) + f" {number}."
    statement_ids = tokenizer(statement, add_special_tokens=False).input_ids
    tail_ids = tokenizer(question, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    room = length - len(statement_ids) - len(tail_ids)
    if room < 1:
        raise ValueError(f"a retrieval sequence needs more than {length} tokens")
    hay = haystack(room)
    depth = rng.randint(0, room)
    return hay[:depth] + statement_ids + hay[depth:] + tail_ids, number


class LongDocumentStream:
    """An endless, deterministic stream of training sequences (1-D int64 tensors) packed from documents.

    Each sequence ``i`` draws from a generator seeded by ``(seed, i)``: its length (one of ``seq_length``, uniform),
    whether it is a synthetic retrieval sequence (probability ``retrieval_share``; :func:`retrieval_sequence`, its
    haystack taken from the prose source when there is one), else its source (``"prose"`` with probability
    ``prose_share`` when both sources exist). A source's documents follow each other in a seeded order, each ended
    by the EOS token; a sequence continues where the previous one of its source stopped. :meth:`state_dict` /
    :meth:`load_state_dict` save and restore the position exactly.
    """

    def __init__(self, documents: Mapping[str, Sequence[Document]] | Sequence[Document], tokenizer: Any,
                 seq_length: int | Sequence[int], *, seed: int = 0, prose_share: float = 0.5,
                 retrieval_share: float = 0.1) -> None:
        if not isinstance(documents, Mapping):
            documents = {"code": list(documents)}
        self.sources = {name: list(docs) for name, docs in documents.items() if docs}
        if not self.sources:
            raise ValueError("no documents to train on")
        unknown = sorted(set(self.sources) - {"code", "prose"})
        if unknown:
            raise ValueError(f"sources must be 'code' and/or 'prose', got {unknown}")
        if getattr(tokenizer, "eos_token_id", None) is None:
            raise ValueError("the tokenizer has no EOS token to separate documents with")
        self.seq_lengths = [seq_length] if isinstance(seq_length, int) else list(seq_length)
        if not self.seq_lengths or any(not isinstance(n, int) or n < 2 for n in self.seq_lengths):
            raise ValueError(f"seq_length must be an integer >= 2 or a list of them, got {seq_length!r}")
        for name, value in (("prose_share", prose_share), ("retrieval_share", retrieval_share)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
        self.tokenizer, self.seed = tokenizer, seed
        self.prose_share, self.retrieval_share = prose_share, retrieval_share
        self.index = 0
        self._cursors = {name: _Cursor(docs, tokenizer, seed, name) for name, docs in self.sources.items()}

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        rng = random.Random(f"{self.seed}:sequence:{self.index}")
        length = rng.choice(self.seq_lengths)
        haystack = self._cursors.get("prose") or self._cursors["code"]
        if self.retrieval_share and rng.random() < self.retrieval_share:
            ids, _ = retrieval_sequence(haystack.take, self.tokenizer, length, rng)
        else:
            use_prose = "prose" in self._cursors and ("code" not in self._cursors or rng.random() < self.prose_share)
            ids = self._cursors["prose" if use_prose else "code"].take(length)
        self.index += 1
        return torch.tensor(ids, dtype=torch.long)

    def _fingerprint(self) -> dict[str, Any]:
        return {"kind": "long_documents", "seed": self.seed, "seq_lengths": self.seq_lengths,
                "prose_share": self.prose_share, "retrieval_share": self.retrieval_share,
                "documents": {name: [len(docs), hashlib.sha256("\n".join(d.name for d in docs).encode()).hexdigest()]
                              for name, docs in sorted(self.sources.items())}}

    def state_dict(self) -> dict[str, Any]:
        return {**self._fingerprint(), "index": self.index,
                "cursors": {name: cursor.state_dict() for name, cursor in self._cursors.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        expected = self._fingerprint()
        stored = {key: state.get(key) for key in expected}
        if json.loads(json.dumps(stored)) != json.loads(json.dumps(expected)):
            changed = [key for key in expected if json.dumps(stored[key]) != json.dumps(expected[key])]
            raise ValueError(f"the checkpoint's data stream differs from this one in {', '.join(changed)}: resume "
                             "with the same data, seed, lengths and shares")
        self.index = int(state["index"])
        for name, cursor in self._cursors.items():
            cursor.load_state_dict(state["cursors"][name])


class TensorSequences:
    """Consecutive windows of ``seq_length`` tokens of a 1-D token tensor, cycling (or the rows of a 2-D one),
    with the same ``state_dict`` interface as :class:`LongDocumentStream`."""

    def __init__(self, tokens: torch.Tensor, seq_length: int | None = None) -> None:
        if tokens.dim() == 2:
            rows = tokens
        elif tokens.dim() == 1 and seq_length:
            count = tokens.numel() // seq_length
            if count == 0:
                raise ValueError(f"{tokens.numel()} tokens are fewer than one sequence of {seq_length}")
            rows = tokens[: count * seq_length].view(count, seq_length)
        else:
            raise ValueError("a token tensor must be 2-D [sequences, length] or 1-D with seq_length")
        self.rows = rows.long().clone()
        self.seq_lengths = [int(self.rows.shape[1])]
        self.index = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        row = self.rows[self.index % self.rows.shape[0]]
        self.index += 1
        return row

    def state_dict(self) -> dict[str, Any]:
        digest = hashlib.sha256(self.rows.numpy().tobytes()).hexdigest()
        return {"kind": "tensor", "index": self.index, "sha256": digest}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != "tensor" or state.get("sha256") != self.state_dict()["sha256"]:
            raise ValueError("the checkpoint was trained on other token data")
        self.index = int(state["index"])


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
    from safetensors import safe_open

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
    from tqdm.auto import tqdm

    from .training import _GracefulStop

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
        with _GracefulStop(True) as stopper:
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
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .default_model import DEFAULT_MODEL_ID, default_model_dir
    from .rope_scaling import apply_yarn, trained_length

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
