"""Block-selection policies, one file per method; ``METHODS`` maps a method name to its class."""
from .plas import PLASMethod

#: Method name (= attn_implementation) -> selection policy class taking the method's config.
METHODS = {"plas": PLASMethod}

__all__ = ["METHODS", "PLASMethod"]
