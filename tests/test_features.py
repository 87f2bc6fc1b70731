"""Paged-attention feature parity at the model level: logN scaling, the int8 KV cache (and, in
test_kernels/test_reference, skip and ALiBi)."""
import functools
import os

import pytest
import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

import hf_sparse
from hf_sparse import star_attention
from hf_sparse.cache import hand_over
from hf_sparse.dense import dequantized_kv
from hf_sparse.kernels import reference as ref

from conftest import build, counting, full_density, tiny_config

LOGN_BASE = 16


def logn_reference_attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa on queries scaled as Qwen does: position n (1-based) times max(1, log(n) / log(m)); no padding."""
    num_queries, key_length = query.shape[2], key.shape[2]
    position = torch.arange(key_length - num_queries, key_length, dtype=torch.float64) + 1
    factor = (position.log() / torch.tensor(float(LOGN_BASE)).log()).clamp_min(1.0)
    return sdpa_attention_forward(module, query * factor.to(query.dtype)[None, None, :, None], key, value,
                                  attention_mask, **kwargs)


AttentionInterface.register("logn_reference", logn_reference_attention)
AttentionMaskInterface.register("logn_reference", sdpa_mask)


@pytest.mark.parametrize("path", ["sparse", "dense", "xattn"])
def test_logn_scaling_equals_dense_reference(path):
    config = tiny_config("qwen2", 6, 2)
    sparse, reference = build(config, "xattn" if path == "xattn" else "plas"), build(config, "logn_reference")
    logn = dict(logn_scaling=True, logn_base=LOGN_BASE)
    if path == "sparse":
        method = hf_sparse.PLASConfig.from_dict({**full_density(block_size=16).to_dict(), **logn})
    elif path == "dense":
        method = hf_sparse.PLASConfig(block_size=16, dense_layers=(0, 1), **logn)
    else:
        method = hf_sparse.XAttnConfig(block_size=16, stride=4, threshold=1.0, dense_below=0, dense_layers=(), **logn)
    hf_sparse.configure(sparse, method)
    plain = build(config, "sdpa")
    ids = torch.randint(0, 128, (1, 70))
    with torch.no_grad(), hf_sparse.record_sparsity() as rec:
        torch.testing.assert_close(sparse(ids).logits, reference(ids).logits, atol=2e-5, rtol=1e-4)
        assert not torch.allclose(sparse(ids).logits, plain(ids).logits, atol=1e-3), "logN changed nothing"
        a = sparse.generate(ids, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
        b = reference.generate(ids, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4)
    assert {r.phase for r in rec.records} == {"prefill", "decode"}
    assert bool(rec.dense_layers()) == (path == "dense")


def test_logn_config_validation():
    with pytest.raises(ValueError, match="logn_base"):
        hf_sparse.PLASConfig(logn_scaling=True, logn_base=1)
    with pytest.raises(ValueError, match="logn_scaling"):
        hf_sparse.PLASConfig(logn_base=4096)
    with pytest.raises(ValueError, match="logn_scaling"):
        hf_sparse.XAttnConfig(logn_scaling="yes")
    assert hf_sparse.PLASConfig.from_dict(hf_sparse.PLASConfig(logn_scaling=True).to_dict()).logn_scaling


# -- int8 KV cache -------------------------------------------------------------------------------------------------
def test_int8_cache_layer_storage_scales_and_summaries():
    from hf_sparse.cache import SparseCacheLayer
    from hf_sparse.kernels import reference as ref

    torch.manual_seed(3)
    layer = SparseCacheLayer(block_size=16, chunk_blocks=2, kv_dtype="int8")
    keys, values = torch.randn(2, 3, 45, 32), torch.randn(2, 3, 45, 24)
    kv_start = torch.tensor([0, 7])
    layer.update(keys[:, :, :40], values[:, :, :40])
    for step in range(40, 45):  # decode steps: partial blocks and a block that fills
        k, v = layer.update(keys[:, :, step:step + 1], values[:, :, step:step + 1])
        summaries = layer.block_summaries(None, kv_start)
    assert k.dtype == v.dtype == torch.int8 and layer.key_scales.shape == (2, 3, 45)
    assert v.shape == (2, 3, 45, 24), "rows start apart (padding [0, 7]): token-major values"
    dequantized_keys = ref.dequantize_per_token(k, layer.key_scales)
    assert float((dequantized_keys - keys).norm() / keys.norm()) < 0.01
    dequantized_values = ref.dequantize_per_token(ref.token_values(v, 45), layer.value_scales)
    assert float((dequantized_values - values).norm() / values.norm()) < 0.01
    torch.testing.assert_close(summaries, ref.block_summaries(dequantized_keys, None, kv_start, 16))
    # growing the storage (64 -> 96 slots) keeps the blocked values; the tokens are quantised independently
    more_keys, more_values = torch.randn(2, 3, 30, 32), torch.randn(2, 3, 30, 24)
    capacity = layer.capacity
    k, v = layer.update(more_keys, more_values)
    assert layer.capacity > capacity and v.shape == (2, 3, 75, 24)
    all_values = torch.cat([values, more_values], dim=2)
    expected, _ = ref.quantize_per_token(all_values)
    torch.testing.assert_close(ref.token_values(v, 75), expected, rtol=0, atol=0)


def test_int8_kv_cache_close_to_sdpa_and_smaller():
    config = tiny_config("llama", 8, 2, head_dim=32)
    sparse, dense = build(config, "plas"), build(config, "sdpa")
    plas = full_density(block_size=16).to_dict()
    hf_sparse.configure(sparse, hf_sparse.PLASConfig.from_dict({**plas, "kv_cache_dtype": "int8"}))
    torch.manual_seed(4)
    ids = torch.randint(3, 128, (2, 76))
    with torch.no_grad(), hf_sparse.record_sparsity() as rec:
        cache = hf_sparse.SparseCache(sparse.config)  # int8 from the stored configuration
        steps = [sparse(ids[:, :70], past_key_values=cache).logits]
        steps += [sparse(ids[:, t:t + 1], past_key_values=cache).logits for t in range(70, 76)]  # teacher-forced decode
        expected = dense(ids).logits
        generated = sparse.generate(ids[:, :70], max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
        fp = hf_sparse.SparseCache(sparse.config, kv_dtype="auto")
        sparse(ids, past_key_values=fp)
    assert cache.kv_dtype == "int8" and cache.layers[0].key_storage.dtype == torch.int8
    assert generated.past_key_values.kv_dtype == "int8", "generate() creates the configured int8 cache"
    assert {r.phase for r in rec.records} >= {"prefill", "decode"} and not rec.dense_layers()
    # int8 per-token K/V: logits within a few percent of their spread (the float cache: ~1e-6)
    error = (torch.cat(steps, 1) - expected).abs().max()
    assert 0 < float(error) < 0.05 * float(expected.std())
    # (D + 4) bytes per token and head for each of K and V, against 4 * D in float32: 2 layers x 2 heads x (K, V)
    assert cache.memory_per_token() == 2 * 2 * 2 * (32 + 4)
    assert fp.memory_per_token() == 2 * 2 * 2 * 32 * 4


def dequantized_states_cache(config, block_size: int | None = None) -> hf_sparse.SparseCache:
    """A float SparseCache that stores what an int8 cache holds, dequantised, and gives a layer's first prefill
    the states as they are (as an int8 cache does): the int8 cache's reference."""
    cache = hf_sparse.SparseCache(config, block_size=block_size, kv_dtype="auto")

    def roundtrip(states):
        return ref.dequantize_per_token(*ref.quantize_per_token(states)).to(states.dtype)

    def update(layer, original, key, value, *args, **kwargs):
        first = layer.get_seq_length() == 0
        keys, values = original(roundtrip(key), roundtrip(value), *args, **kwargs)
        if not first:
            return keys, values
        hand_over(layer, key, kwargs)  # the attention call receives the states as given
        return key, value

    for layer in cache.layers:
        layer.update = functools.partial(update, layer, layer.update)
    return cache


