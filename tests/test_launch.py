"""The direct launch of a compiled Triton kernel (:mod:`hf_sparse.kernels._launch`), on a stand-in for Triton's
JIT function: which calls go through the JIT and which straight to the kernel compiled for an earlier one."""
from __future__ import annotations

import pytest
import torch

from hf_sparse.kernels import _launch


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

    arg_names = ["x", "n", "A", "B"]

    def __init__(self, raises: bool = False) -> None:
        self.record, self.raises, self.pre_run_hooks = [], raises, []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.record.append(("jit", grid, args, kwargs))
            return Compiled(self.record, self.raises)
        return run


@pytest.fixture
def launcher(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("HF_SPARSE_DIRECT_LAUNCH", raising=False)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
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


@pytest.mark.parametrize("other", ["1", "not16", "misaligned", "dtype", "constexpr", "option", "device"])
def test_every_fact_triton_specialises_on_splits_the_key(launcher, monkeypatch, other):
    """An integer that is 1 or not a multiple of 16, a tensor at an address that is not a multiple of 16 or of
    another dtype, another constexpr, option or device: Triton's JIT again (which compiles or finds its own)."""
    x = torch.zeros(64)
    args, constexprs, options = (x, 32), dict(A=4, B=True), dict(num_warps=1)
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
    elif other == "option":
        options = dict(num_warps=2)
    else:
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    launcher((1,), args, constexprs, **options)
    launcher((1,), args, constexprs, **options)
    assert paths(launcher) == ["jit", "jit", "direct"]


@pytest.mark.parametrize("arg", [2.5, None, 2**31, -(2**31) - 1, True])
def test_other_arguments_take_tritons_path(launcher, arg):
    """Floats, None, integers past int32 and bools are specialised by other rules: never launched directly."""
    for _ in range(2):
        launcher((1,), (torch.zeros(4), arg), dict(A=4, B=True))
    assert paths(launcher) == ["jit", "jit"]


def test_off_where_it_does_not_apply(launcher, monkeypatch):
    """Pre-run hooks, constexprs out of the kernel's order, the interpreter, ROCm and HF_SPARSE_DIRECT_LAUNCH=0
    leave every call to Triton's JIT."""
    x = torch.zeros(64)
    launcher.kernel.pre_run_hooks.append(lambda *args, **kwargs: None)
    for _ in range(2):
        launcher((1,), (x, 32), dict(A=4, B=True))
    launcher.kernel.pre_run_hooks.clear()
    for _ in range(2):
        launcher((1,), (x, 32), dict(B=True, A=4))  # not the parameters' order: nothing kept
    assert paths(launcher) == ["jit"] * 4
    for variable, value in [("TRITON_INTERPRET", "1"), ("HF_SPARSE_DIRECT_LAUNCH", "0")]:
        monkeypatch.setenv(variable, value)
        assert not _launch.Launcher(Jit()).direct
        monkeypatch.delenv(variable)
    monkeypatch.setattr(torch.version, "hip", "6.0")
    assert not _launch.Launcher(Jit()).direct


def test_a_release_whose_kernels_take_other_arguments_falls_back_for_good(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    launcher = _launch.Launcher(Jit(raises=True))
    x = torch.zeros(64)
    for _ in range(3):
        launcher((1,), (x, 32), dict(A=4, B=True))
    assert paths(launcher) == ["jit", "jit", "jit"] and not launcher.direct and launcher.launches == 0


def test_the_key_holds_what_triton_specialises_on():
    x = torch.zeros(64)
    assert _launch.specialisation((x, x[4:], 1, 0, 16, 17)) == (
        (torch.float32, True), (torch.float32, True), (True, False), (False, True), (False, True), (False, False))
    assert _launch.specialisation((x[1:],)) == ((torch.float32, False),)
    assert _launch.specialisation((x, 1.0)) is None
