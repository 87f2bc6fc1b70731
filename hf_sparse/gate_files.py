"""The gate file a model carries: PLAS gates and key directions in one safetensors file beside the weights.

:data:`GATE_FILENAME` (FastDeploy's name) sits in the model's folder or Hub repo; ``from_pretrained`` with
``attn_implementation="plas"`` attaches it (:func:`autoload_gates`) and ``save_pretrained`` writes it back
(:func:`save_gates_alongside`). The format (``docs/gates.md``):

* one float32 tensor per gated layer, named ``layers.{i}.gate_weight`` (:func:`gate_tensor_name`), and from version 2
  a layer's key directions, ``layers.{i}.key_directions``;
* string metadata ``format``, ``format_version``, ``block_size``, ``num_layers``, ``kv_heads``, ``head_dim``,
  ``layers`` and ``base_model``.

Loading never unpickles: only ``safetensors`` is read. Writes are atomic. Under tensor parallelism
:func:`gathered_gates` and :func:`save_gates` put every rank's chunk of the heads back together.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import HFValidationError, validate_repo_id
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ._version import __version__
from .distributed import tensor_parallel_mesh, tensor_parallel_rank_and_size
from .gates import (
    GateSpec,
    attention_modules,
    directions_problem,
    gate_spec,
    get_gates,
    get_key_directions,
    model_plas_config,
    set_gates,
    set_key_directions,
)

logger = logging.getLogger(__name__)


#: Default file name (FastDeploy's), looked up in the model's folder or Hub repo.
GATE_FILENAME = "plas_attention_mlp_weight.safetensors"


#: Value of the ``format`` metadata key.
FORMAT_NAME = "hf_sparse.plas_gates"


#: Newest file format version this code reads; it writes version 2 for a file with key directions, 1 otherwise.
FORMAT_VERSION = 2


_TENSOR_NAME = "layers.{layer}.gate_weight"


_TENSOR_PATTERN = re.compile(r"^layers\.(\d+)\.gate_weight$")


#: Version 2's addition: a layer's key directions (``hf_sparse.key_scorer``), ``[kv_heads, R, head_dim]``.
_DIRECTIONS_NAME = "layers.{layer}.key_directions"


_DIRECTIONS_PATTERN = re.compile(r"^layers\.(\d+)\.key_directions$")


class GateFileError(ValueError):
    """A gate file (or Hub location) that cannot be used with the model; the message names the file and why."""


def gate_tensor_name(layer_idx: int) -> str:
    """Name of layer ``layer_idx``'s tensor in a gate file."""
    return _TENSOR_NAME.format(layer=layer_idx)


