"""A Triton kernel's repeated launches without Triton's per-call argument binding.

``kernel[grid](*args, **constexprs)`` binds the arguments, works out what the compiled kernel is specialised on
(each tensor's dtype and whether its address is a multiple of 16; each integer's type, whether it is 1 and whether
it is a multiple of 16), builds a cache key from that and the options, and then launches. Over 30 layers of a
prompt of a few thousand tokens, which is bound by the host's time, that binding is most of a launch's cost
(docs/features.md, "The 8K gap is the host's"). :class:`Launcher` keeps each compiled kernel under the same facts,
read from the arguments in Python, and launches it directly (``CompiledKernel[grid](*all parameters)``) when a call
has the facts of an earlier one. A call with any other facts goes through ``kernel[grid]``, which compiles where
needed; so does every call where the direct launch does not apply:

* under Triton's interpreter (``TRITON_INTERPRET=1``: no compiled kernel comes back), on ROCm (whose backend
  specialises tensors by its own rules), or when ``HF_SPARSE_DIRECT_LAUNCH=0``;
* with an argument other than a tensor or an integer in int32's range (these are specialised otherwise);
* when the kernel has pre-run hooks, or once a direct launch has raised ``TypeError`` (a Triton release whose
  compiled kernels take their parameters otherwise): that call and all later ones take Triton's own path.

The key holds at least everything Triton's own key holds for such arguments (it may split one of Triton's
specialisations in two, never merge two), and the device, since a compiled kernel is loaded per device.
"""
from __future__ import annotations

import os
from typing import Any

import torch

#: int32's range: integers outside it are specialised as int64 / uint64 (left to Triton's own path).
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def specialisation(args: tuple) -> tuple | None:
    """What a compiled Triton kernel is specialised on, from runtime arguments that are tensors or int32-range
    integers: per tensor its dtype and whether its address is a multiple of 16, per integer whether it is 1 and
    whether it is a multiple of 16. None when an argument is of another kind."""
    key = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            key.append((arg.dtype, arg.data_ptr() & 15 == 0))
        elif type(arg) is int and _INT32_MIN <= arg <= _INT32_MAX:
            key.append((arg == 1, arg & 15 == 0))
        else:
            return None
    return tuple(key)


def _enabled() -> bool:
    return (os.environ.get("TRITON_INTERPRET") != "1" and os.environ.get("HF_SPARSE_DIRECT_LAUNCH", "1") != "0"
            and torch.version.hip is None)


class Launcher:
    """Launches of one ``@triton.jit`` kernel whose runtime arguments come first and constexprs last, in its
    parameter order (see the module's description). ``launches`` counts the direct launches (tests read it)."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.compiled: dict[tuple, Any] = {}
        self.direct = _enabled()
        self.launches = 0

    def __call__(self, grid: tuple[int, ...], args: tuple, constexprs: dict[str, Any], **options: Any) -> None:
        """``kernel[grid](*args, **constexprs, **options)``, directly to the kernel compiled for an earlier call with
        the same specialisation where that applies."""
        key = None
        if self.direct and not getattr(self.kernel, "pre_run_hooks", None):
            facts = specialisation(args)
            if facts is not None:
                values = tuple(constexprs.values())
                key = (facts, values, tuple(options.items()), torch.cuda.current_device())
                compiled = self.compiled.get(key)
                if compiled is not None:
                    try:
                        compiled[(*grid, 1, 1)[:3]](*args, *values)  # (a compiled kernel takes all three axes)
                    except TypeError:  # a release whose compiled kernels take other arguments: nothing launched
                        self.direct, self.compiled = False, {}
                    else:
                        self.launches += 1
                        return
        compiled = self.kernel[grid](*args, **constexprs, **options)
        names = list(getattr(self.kernel, "arg_names", ()))
        if (key is not None and self.direct and hasattr(compiled, "function") and hasattr(compiled, "__getitem__")
                and names == [*names[:len(args)], *constexprs]):
            self.compiled[key] = compiled
