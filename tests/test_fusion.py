"""Compiled norms and MLPs of captured decode steps (hf_sparse.fusion): which modules, that they compute what the
eager modules do, that they are restored, and that a class failing to compile runs eagerly."""
from __future__ import annotations

import logging
import sys

import pytest
import torch

import hf_sparse
from hf_sparse import fusion

from conftest import build, full_density, tiny_config


@pytest.fixture
def eager_backend(monkeypatch):
    """Compile with dynamo's "eager" backend (tracing, no code generation): fast, no C++ compiler needed; the
    swap and fallback logic is what these tests check."""
    monkeypatch.setattr(fusion, "_COMPILED", {})
    monkeypatch.setattr(fusion, "_ROTARY_CHECKED", {})
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
    assert names == ["LlamaMLP", "LlamaRMSNorm", "LlamaRotaryEmbedding"]
    # two norms and an MLP per layer, the final norm, the rotary embedding
    assert sum(fusion.fusable(m) for m in model.modules()) == 2 * 3 + 1 + 1
    assert fusion.fusable_head(model.lm_head)


def test_fused_modules_compute_the_eager_forward_and_are_restored(eager_backend):
    model = build(tiny_config(layers=2), "plas")
    hf_sparse.configure(model, hf_sparse.PLASConfig(block_size=16))
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    modeling = sys.modules[type(model).__module__]
    rotary = modeling.apply_rotary_pos_emb
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        with fusion.fused_modules(model) as swapped:
            # two layers whole, the norms and MLPs, the rotary embedding, the head, modeling_llama.apply_rotary_pos_emb
            assert swapped == 2 + 7 + 1 + 1 + 1
            assert all("forward" in m.__dict__ for m in model.modules() if fusion.fusable(m))
            assert "forward" in model.lm_head.__dict__
            assert modeling.apply_rotary_pos_emb is not rotary
            fused = model(input_ids=ids).logits
        assert not any("forward" in m.__dict__ for m in model.modules())
        assert modeling.apply_rotary_pos_emb is rotary
        assert ("transformers.models.llama.modeling_llama", "apply_rotary_pos_emb") in fusion._COMPILED
        with fusion.fused_modules(model, enabled=False) as swapped:
            assert swapped == 0
        with fusion.fused_modules(model, layers=False) as swapped:  # decode_fused_layers=False
            assert swapped == 7 + 1 + 1 and not any("forward" in layer.__dict__ for layer in model.model.layers)
            assert "forward" not in model.lm_head.__dict__
    torch.testing.assert_close(fused, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_rotary_embedding_in_steps_computes_the_modules_own_tables(eager_backend, monkeypatch, arch):
    """In a captured step the rotary embedding runs fusion.rotary_embedding (its position-frequency product
    elementwise: no cuBLAS call), checked once per class and rope type against the module's own forward, equal bit
    for bit; a dynamic rope type, or a call with other arguments, runs the module's own forward."""
    model = build(tiny_config(arch, layers=1), "plas")
    rotary = model.model.rotary_emb
    x = torch.randn(2, 5, model.config.hidden_size, dtype=torch.bfloat16)
    positions = torch.tensor([[7, 8, 9, 10, 11], [300, 301, 302, 303, 304]])
    own = rotary(x, positions)
    rotary_embedding = fusion.rotary_embedding
    tables = rotary_embedding(rotary.inv_freq, positions, rotary.attention_scaling, x.dtype)
    assert all(torch.equal(a, b) for a, b in zip(tables, own))
    calls = []
    monkeypatch.setattr(fusion, "rotary_embedding", lambda *a: calls.append(1) or rotary_embedding(*a))
    with fusion.fused_modules(model), torch.no_grad():
        assert "forward" in rotary.__dict__
        model(input_ids=torch.arange(6)[None])  # the model's own call (position ids by name in Llama's)
        assert fusion._ROTARY_CHECKED == {(type(rotary), rotary.rope_type): True} and len(calls) == 2
        fused = rotary(x, positions)
        assert fusion._ROTARY_KEY in fusion._COMPILED and len(calls) == 3
        rotary.rope_type = "dynamic"
        try:
            dynamic = rotary(x, positions)
        finally:
            rotary.rope_type = "default"
        assert len(fusion._ROTARY_CHECKED) == 1 and type(rotary) not in fusion._COMPILED  # its own forward, eager
    assert all(torch.equal(a, b) for a, b in zip(fused, own)) and all(torch.equal(a, b) for a, b in zip(dynamic, own))


def test_a_rotary_class_whose_tables_differ_runs_its_own_forward(eager_backend, monkeypatch):
    model = build(tiny_config(layers=1), "plas")
    rotary = model.model.rotary_emb
    x = torch.randn(1, 3, model.config.hidden_size)
    positions = torch.arange(3)[None]
    monkeypatch.setattr(rotary, "attention_scaling", 1.0)
    own = rotary(x, positions)
    monkeypatch.setattr(fusion, "rotary_embedding", lambda *args: tuple(t + 1 for t in own))
    with fusion.fused_modules(model):
        tables = rotary(x, positions)
    assert fusion._ROTARY_CHECKED == {(type(rotary), "default"): False}
    assert all(torch.equal(a, b) for a, b in zip(tables, own))


@pytest.mark.parametrize("arch, bias", [("llama", False), ("llama", True), ("mistral", False), ("qwen2", True)])
def test_fused_layer_forward_equals_the_layers_own(eager_backend, monkeypatch, arch, bias):
    """A Llama-style layer's decode step through fused_layer_forward: four decode_linear calls per layer, and on
    the PyTorch path (transformers' own ops) logits equal to the layers' own forward, whatever the method; calls
    with more rows than a decode step's, or positional arguments, run the layer's own forward."""
    from hf_sparse.cache import CACHE_KWARG, SparseCache

    config = tiny_config(arch, layers=2)
    if arch == "llama":
        config.attention_bias = config.mlp_bias = bias
    calls = []
    decode_linear = hf_sparse.kernels.decode_linear
    monkeypatch.setattr(hf_sparse.kernels, "decode_linear", lambda *a, **k: calls.append(1) or decode_linear(*a, **k))
    for method, method_config in (("plas", full_density()), ("xattn", hf_sparse.XAttnConfig(block_size=16))):
        model = build(config, method)
        hf_sparse.configure(model, method_config)
        assert all(fusion.fusable_layer(layer) for layer in model.model.layers)
        ids = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(1))
        step = torch.randint(0, 128, (2, 1), generator=torch.Generator().manual_seed(2))
        caches = [SparseCache(model.config, block_size=16, max_cache_len=64) for _ in range(2)]
        calls.clear()
        with torch.no_grad():
            for cache in caches:
                model(input_ids=ids, **{CACHE_KWARG: cache})
            expected = model(input_ids=step, **{CACHE_KWARG: caches[0]}).logits
            with fusion.fused_modules(model):
                got = model(input_ids=step, **{CACHE_KWARG: caches[1]}).logits
                assert len(calls) == 4 * 2 + 1  # four per layer, the head
                long_ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(3))
                long_fused = model(input_ids=long_ids).logits  # 80 rows: the layers' and the head's own forward
                assert len(calls) == 4 * 2 + 1
                layer = model.model.layers[0]
                hidden = torch.randn(1, 1, config.hidden_size)
                with pytest.raises(TypeError):  # positional arguments beyond the states: the layer's own forward
                    layer(hidden, None, None, None, None, None, None, None, None, None)
            assert torch.equal(got, expected), method
            assert torch.equal(long_fused, model(input_ids=long_ids).logits)
        for cache in caches:
            assert cache.get_seq_length() == 31


