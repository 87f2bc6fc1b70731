"""Models with sliding-window layers: those layers attend inside their window (dense, exactly as transformers'
sdpa path), the full-attention layers of the same model run the sparse method."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import MODEL_DEVICES, build, full_density
from transformers import Gemma3TextConfig, MistralConfig, Qwen2Config

import hf_sparse
from hf_sparse import graphs

WINDOW = 12


def window_config(arch: str):
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=4096, sliding_window=WINDOW)
    if arch == "mistral":  # every layer a window
        return MistralConfig(num_hidden_layers=2, **common)
    if arch == "qwen2":  # layer 0 full, the others windows
        return Qwen2Config(num_hidden_layers=3, use_sliding_window=True, max_window_layers=1, **common)
    return Gemma3TextConfig(num_hidden_layers=3, head_dim=16, layer_types=["sliding_attention", "full_attention",
                                                                          "sliding_attention"], **common)


def method_configs(method: str):
    """(every block selected, few blocks) for the full-attention layers; no fallback to dense by density (CUDA)."""
    if method == "plas":
        full = dataclasses.replace(full_density(block_size=16), dense_above_density=None)
        return full, hf_sparse.PLASConfig(block_size=16, prefill_top_k=(1, 1), decode_top_k=(1, 1), dense_below=0,
                                          dense_layers=(), query_union=16)
    return (hf_sparse.XAttnConfig(block_size=16, stride=4, threshold=1.0, dense_below=0, dense_layers=(),
                                  dense_above_density=None),
            hf_sparse.XAttnConfig(dense_last=0, block_size=16, stride=4, threshold=0.3, decode_threshold=0.3, dense_below=0,
                                  dense_layers=()))


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gemma3"])
@pytest.mark.parametrize("method", ["plas", "xattn"])
@pytest.mark.parametrize("device", MODEL_DEVICES)
def test_window_layers_equal_sdpa(arch, method, device):
    """Full density: the logits and greedy tokens of sdpa (fp32, 2e-4), also for a left-padded batch; the window
    layers are recorded as dense for their window, the full layers as sparse; few blocks: finite logits. On the
    CPU and (``-m gpu``) on CUDA, where the full layers run the Triton kernels."""
    config = window_config(arch)
    assert graphs.window_layers(config)
    dense, sparse = build(config, "sdpa").to(device), build(config, method).to(device)
    full, few = method_configs(method)
    hf_sparse.configure(sparse, full)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (2, 50), generator=gen).to(device)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        with hf_sparse.record_sparsity() as rec:
            out = sparse(ids, attention_mask=mask).logits
        expected = dense(ids, attention_mask=mask).logits
        torch.testing.assert_close(out[0], expected[0], atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(out[1, 7:], expected[1, 7:], atol=2e-4, rtol=2e-4)
        alone = sparse(ids[1:, 7:]).logits
        torch.testing.assert_close(alone[0], out[1, 7:], atol=2e-4, rtol=2e-4)
        windows = {i for i, kind in enumerate(getattr(config, "layer_types", None) or ["sliding_attention"] * 2)
                   if kind == "sliding_attention"}
        reasons = rec.dense_layers("prefill")
        assert set(reasons) == windows and all(r == f"sliding window of {WINDOW} tokens" for r in reasons.values())
        result = sparse.generate(ids, attention_mask=mask, return_dict_in_generate=True, **kwargs)
        assert torch.equal(result.sequences, dense.generate(ids, attention_mask=mask, **kwargs))
        cache = result.past_key_values  # a window layer keeps its window, as transformers' caches do
        assert isinstance(cache, hf_sparse.SparseCache)
        kept = [layer.keys.shape[2] for layer in cache.layers]
        assert all((kept_tokens < WINDOW) == (i in windows) for i, kept_tokens in enumerate(kept)), kept
        # A static cache (cache_implementation="static") keeps a window layer's window too, not every token.
        static = sparse.generate(ids, attention_mask=mask, return_dict_in_generate=True, cache_implementation="static",
                                 **kwargs)
        assert torch.equal(static.sequences, result.sequences)
        assert static.past_key_values.static_length is not None
        for i, layer in enumerate(static.past_key_values.layers):
            assert (layer.keys.shape[2] < WINDOW) if i in windows else layer.capacity >= 56, (i, layer.keys.shape)
        hf_sparse.configure(sparse, few)
        assert torch.isfinite(sparse(ids, attention_mask=mask).logits).all()
        assert sparse.generate(ids, attention_mask=mask, **kwargs).shape == (2, 56)


def test_star_refuses_window_layers():
    """Star Attention keeps its clear refusal of sliding-window layers longer than their window."""
    model = build(window_config("mistral"), "star")
    hf_sparse.configure(model, hf_sparse.StarConfig(block_size=16, anchor_size=16, query_tokens=4, dense_below=0))
    with pytest.raises(NotImplementedError, match="sliding-window"):
        model(torch.randint(1, 128, (1, 40)))

