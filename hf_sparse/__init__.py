"""hf_sparse: sparse attention (PLAS, XAttention, Star) for HuggingFace Transformers.

Importing the package registers ``attn_implementation="plas"``, ``"xattn"`` and ``"star"``.
"""
from . import star_attention
from .recording import record_sparsity
from .cache import SparseCache
from .config import PLASConfig, StarConfig, XAttnConfig
from .gates import GATE_FILENAME, GateFileError, load_gates, push_gates_to_hub, save_gates
from .integration import attention_probe, configure, patch, unpatch
from .selection import BlockSelection
from .training import GateTrainingConfig, evaluate_gates, train_gates

__version__ = "0.1.0"

__all__ = [
    "BlockSelection",
    "GATE_FILENAME",
    "GateFileError",
    "GateTrainingConfig",
    "PLASConfig",
    "SparseCache",
    "StarConfig",
    "XAttnConfig",
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

patch()