def test_unusual_layers_are_not_fused():
    """Hooks (but transformers' output capture), a module's forward replaced by another library, projections that are
    not plain linear layers, mixed dtypes, query / key norms, a bias on q alone or a sliding window keep a layer's own
    forward."""
    model = build(tiny_config(layers=1), "plas")
    layer = model.model.layers[0]
    assert fusion.fusable_layer(layer)
    with torch.no_grad():  # transformers' own output-capture hooks (installed on every layer from now on) are fine
        model(torch.randint(0, 128, (1, 8)), output_hidden_states=True)
    assert fusion.fusable_layer(layer)
    handle = layer.mlp.register_forward_hook(lambda *a: None)
    assert not fusion.fusable_layer(layer)
    handle.remove()
    layer.mlp.down_proj.forward = lambda x: x  # a replaced forward (transformers' tensor parallelism from 5.18)
    assert not fusion.fusable_layer(layer)
    del layer.mlp.down_proj.forward
    layer.post_attention_layernorm.to(torch.float16)
    assert not fusion.fusable_layer(layer)
    layer.post_attention_layernorm.float()
    layer.self_attn.q_norm = torch.nn.Identity()
    assert not fusion.fusable_layer(layer)
    del layer.self_attn.q_norm
    layer.self_attn.q_proj.bias = torch.nn.Parameter(torch.zeros(layer.self_attn.q_proj.out_features))
    assert not fusion.fusable_layer(layer)  # a bias on q only
    layer.self_attn.q_proj.bias = None
    assert fusion.fusable_layer(layer)
    layer.self_attn.k_proj = torch.nn.Sequential(layer.self_attn.k_proj)
    assert not fusion.fusable_layer(layer)
    assert not fusion.fusable_layer(model.model.norm)
    mistral = build(tiny_config("mistral", layers=1), "plas")
    assert fusion.fusable_layer(mistral.model.layers[0])
    windowed = tiny_config("mistral", layers=1)
    windowed.sliding_window = 64
    assert not fusion.fusable_layer(build(windowed, "plas").model.layers[0])  # its window passed to attention


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
        assert swapped == 4  # the layer whole (fused_layer_forward), its MLP, the rotary embedding, the head; no norm


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