def gathered_gates(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """The attached gates with every KV head: :func:`get_gates`, or on a model split by tensor parallelism each
    rank's chunks all-gathered in rank order over the tensor-parallel group. There it is a collective: every rank
    of the group must call it (as every rank calls ``save_pretrained``, which gathers the weights)."""
    gates = get_gates(model)
    mesh = tensor_parallel_mesh(model)
    if mesh is None:
        return gates

    group, gathered = mesh.get_group(), {}
    for layer_idx, weight in gates.items():  # the same layers on every rank: set_gates attaches the same file
        local = weight.detach().contiguous()
        chunks = [torch.empty_like(local) for _ in range(mesh.size())]
        dist.all_gather(chunks, local, group=group)
        gathered[layer_idx] = torch.cat(chunks, dim=0)
    return gathered


# -- file format ----------------------------------------------------------------------------------------------
def _metadata(spec: GateSpec, layers: list[int], directions: Mapping[int, torch.Tensor]) -> dict[str, str]:
    """Version 1 for gates alone (what version-1 readers read), 2 with key directions; a file of directions alone
    names no block size (they have none)."""

    metadata = {
        "format": FORMAT_NAME,
        "format_version": "2" if directions else "1",
        "num_layers": str(spec.num_layers),
        "kv_heads": str(spec.kv_heads),
        "head_dim": str(spec.head_dim),
        "layers": ",".join(str(i) for i in layers),
        "base_model": spec.base_model,
        "hf_sparse_version": __version__,
    }
    if layers:
        metadata["block_size"] = str(spec.block_size)
    if directions:
        metadata["key_layers"] = ",".join(str(i) for i in sorted(directions))
        metadata["key_rank"] = str(next(iter(directions.values())).shape[1])
    return metadata


def write_gate_file(gates: Mapping[int, torch.Tensor], path: str | os.PathLike, spec: GateSpec,
                    key_directions: Mapping[int, torch.Tensor] | None = None) -> Path:
    """Write ``gates`` and ``key_directions`` (``{layer: [kv_heads, R, head_dim]}``, one R) to ``path`` atomically
    (:func:`save_safetensors_atomic`)."""
    layers = sorted(gates)
    directions = dict(key_directions or {})
    if not layers and not directions:
        raise ValueError("nothing to write: no gates and no key directions")
    for layer_idx in layers:
        if tuple(gates[layer_idx].shape) != spec.shape:
            raise ValueError(f"layer {layer_idx}: gate shape {tuple(gates[layer_idx].shape)} != {spec.shape}")

    problem = directions_problem(directions, spec.kv_heads, spec.head_dim, range(spec.num_layers))
    if problem:
        raise ValueError(problem)
    tensors = {gate_tensor_name(i): gates[i].detach().to("cpu", torch.float32).contiguous().clone() for i in layers}
    tensors.update({_DIRECTIONS_NAME.format(layer=i): tensor.detach().to("cpu", torch.float32).contiguous().clone()
                    for i, tensor in directions.items()})
    return save_safetensors_atomic(tensors, path, _metadata(spec, layers, directions))


def save_safetensors_atomic(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike,
                            metadata: Mapping[str, str]) -> Path:
    """Write a safetensors file atomically: a temporary file in the same folder, flushed to disk, then
    ``os.replace`` (a crash leaves the old file or the new one, never a partial one)."""

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    try:
        save_file(dict(tensors), temp, metadata=dict(metadata))
        with open(temp, "rb") as stream:
            os.fsync(stream.fileno())
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)
    return path


def _expected_names(spec: GateSpec, tensor_names: Mapping[int, str] | str | None) -> dict[str, int]:
    """File tensor name -> layer index, for every layer of the model."""
    if tensor_names is None:
        tensor_names = _TENSOR_NAME
    if isinstance(tensor_names, str):
        if "{layer}" not in tensor_names:
            raise ValueError(f"tensor_names format {tensor_names!r} must contain '{{layer}}'")
        return {tensor_names.format(layer=i): i for i in range(spec.num_layers)}
    return {name: int(layer) for layer, name in tensor_names.items()}


@contextlib.contextmanager
def _opened(path: Path) -> Iterator[Any]:
    """The gate file at ``path`` open for reading (safetensors, never unpickled); a missing or unreadable file, or
    a problem its reader finds, is a :class:`GateFileError` naming the file."""

    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            yield handle
    except GateFileError:
        raise
    except FileNotFoundError as error:
        raise GateFileError(f"{path}: no such gate file") from error
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise GateFileError(f"{path}: not a readable safetensors gate file ({error})") from error