def backends():
    """The PyTorch reference always; the Triton kernels in the interpreter (these models run on the CPU):
    ``TRITON_INTERPRET=1 pytest tests/test_features.py -k int8``."""
    return ["torch", pytest.param("triton", marks=pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton path on CPU models needs TRITON_INTERPRET=1"))]


def test_int8_first_write_returns_its_states_and_the_int8_views_come_when_read():
    """An int8 layer's first write returns the states it was given and computes its int8 views (keys, blocked
    values, scales) when they are first read; reset() clears them, read or not."""
    from hf_sparse.cache import SparseCacheLayer

    gen = torch.Generator().manual_seed(11)
    keys, values = torch.randn(1, 2, 40, 16, generator=gen), torch.randn(1, 2, 40, 16, generator=gen)
    layer = SparseCacheLayer(block_size=16, kv_dtype="int8")
    got_keys, got_values = layer.append(keys, values)
    assert got_keys is keys and got_values is values and layer._stale_views
    assert layer.keys.dtype == torch.int8 and layer.keys.shape == (1, 2, 40, 16)
    assert layer.key_scales.shape == layer.value_scales.shape == (1, 2, 40)
    torch.testing.assert_close(ref.dequantize_per_token(layer.keys, layer.key_scales), keys, atol=0.02, rtol=0)
    stored = ref.token_values(layer.values, 40) if layer.values.dim() == 5 else layer.values
    torch.testing.assert_close(ref.dequantize_per_token(stored[:, :, :40], layer.value_scales), values, atol=0.02,
                               rtol=0)
    unread = SparseCacheLayer(block_size=16, kv_dtype="int8")
    unread.append(keys, values)
    unread.reset()  # after a first write nobody read
    assert unread.keys is None and unread.key_scales is None and unread.value_scales is None


@pytest.mark.parametrize("backend", backends())
def test_int8_storage_grows_uninitialised_and_its_writes_zero_the_scales_past_them(backend, monkeypatch):
    """An int8 layer's grown scale storage is allocated uninitialised (poisoned here) and the write that follows
    zeroes the scales past it in its own launch, on a first write and on a growth that keeps earlier slots; a
    refused write zeroes them too; a static layer's whole storage (what its decode reads) stays finite; a
    decode-sized write's growth allocates them zeroed."""
    from hf_sparse import kernels
    from hf_sparse.cache import SparseCacheLayer

    monkeypatch.setenv("HF_SPARSE_BACKEND", backend)
    monkeypatch.setattr(torch, "empty", functools.partial(lambda empty, *a, **k: empty(*a, **k).fill_(float("nan"))
                                                          if k.get("dtype") == torch.float32 else empty(*a, **k),
                                                          torch.empty))
    gen = torch.Generator().manual_seed(12)
    keys, values = torch.randn(2, 3, 75, 16, generator=gen), torch.randn(2, 3, 75, 16, generator=gen)
    layer = SparseCacheLayer(block_size=16, chunk_blocks=2, kv_dtype="int8")
    launches = []
    real = kernels.quantize_append
    monkeypatch.setattr(kernels, "quantize_append", lambda *args: launches.append(args[-1]) or real(*args))
    for first, end in [(0, 40), (40, 41), (41, 75)]:  # a first write (64 slots), a decode step, a growth (96)
        layer.update(keys[:, :, first:end], values[:, :, first:end])
        for scales in (layer.key_scale_storage, layer.value_scale_storage):
            assert (scales[:, :, :end] > 0).all() and (scales[:, :, end:] == 0).all()
        assert not layer._scales_unset
    assert launches == [64, 0, 96] and layer.capacity == 96
    expected, _ = ref.quantize_per_token(keys)
    torch.testing.assert_close(layer.keys, expected, rtol=0, atol=0)

    refused = SparseCacheLayer(block_size=16, chunk_blocks=2, kv_dtype="int8")
    refused.update(keys[:, :, :40], values[:, :, :40])
    with pytest.raises(ValueError):  # 30 more tokens of another head count: the grown storage is not theirs
        refused.update(keys[:, :, 40:70], values[:1, :, 40:70])
    assert not refused._scales_unset and refused.length == 40
    for scales in (refused.key_scale_storage, refused.value_scale_storage):
        assert (scales[:, :, :40] > 0).all() and (scales[:, :, 40:] == 0).all()

    static = SparseCacheLayer(block_size=16, chunk_blocks=2, kv_dtype="int8", max_cache_len=200)
    static.update(keys[:, :, :20], values[:, :, :20])
    assert launches[-1] == 208 and static.key_scale_storage.shape[2] == 208
    assert static.key_scale_storage.isfinite().all() and static.value_scale_storage.isfinite().all()
    assert (static.value_scale_storage[:, :, 20:] == 0).all()

    short = SparseCacheLayer(block_size=16, chunk_blocks=2, kv_dtype="int8", max_cache_len=200)
    short.update(keys[:, :, :3], values[:, :, :3])  # a decode-sized write: the storage is allocated zeroed
    assert launches[-1] == 0 and (short.key_scale_storage[:, :, 3:] == 0).all()


@pytest.mark.parametrize("backend", backends())
def test_int8_cache_with_other_blocks_summarises_dequantized_keys(backend, monkeypatch):
    """An int8 cache whose block size is not the method's: the attention summarises its keys itself, dequantised
    (the summary op's int8 path), and selects as over a float cache holding the same dequantised states."""
    monkeypatch.setenv("HF_SPARSE_BACKEND", backend)
    model = build(tiny_config("llama", 8, 2, head_dim=32), "plas")
    hf_sparse.configure(model, hf_sparse.PLASConfig(block_size=16, prefill_top_k=(1, 2), decode_top_k=(2, 3),
                                                    dense_below=0, dense_layers=(), query_union=16))
    # 94 + 4 tokens: decode crosses a block boundary of both sizes (96)
    ids = torch.randint(3, 128, (2, 98), generator=torch.Generator().manual_seed(8))

    def run(cache):
        with torch.no_grad(), hf_sparse.record_sparsity(keep_inputs=True) as rec:
            steps = [model(ids[:, :94], past_key_values=cache).logits]
            steps += [model(ids[:, t:t + 1], past_key_values=cache).logits for t in range(94, 98)]
        return torch.cat(steps, 1), rec

    logits, rec = run(hf_sparse.SparseCache(model.config, block_size=32, kv_dtype="int8"))
    expected, expected_rec = run(dequantized_states_cache(model.config, block_size=32))
    assert rec.density("prefill") < 0.95 and rec.density("decode") < 0.95, "selection really was sparse"
    for got, want in zip(rec.records, expected_rec.records, strict=True):
        assert torch.equal(got.selection.indices, want.selection.indices)
    # The int8 kernels scale a score or probability column, the float path multiplies dequantised states: sums in
    # another order. On some CPUs (an AMD EPYC here) 2 of 25,088 logits then differ by 3.2e-5 on the Triton path.
    torch.testing.assert_close(logits, expected, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", backends())
def test_int8_kv_cache_xattn_equals_float_cache_of_dequantized_states(backend, monkeypatch):
    """XAttention on an int8 cache: prefill scoring reads int8 keys with their scales, decode the summaries of
    dequantised keys. Its selections and logits equal those of a float cache holding the same dequantised
    states (sparse selection, prefill over two calls, decode, a left-padded row)."""
    monkeypatch.setenv("HF_SPARSE_BACKEND", backend)
    config = tiny_config("llama", 8, 2, head_dim=32)
    model = build(config, "xattn")
    hf_sparse.configure(model, hf_sparse.XAttnConfig(dense_last=0, block_size=16, stride=4, threshold=0.5, decode_threshold=0.5,
                                                     dense_below=0, dense_layers=(), kv_cache_dtype="int8"))
    torch.manual_seed(6)
    ids = torch.randint(3, 128, (2, 104))
    mask = torch.ones_like(ids)
    mask[1, :21] = 0

    def run(cache):
        with torch.no_grad(), hf_sparse.record_sparsity(keep_inputs=True) as rec:
            steps = [model(ids[:, :60], attention_mask=mask[:, :60], past_key_values=cache).logits,
                     model(ids[:, 60:100], attention_mask=mask[:, :100], past_key_values=cache).logits]
            steps += [model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache).logits
                      for t in range(100, 104)]  # teacher-forced decode (the padded row crosses a block)
        return torch.cat(steps, 1), rec

    cache = hf_sparse.SparseCache(model.config)  # int8 from the stored configuration
    logits, rec = run(cache)
    expected, expected_rec = run(dequantized_states_cache(model.config))
    assert cache.layers[0].key_storage.dtype == torch.int8
    assert rec.density("prefill") < 0.95 and rec.density("decode") < 0.95, "selection really was sparse"
    assert {r.phase for r in rec.records} == {"prefill", "decode"} and not rec.dense_layers()
    assert len(rec.records) == len(expected_rec.records)
    for got, want in zip(rec.records, expected_rec.records):
        assert torch.equal(got.selection.to_mask(got.selection.indices.shape[-1]),
                           want.selection.to_mask(want.selection.indices.shape[-1]))
    real = mask.bool()[:, :, None].expand_as(logits)
    torch.testing.assert_close(logits[real], expected[real], atol=2e-5, rtol=1e-4)


def test_int8_kv_cache_xattn_close_to_sdpa_and_generate():
    """At full density XAttention on the int8 cache is within quantisation error of sdpa (as PLAS, above), and
    ``generate()`` creates the int8 cache that ``XAttnConfig.kv_cache_dtype`` asks for."""
    config = tiny_config("llama", 8, 2, head_dim=32)
    sparse, dense = build(config, "xattn"), build(config, "sdpa")
    hf_sparse.configure(sparse, hf_sparse.XAttnConfig(block_size=16, stride=4, threshold=1.0, dense_below=0,
                                                      dense_layers=(), kv_cache_dtype="int8"))
    torch.manual_seed(4)
    ids = torch.randint(3, 128, (2, 76))
    with torch.no_grad():
        cache = hf_sparse.SparseCache(sparse.config)
        steps = [sparse(ids[:, :70], past_key_values=cache).logits]
        steps += [sparse(ids[:, t:t + 1], past_key_values=cache).logits for t in range(70, 76)]
        expected = dense(ids).logits
        generated = sparse.generate(ids[:, :70], max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    assert cache.kv_dtype == "int8" and generated.past_key_values.kv_dtype == "int8"
    error = (torch.cat(steps, 1) - expected).abs().max()
    assert 0 < float(error) < 0.05 * float(expected.std())


def test_kv_cache_dtype_validated_by_plas_and_xattn_unknown_to_star():
    for config_class in (hf_sparse.PLASConfig, hf_sparse.XAttnConfig):
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            config_class(kv_cache_dtype="fp8")
        assert config_class.from_dict(config_class(kv_cache_dtype="int8").to_dict()).kv_cache_dtype == "int8"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        hf_sparse.StarConfig.from_dict({"kv_cache_dtype": "int8"})


@pytest.mark.parametrize("backend", backends())
def test_int8_kv_cache_star_equals_float_cache_of_dequantized_states(backend, monkeypatch):
    """Star on an int8 SparseCache: the prompt (its first prefill: the context's phase 1, its query tokens' phase
    2, the dense layer) attends over its states as given, the generated tokens (phase 2, all blocks selected) read
    the int8 K/V in the sparse kernels; no dequantised copy is made. Logits and tokens equal those of a float cache
    holding the same dequantised states, and are within quantisation error of the float cache."""
    monkeypatch.setenv("HF_SPARSE_BACKEND", backend)
    model = build(tiny_config("llama", 8, 2, head_dim=32), "star")
    hf_sparse.configure(model, hf_sparse.StarConfig(block_size=32, anchor_size=16, query_tokens=5, dense_below=0,
                                                    dense_above_density=None, dense_layers=(1,)))
    torch.manual_seed(7)
    ids = torch.randint(3, 128, (2, 110))
    mask = torch.ones_like(ids)
    mask[1, :21] = 0

    copies = []
    monkeypatch.setattr(star_attention, "dequantized_kv", lambda *args: copies.append(1) or dequantized_kv(*args))

    caches = []

    def run(new_cache):
        with torch.no_grad(), hf_sparse.record_sparsity() as rec:
            cache = new_cache()
            caches.append(cache)
            steps = [model(ids[:, :100], attention_mask=mask[:, :100], past_key_values=cache).logits]
            steps += [model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache).logits
                      for t in range(100, 110)]  # teacher-forced generation
            generated = model.generate(ids[:, :100], attention_mask=mask[:, :100], past_key_values=new_cache(),
                                       max_new_tokens=4, do_sample=False, pad_token_id=0)
        return torch.cat(steps, 1), generated, rec

    logits, generated, rec = run(lambda: hf_sparse.SparseCache(model.config, kv_dtype="int8"))
    assert not copies, "no dequantised copy: the prompts attend over their states, generation reads int8"
    assert caches[0].layers[0].value_storage.dim() == 4, "rows start apart: the int8 values went token-major"
    expected, expected_generated, _ = run(lambda: dequantized_states_cache(model.config))
    unquantized, _, _ = run(lambda: hf_sparse.SparseCache(model.config, kv_dtype="auto"))
    assert rec.density("context") < 0.8, "the context really ran block-sparse"
    assert set(rec.dense_layers("context").values()) == {"dense_layers"}
    real = mask.bool()[:, :, None].expand_as(logits)
    torch.testing.assert_close(logits[real], expected[real], atol=2e-5, rtol=1e-4)
    assert torch.equal(generated, expected_generated)
    error = (logits[real] - unquantized[real]).abs().max()  # int8 costs only quantisation error
    assert 0 < float(error) < 0.05 * float(unquantized.std())


def test_star_logn_fields_validated_and_round_trip():
    config = hf_sparse.StarConfig.from_dict({"logn_scaling": True, "logn_base": 64})
    assert config.logn_scaling and hf_sparse.StarConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="logn_scaling"):
        hf_sparse.StarConfig(logn_scaling="yes")


FIRST_PREFILL_CONFIGS = {
    "plas": lambda: hf_sparse.PLASConfig(block_size=16, prefill_top_k=(2, 3), decode_top_k=(2, 3), dense_below=0,
                                         query_union=16, dense_layers=(2,)),
    "xattn": lambda: hf_sparse.XAttnConfig(dense_last=0, block_size=16, stride=4, threshold=0.5, decode_threshold=0.5,
                                           dense_below=0, dense_layers=(2,)),
    "star": lambda: hf_sparse.StarConfig(block_size=32, anchor_size=16, query_tokens=5, dense_below=0,
                                         dense_above_density=None, dense_layers=(2,)),
}


#: (method, dtype, static cache, backend): every combination on the PyTorch path; one on the Triton path (minutes in
#: the interpreter), whose static decode reads its lengths on the device.
FIRST_PREFILL_CASES = [
    *(pytest.param(method, dtype, static, "torch", id=f"{method}-{dtype_id}-{'static' if static else 'dynamic'}-torch")
      for method in ("plas", "xattn", "star") for dtype, dtype_id in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))
      for static in (False, True)),
    pytest.param("plas", torch.float32, True, "triton", id="plas-fp32-static-triton", marks=backends()[1].marks),
]


