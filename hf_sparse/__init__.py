"""hf_sparse: sparse attention (PLAS, XAttention, Star) for HuggingFace Transformers.

Importing the package registers ``attn_implementation="plas"`` (and the pending "xattn", "star").
"""
from .attention import record_sparsity
from .cache import SparseCache
from .config import PLASConfig
from .integration import attention_probe, configure, patch, unpatch
from .selection import BlockSelection

__version__ = "0.1.0"

__all__ = [
    "BlockSelection",
    "PLASConfig",
    "SparseCache",
    "attention_probe",
    "configure",
    "patch",
    "record_sparsity",
    "unpatch",
]

patch()