def read_gate_file(
    path: str | os.PathLike, spec: GateSpec, tensor_names: Mapping[int, str] | str | None = None
) -> dict[int, torch.Tensor]:
    """Read and validate a gate file against ``spec``; raises :class:`GateFileError` naming the file and the problem.

    ``tensor_names`` maps layer index -> tensor name (or is a format string with ``{layer}``), for files written
    by other tools; by default the names are ``layers.{i}.gate_weight``. Metadata is checked when present (files
    without ours are validated from the tensor shapes alone).
    """
    path = Path(path)
    expected = _expected_names(spec, tensor_names)
    with _opened(path) as handle:
        metadata = handle.metadata() or {}
        names = list(handle.keys())
        _check_metadata(path, metadata, spec)
        names = [name for name in names if not _DIRECTIONS_PATTERN.match(name)]  # read_key_directions's
        unexpected = sorted(name for name in names if name not in expected)
        if unexpected:
            layer_ids = [int(m.group(1)) for m in map(_TENSOR_PATTERN.match, unexpected) if m]
            if layer_ids and tensor_names is None:
                raise GateFileError(
                    f"{path}: holds gates for layer(s) {sorted(layer_ids)} but the model has "
                    f"{spec.num_layers} layers (0..{spec.num_layers - 1})"
                )
            raise GateFileError(
                f"{path}: unexpected tensor(s) {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}; "
                f"expected names like {gate_tensor_name(0)!r} (pass tensor_names= for other layouts)"
            )
        gates = {expected[name]: handle.get_tensor(name) for name in names}
    if not gates and not read_key_directions(path, spec):
        raise GateFileError(f"{path}: holds no gate tensors")
    for layer_idx, weight in sorted(gates.items()):
        if tuple(weight.shape) != spec.shape:
            raise GateFileError(f"{path}: layer {layer_idx} gate has shape {tuple(weight.shape)}, expected "
                                f"{spec.shape}{_shape_difference(tuple(weight.shape), spec)}")
        if not weight.is_floating_point():
            raise GateFileError(f"{path}: layer {layer_idx} gate has dtype {weight.dtype}, expected a float type")
        weight = weight.float()
        if not bool(torch.isfinite(weight).all()):
            raise GateFileError(f"{path}: layer {layer_idx} gate holds NaN or infinite values")
        gates[layer_idx] = weight
    return dict(sorted(gates.items()))


def read_key_directions(path: str | os.PathLike, spec: GateSpec) -> dict[int, torch.Tensor]:
    """The key directions ``{layer: [kv_heads, R, head_dim]}`` (float32) of a version-2 gate file, ``{}`` when it
    holds none; raises :class:`GateFileError` naming the file and the problem (a layer the model lacks, a shape
    that is not the model's, several ranks, NaN)."""
    path = Path(path)
    with _opened(path) as handle:
        _check_metadata(path, handle.metadata() or {}, spec)
        found = {int(match.group(1)): handle.get_tensor(match.group(0))
                 for match in map(_DIRECTIONS_PATTERN.match, handle.keys()) if match}

    problem = directions_problem(found, spec.kv_heads, spec.head_dim, range(spec.num_layers))
    if problem:
        raise GateFileError(f"{path}: {problem}")
    return {layer: tensor.float() for layer, tensor in sorted(found.items())}


def _shape_difference(shape: tuple[int, ...], spec: GateSpec) -> str:
    if len(shape) != 3:
        return " ([kv_heads, block_size, head_dim])"
    fields = [(name, got, want) for name, got, want in zip(("kv_heads", "block_size", "head_dim"), shape, spec.shape)
              if got != want]
    return " (" + ", ".join(f"{name} {got} != model's {want}" for name, got, want in fields) + ")"


def _check_metadata(path: Path, metadata: Mapping[str, str], spec: GateSpec) -> None:
    if "format" not in metadata:
        return  # a file written by another tool: shapes are checked per tensor
    if metadata["format"] != FORMAT_NAME:
        raise GateFileError(f"{path}: metadata format {metadata['format']!r} is not {FORMAT_NAME!r}")
    try:
        version = int(metadata.get("format_version", "0"))
    except ValueError:
        version = -1
    if not 1 <= version <= FORMAT_VERSION:
        raise GateFileError(f"{path}: format_version {metadata.get('format_version')!r} is not supported "
                            f"(this hf_sparse reads versions 1..{FORMAT_VERSION})")
    for key, want in (("num_layers", spec.num_layers), ("kv_heads", spec.kv_heads), ("head_dim", spec.head_dim),
                      ("block_size", spec.block_size)):
        if key in metadata and metadata[key] != str(want):
            hint = " (set PLASConfig.block_size to match, or train gates for this block size)" if key == "block_size" else ""
            raise GateFileError(f"{path}: {key} {metadata[key]} != model's {want}{hint}")