@pytest.mark.parametrize("method, dtype, static, backend", FIRST_PREFILL_CASES)
def test_int8_first_prefill_attends_over_its_states(method, dtype, static, backend, monkeypatch):
    """An int8 cache's first prefill attends over the states it has in hand, in the compute dtype: its logits and
    selections equal a float cache's (sparse layers, the dense layer, a left-padded row), with no dequantised copy,
    while the cache stores their int8 copy. Later calls read that copy: a continuation prefill (whose dense layer
    dequantises it) and decode differ from the float cache's and, in float32, equal a float cache holding the
    dequantised states (in bfloat16 that reference rounds the dequantised K/V, which the int8 kernels do not)."""
    from hf_sparse import attention

    monkeypatch.setenv("HF_SPARSE_BACKEND", backend)
    model = build(tiny_config("llama", 4, 2, layers=3), method).to(dtype)
    hf_sparse.configure(model, FIRST_PREFILL_CONFIGS[method]())
    ids = torch.randint(3, 128, (2, 104), generator=torch.Generator().manual_seed(9))
    mask = torch.ones_like(ids)
    mask[1, :21] = 0
    copies = []
    for module in (attention, star_attention):
        monkeypatch.setattr(module, "dequantized_kv", lambda *args: copies.append(1) or dequantized_kv(*args))

    # later calls: a continuation prefill and teacher-forced decode steps (on Triton, to keep the interpreter's
    # minutes down, one decode step: its dense layer runs the decode kernel over the static cache, no copy)
    later_calls = [(70, 100), *((t, t + 1) for t in range(100, 104))] if backend == "torch" else [(70, 71)]
    length = later_calls[-1][1]

    def run(cache):
        copies.clear()
        with torch.no_grad(), hf_sparse.record_sparsity(keep_inputs=True) as rec:
            first = model(ids[:, :70], attention_mask=mask[:, :70], past_key_values=cache).logits
            first_copies, first_records = len(copies), list(rec.records)
            later = [model(ids[:, start:end], attention_mask=mask[:, :end], past_key_values=cache).logits
                     for start, end in later_calls]
        return first, torch.cat(later, 1), (first_copies, len(copies)), first_records

    room = {"max_cache_len": 112} if static else {}
    int8_cache = hf_sparse.SparseCache(model.config, kv_dtype="int8", **room)
    first, later, copies_made, records = run(int8_cache)
    float_cache = hf_sparse.SparseCache(model.config, kv_dtype="auto", **room)
    float_first, float_later, _, float_records = run(float_cache)

    assert torch.equal(first, float_first), "the first prefill is the float cache's, bit for bit"
    assert copies_made[0] == 0, "the first prefill made no dequantised copy"
    assert copies_made[1] > 0 or backend == "triton", "the continuation's dense attention dequantised the int8 cache"
    sparse = [(got, want) for got, want in zip(records, float_records, strict=True) if got.selection is not None]
    assert len(sparse) == 2, "layers 0 and 1 ran sparse"
    for got, want in sparse:
        assert got.inputs[1].dtype == dtype, "the first prefill read no int8 keys"
        assert torch.equal(got.selection.indices, want.selection.indices)
        assert torch.equal(got.selection.counts, want.selection.counts)
    assert sum(float(got.attended_blocks) for got, _ in sparse) < sum(float(got.causal_blocks) for got, _ in sparse)
    layer, float_layer = int8_cache.layers[0], float_cache.layers[0]
    assert layer.key_storage.dtype == torch.int8 and layer.length == float_layer.length == length
    stored, _ = ref.quantize_per_token(float_layer.keys[:, :, :70])  # the first prefill's keys, quantised
    assert torch.equal(layer.keys[:, :, :70], stored)
    real = mask[:, 70:length].bool()[:, :, None].expand_as(later)
    assert not torch.equal(later[real], float_later[real]), "later calls read the int8 copy"
    if dtype == torch.float32 and backend == "torch":  # (the Triton path's int8 reads: the tests above)
        expected_first, expected_later, _, _ = run(dequantized_states_cache(model.config))
        assert torch.equal(first, expected_first)
        torch.testing.assert_close(later[real], expected_later[real], atol=2e-5, rtol=1e-4)


