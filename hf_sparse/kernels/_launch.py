"""A Triton kernel's repeated launches without Triton's per-call argument binding.

``kernel[grid](*args, **constexprs)`` binds the arguments, works out what the compiled kernel is specialised on
(each tensor's dtype and whether its address is a multiple of 16; each integer's type, whether it is 1 and whether
it is a multiple of 16), builds a cache key from that, the constexprs and the options, and then launches. A prompt
of a few thousand tokens is bound by the host's time (docs/features.md, "The 8K gap is the host's"), and for the
int8 cache's write that binding costs 3-8 us of a launch's 29-38 us on two H200s (docs/features.md, "The direct
launch"). :class:`Launcher` keeps each compiled kernel under the same facts, read from the arguments in Python, and
launches it directly (``CompiledKernel[grid](*all parameters)``) when a call has the facts of an earlier one. A call
with other facts goes through ``kernel[grid]``, which compiles where needed; so does every call where the direct
launch does not apply:

* under Triton's interpreter (``TRITON_INTERPRET=1``: no compiled kernel comes back), on ROCm (whose backend
  specialises tensors by its own rules), or while ``HF_SPARSE_DIRECT_LAUNCH=0`` (both read at each call);
* with a runtime argument other than a tensor or an integer in int32's range (specialised otherwise), or an option
  or constexpr that cannot be hashed;
* when the kernel has pre-run hooks or Triton has a stages-inspection hook, or once a direct launch has raised
  ``TypeError`` (a Triton release whose compiled kernels take their parameters otherwise; logged once): that call
  and all later ones take Triton's path. (A launch hook of Triton's that raises ``TypeError`` after its kernel ran
  would have that call launched again, through the JIT.)

The key holds the facts above, each constexpr's and option's name, type and value, the settings Triton's JIT adds to
its own key (debug, instrumentation, the floating-point sanitiser where the release has one) and the device (a
compiled kernel is loaded per device): for runtime arguments of those kinds, what Triton's 3.6-3.9 key holds. It may
split one of Triton's specialisations in two, never merge two, provided the runtime arguments come first and the
constexprs last, by name, as the kernel declares them: a kernel is kept only after that is checked against its
parameters. Triton's check that the kernel's global constants have not changed since it compiled is not repeated.
"""
from __future__ import annotations

import inspect
import logging
import os
from typing import Any

import torch
from triton import knobs

from ._common import interpreting

logger = logging.getLogger(__name__)

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


def _tritons_settings() -> tuple:
    """The settings Triton's JIT adds to a kernel's key (debug, instrumentation, the floating-point sanitiser)."""
    return (knobs.runtime.debug, knobs.compilation.instrumentation_mode,
            getattr(knobs.compilation, "fpsan_homomorphic_casts", None))


def _parameters(kernel: Any) -> list[tuple[str, bool]] | None:
    """``(name, is_constexpr)`` of each parameter of ``kernel``: a JIT function's ``params``, or, for the
    interpreter's ``InterpretedFunction`` (no ``params``), its Python function's signature, a parameter annotated
    ``tl.constexpr`` being a constexpr as Triton reads it. ``None`` for an object that is neither."""
    params = getattr(kernel, "params", None)
    if params is not None:
        return [(getattr(param, "name", None), bool(getattr(param, "is_constexpr", None))) for param in params]
    function = getattr(kernel, "fn", None)
    if not callable(function):
        return None
    return [(param.name, "constexpr" in str(param.annotation))
            for param in inspect.signature(function).parameters.values()]


def _declared_order(kernel: Any, runtime: int, constexprs: dict[str, Any]) -> bool:
    """Whether ``kernel`` declares ``runtime`` runtime parameters followed by exactly ``constexprs``, in order."""
    parameters = _parameters(kernel)
    if parameters is None:
        return False
    names = [name for name, _ in parameters]
    kinds = [constexpr for _, constexpr in parameters]
    return names[runtime:] == list(constexprs) and kinds == [False] * runtime + [True] * len(constexprs)


class Launcher:
    """Launches of one ``@triton.jit`` kernel whose runtime arguments come first and constexprs last, in its
    parameter order (see the module's description). ``launches`` counts the direct launches (tests read it)."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.compiled: dict[tuple, Any] = {}
        self.direct = True
        self.launches = 0

    def _on(self) -> bool:
        return (self.direct and os.environ.get("HF_SPARSE_DIRECT_LAUNCH", "1") != "0" and not interpreting()
                and torch.version.hip is None and not getattr(self.kernel, "pre_run_hooks", None)
                and getattr(knobs.runtime, "add_stages_inspection_hook", None) is None)

    def __call__(self, grid: tuple[int, ...], args: tuple, constexprs: dict[str, Any], **options: Any) -> None:
        """``kernel[grid](*args, **constexprs, **options)``, directly to the kernel compiled for an earlier call with
        the same specialisation where that applies."""
        key = None
        if self._on():
            facts = specialisation(args)
            if facts is not None:
                values = tuple(constexprs.values())
                key = (facts, tuple(constexprs), values, tuple(map(type, values)), tuple(options.items()),
                       tuple(map(type, options.values())), _tritons_settings(), torch.cuda.current_device())
                try:
                    compiled = self.compiled.get(key)
                except TypeError:  # an unhashable option or constexpr
                    compiled = key = None
                if compiled is not None:
                    try:
                        compiled[(*grid, 1, 1)[:3]](*args, *values)  # (a compiled kernel takes all three axes)
                    except TypeError as error:  # a release whose kernels take other arguments: nothing launched
                        self.direct, self.compiled = False, {}
                        logger.warning("hf_sparse: launching %s's compiled kernel directly failed (%s); its "
                                       "launches go through Triton's JIT from now on", self.kernel, error)
                    else:
                        self.launches += 1
                        return
        compiled = self.kernel[grid](*args, **constexprs, **options)
        if (key is not None and self.direct and hasattr(compiled, "function") and hasattr(compiled, "__getitem__")
                and _declared_order(self.kernel, len(args), constexprs)):
            self.compiled[key] = compiled