# -- loading and saving ---------------------------------------------------------------------------------------
def _fail(message: str, strict: bool) -> dict[int, torch.Tensor]:
    if strict:
        raise GateFileError(message)
    logger.warning("%s; PLAS falls back to mean-pooled block summaries", message)
    return {}


def _looks_like_repo_id(source: str) -> bool:

    if source.endswith(".safetensors") or source.startswith((".", "/", "~")) or source.count("/") > 1:
        return False
    try:
        validate_repo_id(source)
    except HFValidationError:
        return False
    return True


def _download(repo_id: str, filename: str, revision: str | None, cache_dir: str | os.PathLike | None,
              token: str | bool | None) -> str:
    """``hf_hub_download`` with every "could not get the file" outcome turned into :class:`GateFileError`."""

    where = f"{filename} in Hub repo {repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        return hf_hub_download(repo_id, filename, revision=revision, cache_dir=cache_dir, token=token)
    except RevisionNotFoundError as error:
        raise GateFileError(f"{where}: revision not found") from error
    except RepositoryNotFoundError as error:
        raise GateFileError(f"{where}: repository not found (or not accessible)") from error
    except LocalEntryNotFoundError as error:
        # Offline (HF_HUB_OFFLINE) or unreachable Hub, and nothing in the cache.
        raise GateFileError(f"{where}: not in the local cache and the Hub could not be reached ({error})") from error
    except EntryNotFoundError as error:
        raise GateFileError(f"{where}: no such file in the repository") from error
    except (HfHubHTTPError, OfflineModeIsEnabled, OSError) as error:
        raise GateFileError(f"{where}: download failed ({error})") from error


def resolve_gate_file(source: str | os.PathLike, filename: str = GATE_FILENAME, revision: str | None = None,
                      cache_dir: str | os.PathLike | None = None, token: str | bool | None = None) -> Path:
    """Local path of the gate file that ``source`` names: a file, a folder holding ``filename``, or a Hub repo id
    (downloaded through the Hugging Face cache). Raises :class:`GateFileError` when there is none."""
    text = os.fspath(source)
    path = Path(text).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        if (path / filename).is_file():
            return path / filename
        raise GateFileError(f"{path / filename}: no gate file in the folder")
    if _looks_like_repo_id(text):
        return Path(_download(text, filename, revision, cache_dir, token))
    raise GateFileError(f"{path}: no such gate file or folder (and not a Hub repo id)")


def load_gates(
    model: torch.nn.Module,
    source: str | os.PathLike,
    revision: str | None = None,
    strict: bool = False,
    *,
    filename: str = GATE_FILENAME,
    tensor_names: Mapping[int, str] | str | None = None,
    cache_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
) -> dict[int, torch.Tensor]:
    """Load gates from a file, a folder or a Hub repo id and attach them to ``model``; returns them by layer.

    Nothing is attached unless the whole file is valid. With ``strict=False`` a missing, unreadable or mismatched
    file logs one warning and returns ``{}`` (the model keeps mean pooling, or the gates it had); a file that
    lacks some gated layers attaches the others and warns. A valid file's key directions (format version 2,
    :mod:`hf_sparse.key_scorer`) replace the model's, and a valid file without them removes them. With
    ``strict=True`` each of these raises
    :class:`GateFileError`. ``revision`` pins a Hub branch, tag or commit; ``HF_HUB_OFFLINE=1`` serves the cache.
    On a model split by tensor parallelism each rank attaches its chunk of the heads and gets the whole file's
    gates back; a head count that does not divide by ``tp_size`` is a mismatched file.
    """
    spec = gate_spec(model)
    try:
        path = resolve_gate_file(source, filename, revision, cache_dir, token)
        gates = read_gate_file(path, spec, tensor_names)
        directions = read_key_directions(path, spec)
        _, tp_size = tensor_parallel_rank_and_size(model)
        if spec.kv_heads % tp_size:
            raise GateFileError(f"{path}: its {spec.kv_heads} KV heads do not split over tensor parallelism's "
                                f"{tp_size} ranks (each rank keeps a contiguous chunk of the heads)")
        if directions and tp_size > 1:
            raise GateFileError(f"{path}: holds key directions, which hf_sparse does not split over tensor "
                                "parallelism's ranks")
    except GateFileError as error:
        return _fail(str(error), strict)
    missing = [i for i in spec.gated_layers if i not in gates]
    if missing and gates:
        message = f"{path}: no gate for layer(s) {missing}"
        if strict:
            raise GateFileError(message)
        logger.warning("%s; those layers use mean-pooled block summaries", message)

    try:  # first: a model whose attention layers the directions miss (a hybrid model) gets nothing attached
        set_key_directions(model, directions or None)  # a file without directions leaves none attached
    except ValueError as error:
        return _fail(f"{path}: {error}", strict)
    if gates:
        set_gates(model, gates)
        logger.info("loaded PLAS gates for %d layer(s) from %s", len(gates), path)
    if directions:
        logger.info("loaded PLAS key directions for %d layer(s) from %s", len(directions), path)
    return gates