def test_int8_short_first_prefill_is_sdpa_forward_wide(monkeypatch):
    """A prompt shorter than dense_below over an int8 cache runs sdpa on its own K/V in every layer, planned once
    for the whole forward (rule `forward`, as over a float cache): its logits are sdpa's bit for bit. The decode
    step after it reads the int8 cache (dequantised for its dense attention): within quantisation error."""
    from hf_sparse import attention, plan

    config = tiny_config("llama", 8, 2, head_dim=32, layers=3)
    model, dense = build(config, "plas"), build(config, "sdpa")
    hf_sparse.configure(model, hf_sparse.PLASConfig(kv_cache_dtype="int8"))
    ids = torch.randint(3, 128, (1, 41), generator=torch.Generator().manual_seed(10))
    plans = counting(monkeypatch, plan, "plan_call")
    copies = counting(monkeypatch, attention, "dequantized_kv")
    with torch.no_grad():
        cache = hf_sparse.SparseCache(model.config)
        prefill = model(ids[:, :40], past_key_values=cache).logits
        assert len(plans) == 1 and not copies, "planned in the first layer only, no int8 read"
        step = model(ids[:, 40:], past_key_values=cache).logits
        expected = dense(ids).logits
    assert cache.layers[0].key_storage.dtype == torch.int8 and cache.get_seq_length() == 41
    assert torch.equal(prefill, expected[:, :40])
    assert len(copies) == 3, "the decode step read the int8 cache in every layer"
    error = (step - expected[:, 40:]).abs().max()
    assert 0 < float(error) < 0.05 * float(expected.std())


