"""Gemma 2's attention logit softcapping and GPT-OSS's attention sinks: "plas" and "xattn" compute them as
transformers' eager attention does (the kernels' own tests: tests/test_kernels.py, tests/test_xattn_scores.py)."""
from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, GptOssConfig

import hf_sparse
from conftest import MODEL_DEVICES

WINDOW = 12
SOFTCAP = 5.0


def model_config(arch: str, softcap: float | None = SOFTCAP):
    """Tiny Gemma 2 (softcapping) or GPT-OSS (sinks, a two-expert MoE): layer 0 a sliding window, layer 1 full."""
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, num_hidden_layers=2, sliding_window=WINDOW, max_position_embeddings=4096)
    if arch == "gemma2":
        return Gemma2Config(attn_logit_softcapping=softcap, **common)
    return GptOssConfig(num_local_experts=2, num_experts_per_tok=1, **common)


def build(config, attn: str, sinks: bool = True):
    """fp32 random-init model whose attention features matter: Gemma 2's queries and keys scaled so that scores
    reach the cap (random init leaves them near 0); GPT-OSS's sinks set around the log of the key count, so that
    they take a real share of each softmax (``sinks=False``: sinks far below every score, i.e. none)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn,
                                             dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            attention = layer.self_attn
            if hasattr(attention, "sinks"):
                attention.sinks.copy_(torch.linspace(1.0, 5.0, attention.sinks.numel()) if sinks else -1e4)
            else:
                attention.q_proj.weight.mul_(20.0)
                attention.k_proj.weight.mul_(20.0)
    return model


def skip_unless_runs(backend: str, device: str) -> None:
    """The PyTorch reference runs everywhere; the Triton kernels on CUDA, and on CPU models in the interpreter
    (``TRITON_INTERPRET=1 pytest tests/test_softcap_sinks.py -k triton``)."""
    if backend == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton path on CPU models needs TRITON_INTERPRET=1")


def method_configs(method: str):
    """(dense below 10K tokens, every block selected on the sparse path, few blocks); no fallback to dense by
    density (on CUDA)."""
    if method == "plas":
        common = dict(block_size=16, dense_layers=(), query_union=16, dense_above_density=None)
        return (hf_sparse.PLASConfig(dense_below=10_000, **common),
                hf_sparse.PLASConfig(prefill_top_k=(10_000, 10_000), decode_top_k=(10_000, 10_000), dense_below=0,
                                     **common),
                hf_sparse.PLASConfig(prefill_top_k=(1, 1), decode_top_k=(1, 1), dense_below=0, **common))
    common = dict(block_size=16, stride=4, dense_layers=(), dense_above_density=None)
    return (hf_sparse.XAttnConfig(dense_below=10_000, **common),
            hf_sparse.XAttnConfig(threshold=1.0, dense_below=0, **common),
            hf_sparse.XAttnConfig(dense_last=0, threshold=0.3, decode_threshold=0.3, dense_below=0, **common))


def padded_batch(length: int = 50, device: str = "cpu"):
    """Two prompts, the second left-padded by 7 tokens."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (2, length), generator=gen).to(device)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    return ids, mask


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
def test_the_features_matter_in_these_models(arch):
    """The test models are ones where softcapping / sinks change the logits (so the tests below check them)."""
    ids, mask = padded_batch()
    with torch.no_grad():
        logits = build(model_config(arch), "eager")(ids, attention_mask=mask).logits
        without = (build(model_config(arch, softcap=None), "eager") if arch == "gemma2"
                   else build(model_config(arch), "eager", sinks=False))(ids, attention_mask=mask).logits
    assert (logits[0] - without[0]).abs().max() > 0.05


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("method", ["plas", "xattn"])
@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
@pytest.mark.parametrize("device", MODEL_DEVICES)
def test_logits_and_generate_equal_eager(arch, method, backend, device, monkeypatch):
    """Below dense_below (eager's math on the dense path: bit-equal) and at full density on the sparse path: the
    logits of eager attention (fp32, 2e-4), also for a left-padded batch, whose rows equal single runs; generate()
    gives eager's greedy tokens and decode logits; with few blocks, finite logits and tokens. The window layer is
    dense inside its window, the full layer sparse. On the CPU and (``-m gpu``) on CUDA."""
    skip_unless_runs(backend, device)
    monkeypatch.setenv("HF_SPARSE_BACKEND", backend)
    config = model_config(arch)
    eager, sparse = build(config, "eager").to(device), build(config, method).to(device)
    below, full, few = method_configs(method)
    ids, mask = padded_batch(device=device)
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        expected = eager(ids, attention_mask=mask).logits
        expected_generation = eager.generate(ids, attention_mask=mask, **kwargs)
        for attention in (below, full):
            hf_sparse.configure(sparse, attention)
            with hf_sparse.record_sparsity() as rec:
                out = sparse(ids, attention_mask=mask).logits
            torch.testing.assert_close(out[0], expected[0], atol=2e-4, rtol=2e-4)
            torch.testing.assert_close(out[1, 7:], expected[1, 7:], atol=2e-4, rtol=2e-4)
            if attention is below:  # eager's own computation, op for op
                assert torch.equal(out, expected)
            alone = sparse(ids[1:, 7:]).logits
            torch.testing.assert_close(alone[0], out[1, 7:], atol=2e-4, rtol=2e-4)
            reasons = rec.dense_layers("prefill")
            if attention is full:
                assert reasons == {0: f"sliding window of {WINDOW} tokens"}, reasons
            else:
                assert set(reasons) == {0, 1} and reasons[1].startswith("length 50 < dense_below")
            generation = sparse.generate(ids, attention_mask=mask, **kwargs)
            assert torch.equal(generation.sequences, expected_generation.sequences)
            for step, want in zip(generation.logits, expected_generation.logits, strict=True):
                torch.testing.assert_close(step, want, atol=2e-4, rtol=2e-4)
        hf_sparse.configure(sparse, few)
        ids, mask = padded_batch(130, device)
        with hf_sparse.record_sparsity() as rec:
            assert torch.isfinite(sparse(ids, attention_mask=mask).logits).all()
            tokens = sparse.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert rec.density("prefill") < 0.95 and rec.density("decode") < 0.8, "selection really was sparse"
        assert tokens.shape == (2, 135) and ((tokens >= 0) & (tokens < 128)).all()