def save_gates(model: torch.nn.Module, folder: str | os.PathLike, filename: str = GATE_FILENAME) -> Path:
    """Write the gates attached to ``model`` to ``folder/filename`` (atomically); returns the path.

    On a model split by tensor parallelism the file holds every KV head (:func:`gathered_gates`): every rank of the
    group must call it, and each writes the same file."""
    gates = gathered_gates(model)
    if not gates and not _attached_directions(model):
        raise ValueError("the model has no gates attached and no key directions (load_gates, train_gates or "
                         "gates.set_key_directions attach them)")
    return _write_model_gates(model, gates, Path(folder) / filename)


def _attached_directions(model: torch.nn.Module) -> dict[int, torch.Tensor]:

    found = {layer: get_key_directions(module) for layer, module in attention_modules(model).items()}
    return {layer: tensor for layer, tensor in found.items() if tensor is not None}


def _write_model_gates(model: torch.nn.Module, gates: Mapping[int, torch.Tensor], path: Path) -> Path:
    """Write ``gates`` (every KV head) and the attached key directions to ``path`` with ``model``'s metadata."""
    spec = gate_spec(model, block_size=next(iter(gates.values())).shape[1] if gates else None)
    plas = model_plas_config(model)
    if gates and spec.block_size != plas.block_size:
        logger.warning("saving gates of block size %d while the model's PLASConfig.block_size is %d",
                       spec.block_size, plas.block_size)
    return write_gate_file(gates, path, spec, _attached_directions(model))


def save_gates_alongside(model: torch.nn.Module, folder: str | os.PathLike, is_main_process: bool = True
                         ) -> Path | None:
    """For ``save_pretrained``: write the gate file into ``folder`` if gates are attached and ``is_main_process``;
    else do nothing. Under tensor parallelism every rank gathers the heads (``save_pretrained`` runs on every
    rank), whatever its ``is_main_process``, and the group's first rank writes the file."""
    if not get_gates(model) and not _attached_directions(model):
        return None
    gates = gathered_gates(model)
    if not is_main_process or tensor_parallel_rank_and_size(model)[0] != 0:
        return None
    return _write_model_gates(model, gates, Path(folder) / GATE_FILENAME)


def autoload_gates(model: torch.nn.Module, revision: str | None = None) -> dict[int, torch.Tensor]:
    """For ``from_pretrained``: load :data:`GATE_FILENAME` from the model's own folder or Hub repo.

    The location is ``model.config._name_or_path`` (a Hub model is pinned to the commit its weights came from,
    ``config._commit_hash``, unless ``revision`` is given). A missing or unusable file logs one warning and
    leaves mean pooling; this never raises for a bad file.
    """
    source = str(getattr(model.config, "_name_or_path", "") or "")
    if not source:
        logger.debug("model has no _name_or_path: no gate file to look for, PLAS uses mean pooling")
        return {}
    if revision is None and not os.path.isdir(source):
        revision = getattr(model.config, "_commit_hash", None)
    return load_gates(model, source, revision=revision, strict=False)