def test_int8_values_layout_follows_the_padding():
    """int8 values stay blocked while every row starts at one slot on the block grid, and go token-major (same
    contents, one copy) when the padding layout starts rows apart; growth and later writes keep the layout."""
    from hf_sparse.cache import SparseCacheLayer
    from hf_sparse.kernels import reference as ref

    torch.manual_seed(4)
    keys, values = torch.randn(2, 3, 70, 8), torch.randn(2, 3, 70, 8)
    expected, _ = ref.quantize_per_token(values)
    for kv_start, blocked in (([0, 0], True), ([16, 16], True), ([0, 7], False), ([5, 5], False)):
        layer = SparseCacheLayer(block_size=16, chunk_blocks=2, kv_dtype="int8")
        layer.update(keys[:, :, :20], values[:, :, :20])
        assert layer.value_storage.dim() == 5, "blocked until the padding is known"
        layer.set_padding(torch.tensor(kv_start))
        for step in range(20, 70, 10):  # decode-sized writes and a growth past 64 slots
            _, stored = layer.update(keys[:, :, step:step + 10], values[:, :, step:step + 10])
        assert layer.capacity > 64 and (stored.dim() == 5) == blocked and layer.values_blocked == blocked
        torch.testing.assert_close(ref.token_values(stored, 70), expected, rtol=0, atol=0)


