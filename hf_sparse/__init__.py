"""hf_sparse: sparse attention (PLAS, XAttention, Star) for HuggingFace Transformers.

Importing the package registers ``attn_implementation="plas"``, ``"xattn"`` and ``"star"``. The package has two
layers: the runtime (every module outside :mod:`hf_sparse.tools`: what a model needs at inference) and the tools
(:mod:`hf_sparse.tools`: training, evaluation, the default model, the command line), which import the runtime and
never the reverse.
"""
import importlib
from typing import Any

from . import star_attention
from ._version import __version__
from .cache import SparseCache
from .config import PLASConfig, StarConfig, XAttnConfig
from .gate_files import GATE_FILENAME, GateFileError, load_gates, save_gates
from .integration import attention_probe, configure, patch, unpatch
from .recording import record_sparsity
from .selection import BlockSelection

#: Public names that live in the tools layer, by module: they load when first used, so that importing hf_sparse to
#: run a model never imports a tool (PEP 562's module ``__getattr__``, as transformers' own lazy module does).
_TOOL_NAMES = {
    "GateTrainingConfig": "gate_training",
    "train_gates": "gate_training",
    "evaluate_gates": "gate_eval",
    "push_gates_to_hub": "hub",
}

__all__ = [
    "BlockSelection",
    "GATE_FILENAME",
    "GateFileError",
    "GateTrainingConfig",
    "PLASConfig",
    "SparseCache",
    "StarConfig",
    "XAttnConfig",
    "__version__",
    "attention_probe",
    "configure",
    "evaluate_gates",
    "load_gates",
    "patch",
    "push_gates_to_hub",
    "record_sparsity",
    "save_gates",
    "star_attention",
    "train_gates",
    "unpatch",
]


def __getattr__(name: str) -> Any:
    module = _TOOL_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_sparse' has no attribute {name!r}")
    return getattr(importlib.import_module(f".tools.{module}", __name__), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_TOOL_NAMES))


patch()
