"""Compiled norms and MLPs of captured decode steps (hf_sparse.fusion): which modules, that they compute what the
eager modules do, that they are restored, and that a class failing to compile runs eagerly."""
from __future__ import annotations

import logging
import sys

import pytest
import torch

import hf_sparse
from hf_sparse import fusion

from conftest import build, tiny_config


@pytest.fixture
def eager_backend(monkeypatch):
    """Compile with dynamo's "eager" backend (tracing, no code generation): fast, no C++ compiler needed; the
    swap and fallback logic is what these tests check."""
    monkeypatch.setattr(fusion, "_COMPILED", {})
    monkeypatch.setattr(fusion, "_compiled_forward", lambda cls: fusion._COMPILED.setdefault(
        cls, torch.compile(cls.forward, backend="eager", dynamic=False, fullgraph=True)))
    monkeypatch.setattr(fusion, "_compiled_function", lambda key, function: fusion._COMPILED.setdefault(
        key, torch.compile(function, backend="eager", dynamic=False, fullgraph=True)))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_fusable_modules_of_a_llama():
    model = build(tiny_config(layers=2), "plas")
    names = sorted({type(m).__name__ for m in model.modules() if fusion.fusable(m)})
    assert names == ["LlamaMLP", "LlamaRMSNorm"]
    assert sum(fusion.fusable(m) for m in model.modules()) == 2 * 3 + 1  # two norms and an MLP per layer, final norm


def test_fused_modules_compute_the_eager_forward_and_are_restored(eager_backend):
    model = build(tiny_config(layers=2), "plas")
    hf_sparse.configure(model, hf_sparse.PLASConfig(block_size=16))
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    modeling = sys.modules[type(model).__module__]
    rotary = modeling.apply_rotary_pos_emb
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        with fusion.fused_modules(model) as swapped:
            assert swapped == 7 + 1  # and modeling_llama.apply_rotary_pos_emb
            assert all("forward" in m.__dict__ for m in model.modules() if fusion.fusable(m))
            assert modeling.apply_rotary_pos_emb is not rotary
            fused = model(input_ids=ids).logits
        assert not any("forward" in m.__dict__ for m in model.modules())
        assert modeling.apply_rotary_pos_emb is rotary
        assert ("transformers.models.llama.modeling_llama", "apply_rotary_pos_emb") in fusion._COMPILED
        with fusion.fused_modules(model, enabled=False) as swapped:
            assert swapped == 0
    torch.testing.assert_close(fused, expected, atol=1e-6, rtol=1e-6)


def test_a_class_that_fails_compiled_runs_eagerly(monkeypatch, caplog):
    model = build(tiny_config(layers=1), "plas")
    norm_class = type(model.model.norm)

    def failing(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(fusion, "_COMPILED", {})
    monkeypatch.setattr(fusion, "_compiled_forward", lambda cls: fusion._COMPILED.setdefault(cls, failing))
    monkeypatch.setattr(fusion, "_compiled_function", lambda key, function: None)
    x = torch.randn(1, 3, model.config.hidden_size)
    with caplog.at_level(logging.WARNING, logger="hf_sparse.fusion"), fusion.fused_modules(model):
        out = model.model.norm(x)
    torch.testing.assert_close(out, norm_class.forward(model.model.norm, x))
    assert fusion._COMPILED[norm_class] is None  # not tried again
    assert "LlamaRMSNorm runs eagerly" in caplog.text
    with fusion.fused_modules(model) as swapped:  # the failed class is no longer swapped
        assert swapped == 1  # only the MLP


def test_nested_swaps_restore_the_original_rotary_function(eager_backend):
    """A capture inside another's (two models of one class) swaps nothing twice and restores what it found."""
    model = build(tiny_config(layers=1), "plas")
    modeling = sys.modules[type(model).__module__]
    rotary = modeling.apply_rotary_pos_emb
    with fusion.fused_modules(model) as outer:
        swapped = modeling.apply_rotary_pos_emb
        with fusion.fused_modules(build(tiny_config(layers=1), "plas")) as inner:
            assert modeling.apply_rotary_pos_emb is swapped
        assert inner == outer - 1  # the other model's norms and MLP, not the function again
        assert modeling.apply_rotary_pos_emb is swapped
    assert modeling.apply_rotary_pos_emb is rotary
