"""The direct launch of a compiled Triton kernel (:mod:`hf_sparse.kernels._launch`), on a stand-in for Triton's
JIT function: which calls go through the JIT and which straight to the kernel compiled for an earlier one; and the
launcher's key against Triton's own specialisation rules."""
from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("triton")
from hf_sparse.kernels import _launch  # noqa: E402  (needs triton)


class Compiled:
    """A compiled kernel's stand-in: ``compiled[grid](*parameters)`` records the launch."""

    function = object()

    def __init__(self, record: list, raises: bool = False) -> None:
        self.record, self.raises = record, raises

    def __getitem__(self, grid):
        def runner(*parameters):
            if self.raises:
                raise TypeError("this release takes other arguments")
            self.record.append(("direct", (grid[0], grid[1], grid[2]), parameters))  # (as Triton reads it)
        return runner


class Jit:
    """A ``@triton.jit`` function's stand-in: two runtime arguments, then the constexprs ``A`` and ``B``."""

    params = [types.SimpleNamespace(name=name, is_constexpr=name.isupper()) for name in ("x", "n", "A", "B")]

    def __init__(self, raises: bool = False) -> None:
        self.record, self.raises, self.pre_run_hooks = [], raises, []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.record.append(("jit", grid, args, kwargs))
            return Compiled(self.record, self.raises)
        return run


@pytest.fixture
def environment(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("HF_SPARSE_DIRECT_LAUNCH", raising=False)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return monkeypatch


@pytest.fixture
def launcher(environment):
    return _launch.Launcher(Jit())


def paths(launcher) -> list[str]:
    return [entry[0] for entry in launcher.kernel.record]


def test_a_repeated_specialisation_launches_directly_with_every_parameter(launcher):
    x = torch.zeros(64)
    launcher((3,), (x, 32), dict(A=4, B=True), num_warps=1)
    launcher((5, 2), (x, 48), dict(A=4, B=True), num_warps=1)  # 48: a multiple of 16 too
    assert paths(launcher) == ["jit", "direct"] and launcher.launches == 1
    assert launcher.kernel.record[0][2:] == ((x, 32), dict(A=4, B=True, num_warps=1))
    assert launcher.kernel.record[1] == ("direct", (5, 2, 1), (x, 48, 4, True))


@pytest.mark.parametrize("other", ["1", "not16", "misaligned", "dtype", "constexpr", "constexpr type", "names",
                                   "option", "device", "debug"])
def test_every_fact_triton_specialises_on_splits_the_key(launcher, environment, other):
    """An integer that is 1 or not a multiple of 16, a tensor at an address that is not a multiple of 16 or of
    another dtype, another constexpr value (or type: ``1 == True``), names, option, device or Triton debug setting:
    Triton's JIT again (which compiles or finds its own)."""
    x = torch.zeros(64)
    args, constexprs, options = (x, 32), dict(A=1, B=True), dict(num_warps=1)
    launcher((1,), args, constexprs, **options)
    if other == "1":
        args = (x, 1)
    elif other == "not16":
        args = (x, 33)
    elif other == "misaligned":
        args = (x[1:], 32)
    elif other == "dtype":
        args = (x.double(), 32)
    elif other == "constexpr":
        constexprs = dict(A=8, B=True)
    elif other == "constexpr type":
        constexprs = dict(A=True, B=True)
    elif other == "names":
        constexprs = dict(B=1, A=True)
    elif other == "option":
        options = dict(num_warps=2)
    elif other == "device":
        environment.setattr(torch.cuda, "current_device", lambda: 1)
    else:
        environment.setattr(_launch.knobs.runtime, "debug", True)
    launcher((1,), args, constexprs, **options)
    launcher((1,), args, constexprs, **options)
    assert paths(launcher) == ["jit", "jit", "jit" if other == "names" else "direct"]  # (names out of order: kept none)


@pytest.mark.parametrize("arg", [2.5, None, 2**31, -(2**31) - 1, True])
def test_other_arguments_take_tritons_path(launcher, arg):
    """Floats, None, integers past int32 and bools are specialised by other rules: never launched directly."""
    for _ in range(2):
        launcher((1,), (torch.zeros(4), arg), dict(A=4, B=True))
    assert paths(launcher) == ["jit", "jit"]


def test_unhashable_options_and_undeclared_orders_take_tritons_path(launcher):
    """An option that cannot be hashed, constexprs out of the kernel's order, and constexprs passed as runtime
    arguments are never launched directly."""
    x = torch.zeros(64)
    for _ in range(2):
        launcher((1,), (x, 32), dict(A=4, B=True), extern_libs={"lib": "path"})
    for _ in range(2):
        launcher((1,), (x, 32), dict(B=True, A=4))
    for _ in range(2):
        launcher((1,), (x, 32, 4), dict(B=True))  # A passed as a runtime argument
    assert paths(launcher) == ["jit"] * 6


def test_off_where_it_does_not_apply(launcher, environment):
    """Pre-run hooks, Triton's stages-inspection hook, the interpreter, ROCm and HF_SPARSE_DIRECT_LAUNCH=0 (read at
    each call) leave every call to Triton's JIT."""
    x = torch.zeros(64)
    launcher((1,), (x, 32), dict(A=4, B=True))
    launcher.kernel.pre_run_hooks.append(lambda *args, **kwargs: None)
    launcher((1,), (x, 32), dict(A=4, B=True))
    launcher.kernel.pre_run_hooks.clear()
    environment.setattr(_launch.knobs.runtime, "add_stages_inspection_hook", lambda: ("key", "hash"), raising=False)
    launcher((1,), (x, 32), dict(A=4, B=True))
    environment.setattr(_launch.knobs.runtime, "add_stages_inspection_hook", None, raising=False)
    for variable, value in [("TRITON_INTERPRET", "1"), ("HF_SPARSE_DIRECT_LAUNCH", "0")]:
        environment.setenv(variable, value)
        launcher((1,), (x, 32), dict(A=4, B=True))
        environment.delenv(variable)
    environment.setattr(torch.version, "hip", "6.0")
    launcher((1,), (x, 32), dict(A=4, B=True))
    environment.setattr(torch.version, "hip", None)
    assert paths(launcher) == ["jit"] * 6
    launcher((1,), (x, 32), dict(A=4, B=True))
    assert paths(launcher)[-1] == "direct"


def test_quantize_appends_launch_matches_its_kernels_parameters(monkeypatch):
    """The int8 cache's write passes its kernel's runtime parameters, then its constexprs by name, in the kernel's
    order (else the launcher would keep no compiled kernel and never launch directly)."""
    import importlib

    module = importlib.import_module("hf_sparse.kernels.quantize_append")
    calls = []
    monkeypatch.setattr(module, "_LAUNCH", lambda grid, args, constexprs, **options: calls.append((args, constexprs)))
    states, scales = torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 32)
    for values, start in [(torch.zeros(1, 2, 32, 16, dtype=torch.int8), 4),
                          (torch.zeros(1, 2, 2, 16, 16, dtype=torch.int8), torch.tensor([4]))]:
        module.quantize_append(states, states, torch.zeros(1, 2, 32, 16, dtype=torch.int8), values, scales, scales,
                               start)
    for args, constexprs in calls:
        assert _launch._declared_order(module._quantize_append_kernel, len(args), constexprs)
    assert len(calls) == 2


