"""Block-selection policies, one file per method; ``METHODS`` maps a method name to its class."""
from .plas import PLASMethod
from .star import StarMethod
from .xattn import XAttnMethod

#: Method name (= attn_implementation) -> selection policy class taking the method's config.
METHODS = {"plas": PLASMethod, "xattn": XAttnMethod, "star": StarMethod}

__all__ = ["METHODS", "PLASMethod", "XAttnMethod", "StarMethod"]