def test_int8_kv_left_padded_batch_equals_each_prompt_alone():
    """Per-token quantisation does not depend on the batch, and summaries of int8 blocks follow each row's
    padding: a left-padded batch decodes like each prompt alone (sparse selection, logN on too)."""
    model = build(tiny_config("llama", 6, 2), "plas")
    hf_sparse.configure(model, hf_sparse.PLASConfig(block_size=16, prefill_top_k=(1, 1), decode_top_k=(3, 4),
                                                    dense_below=0, dense_layers=(), query_union=8,
                                                    kv_cache_dtype="int8", logn_scaling=True, logn_base=64))
    torch.manual_seed(5)
    long_ids, short_ids = torch.randint(3, 128, (1, 200)), torch.randint(3, 128, (1, 141))
    batch = torch.zeros(2, 200, dtype=torch.long)
    mask = torch.zeros(2, 200, dtype=torch.long)
    batch[0], mask[0] = long_ids[0], 1
    batch[1, 59:], mask[1, 59:] = short_ids[0], 1
    with torch.no_grad(), hf_sparse.record_sparsity() as rec:
        together = model.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                  return_dict_in_generate=True)
        alone_long = model.generate(long_ids, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                    return_dict_in_generate=True)
        alone_short = model.generate(short_ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert rec.density("prefill") < 0.8 and rec.density("decode") < 0.8, "selection really was sparse"
    assert together.past_key_values.layers[0].value_storage.dim() == 4, "rows start apart: token-major values"
    assert alone_long.past_key_values.layers[0].value_storage.dim() == 5, "no padding: blocked values"
    together, alone_long = together.sequences, alone_long.sequences
    assert torch.equal(together[0, 200:], alone_long[0, 200:])
    assert torch.equal(together[1, 200:], alone_short[0, 141:])