@pytest.mark.parametrize("method", ["plas", "xattn"])
def test_bad_softcap_and_sinks_get_clear_errors(method):
    """A model passing a softcap that is not a positive number, or sinks that are not one logit per query head."""
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    for arch in ("gemma2", "gpt_oss"):
        model = build(model_config(arch), method)
        hf_sparse.configure(model, method_configs(method)[1])
        attention = model.model.layers[1].self_attn
        if arch == "gemma2":
            attention.attn_logit_softcapping = 0.0
            match = "softcap .* positive finite number, got 0.0"
        else:
            attention.sinks = torch.nn.Parameter(torch.zeros(2))
            match = r"sinks .* \[q_heads=4\]"
        with pytest.raises(ValueError, match=match), torch.no_grad():
            model(ids)


@pytest.mark.parametrize("arch, feature", [("gemma2", "softcap"), ("gpt_oss", "s_aux")])
def test_star_refuses_softcap_and_sinks_by_name(arch, feature):
    """Star Attention does not compute Gemma 2's softcapping or GPT-OSS's sinks: a clear error names them."""
    model = build(model_config(arch), "star")
    hf_sparse.configure(model, hf_sparse.StarConfig(block_size=16, anchor_size=16, query_tokens=4, dense_below=0))
    with pytest.raises(NotImplementedError, match=f"star attention does not support `{feature}`.*'plas' and 'xattn'"):
        model(torch.randint(1, 128, (1, 40)))


def test_sink_rescale_is_the_sink_column_of_the_softmax():
    """``out * sigmoid(lse - sink)`` is attention with an extra zero-valued key of logit ``sink``."""
    from hf_sparse.kernels import reference as ref

    torch.manual_seed(3)
    scores, values, sinks = torch.randn(2, 3, 5, 9) * 3, torch.randn(2, 3, 9, 4), torch.randn(3)
    plain = torch.softmax(scores, -1) @ values
    column = sinks[None, :, None, None].expand(2, 3, 5, 1)
    expected = torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1] @ values
    torch.testing.assert_close(ref.attention_sinks(plain, torch.logsumexp(scores, -1), sinks), expected)
    assert ref.attention_sinks(plain, torch.full((2, 3, 5), -math.inf), sinks).eq(0).all()