def test_a_release_whose_kernels_take_other_arguments_falls_back_for_good(environment, caplog):
    launcher = _launch.Launcher(Jit(raises=True))
    x = torch.zeros(64)
    with caplog.at_level("WARNING", logger="hf_sparse"):
        for _ in range(3):
            launcher((1,), (x, 32), dict(A=4, B=True))
    assert paths(launcher) == ["jit", "jit", "jit"] and not launcher.direct and launcher.launches == 0
    assert len(caplog.records) == 1 and "Triton's JIT from now on" in caplog.records[0].getMessage()


def test_equal_facts_are_equal_specialisations_in_triton():
    """Values the launcher's key does not tell apart get the same specialisation from Triton's own rules (its
    native specialiser, on the CPU): the key never merges two of Triton's specialisations."""
    from triton.backends.compiler import BaseBackend

    try:
        from triton._C.libtriton import native_specialize_impl
    except ImportError:
        pytest.skip("this triton has no native_specialize_impl")
    x = torch.zeros(256)
    values = [0, 1, 2, 15, 16, 17, 32, 48, -1, -16, 2**31 - 1, -(2**31), x, x[1:], x[3:], x[4:], x[8:], x.half(),
              x.half()[8:], x.half()[4:], x.to(torch.int8)[16:], x.to(torch.int8)[3:], x.bfloat16()]
    triton_of = {id(v): native_specialize_impl(BaseBackend, v, False, True, True) for v in values}
    for a in values:
        for b in values:
            if _launch.specialisation((a,)) == _launch.specialisation((b,)):
                assert triton_of[id(a)] == triton_of[id(b)], (a, b)


def test_the_key_holds_what_triton_specialises_on():
    x = torch.zeros(64)
    assert _launch.specialisation((x, x[4:], 1, 0, 16, 17)) == (
        (torch.float32, True), (torch.float32, True), (True, False), (False, True), (False, True), (False, False))
    assert _launch.specialisation((x[1:],)) == ((torch.float32, False),)
    assert _launch.specialisation((x, 1.0)) is None
