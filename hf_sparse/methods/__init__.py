"""Block-selection policies, one file per method."""
from .plas import PLASMethod

__all__ = ["PLASMethod"]
