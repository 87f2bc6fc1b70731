"""Static SparseCache and decode with device-side lengths (what CUDA-graph decode replays).

Kernel tests run on CPU under ``TRITON_INTERPRET=1`` (small sizes) and on CUDA (``-m gpu``: real sizes); the
model tests compare a static cache with the dynamic one (interpreter or CUDA for the device-length path, the
PyTorch path otherwise), and on CUDA ``generate()`` with CUDA graphs against eager decode.
"""
from __future__ import annotations

import gc
import os
import zlib

import pytest
import torch
from conftest import build, graph_config, tiny_config

import hf_sparse
from hf_sparse import SparseCache, kernels
from hf_sparse.kernels import reference as ref
from hf_sparse.selection import RowLayout

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and not INTERPRETED
DEVICE = "cuda" if CUDA else "cpu"
needs_triton = pytest.mark.skipif(not (CUDA or INTERPRETED), reason="needs CUDA or TRITON_INTERPRET=1")
SIZES = [
    pytest.param("small", id="small"),
    pytest.param("large", id="large", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]),
]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
REL_TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def dims(size: str) -> dict:
    """(valid length, storage capacity, block size): lengths not multiples of the block."""
    if size == "small":
        return {"length": 83, "capacity": 128, "block": 16}
    return {"length": 4096 + 77, "capacity": 8192, "block": 128}


def storage(batch, heads, capacity, length, dim, dtype, gen):
    """Random states in the first ``length`` slots and huge values after them (read there = a wrong result)."""
    data = torch.randn(batch, heads, capacity, dim, generator=gen)
    data[:, :, length:] = 3e4
    return data.to(dtype).to(DEVICE)


def rel_err(out, expected):
    out, expected = out.double(), expected.double()
    return float((out - expected).norm() / expected.norm().clamp_min(1e-30))


def length_tensor(length: int) -> torch.Tensor:
    return torch.tensor([length], dtype=torch.int64, device=DEVICE)


@needs_triton
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("batch, heads, dim, dtype, gated, recent", [
    (1, 2, 64, "fp32", False, 1), (3, 4, 128, "bf16", True, 1), (3, 1, 64, "fp16", True, 5),
])
def test_recent_block_summaries(size, batch, heads, dim, dtype, gated, recent):
    gen = torch.Generator().manual_seed(seed(size, batch, heads, dim, dtype, gated, recent))
    d = dims(size)
    length, capacity, block = d["length"], d["capacity"], d["block"]
    keys = storage(batch, heads, capacity, length, dim, DTYPES[dtype], gen)
    kv_start = torch.tensor([0, 7, 21][:batch], device=DEVICE)
    gate = torch.randn(heads, block, dim, generator=gen).to(DTYPES[dtype]).to(DEVICE) if gated else None
    expected = ref.block_summaries(keys[:, :, :length], gate, kv_start, block)
    # Summaries as they stood before the last `recent` tokens; blocks past the length stay poisoned.
    out = torch.full((batch, heads, capacity // block, dim), float("nan"), device=DEVICE)
    before = ref.block_summaries(keys[:, :, :length - recent], gate, kv_start, block)
    out[:, :, :before.shape[2]] = before
    initial = out.clone()
    kernels.recent_block_summaries(keys, gate, kv_start, block, length_tensor(length), recent, out)
    # Row b's block j exists while it starts before the length; the others are neither needed nor written.
    starts = kv_start[:, None] + torch.arange(out.shape[2], device=DEVICE)[None, :] * block
    exists = (starts < length)[:, None, :].expand(batch, heads, -1)
    torch.testing.assert_close(out[:, :, :expected.shape[2]][exists[:, :, :expected.shape[2]]],
                               expected[exists[:, :, :expected.shape[2]]], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out[~exists], initial[~exists], atol=0, rtol=0, equal_nan=True,
                               msg="wrote summaries of blocks past the length")


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("first, count", [(0, None), (2, 3)])
def test_block_summaries_int8(monkeypatch, backend, first, count):
    """Whole-range summaries of int8 keys (prefill, dynamic caches): those of the keys dequantised and rounded to
    the model's dtype, on either path (Triton: in the kernel; PyTorch: only the blocks' slots dequantised)."""
    monkeypatch.setenv("HF_SPARSE_BACKEND", backend)
    gen = torch.Generator().manual_seed(seed("int8-prefill", first, count))
    batch, heads, length, dim, block = 3, 2, 100, 64, 16
    keys = torch.randn(batch, heads, length, dim, generator=gen).to(DEVICE)
    quantized, scales = ref.quantize_per_token(keys)
    kv_start = torch.tensor([0, 7, 21], device=DEVICE)
    gate = torch.randn(heads, block, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    dequantized = ref.dequantize_per_token(quantized, scales).to(torch.bfloat16)
    expected = ref.block_summaries(dequantized, gate, kv_start, block, first, count)
    out = kernels.block_summaries(quantized, gate, kv_start, block, first, count, key_scale=scales,
                                  dtype=torch.bfloat16)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype, gated", [("bf16", True), ("fp16", False)])
def test_recent_block_summaries_int8(size, dtype, gated):
    """int8 keys with per-token scales: the summaries of the dequantised keys, rounded to the model's dtype."""
    gen = torch.Generator().manual_seed(seed("int8", size, dtype, gated))
    d = dims(size)
    length, capacity, block = d["length"], d["capacity"], d["block"]
    batch, heads, dim, recent = 3, 2, 64, 1
    keys = storage(batch, heads, capacity, length, dim, torch.float32, gen)
    quantized, scales = ref.quantize_per_token(keys)
    kv_start = torch.tensor([0, 7, 21], device=DEVICE)
    gate = torch.randn(heads, block, dim, generator=gen).to(DTYPES[dtype]).to(DEVICE) if gated else None
    dequantized = ref.dequantize_per_token(quantized[:, :, :length], scales[:, :, :length]).to(DTYPES[dtype])
    expected = ref.block_summaries(dequantized, gate, kv_start, block)
    out = torch.full((batch, heads, capacity // block, dim), float("nan"), device=DEVICE)
    out[:, :, :expected.shape[2]] = ref.block_summaries(dequantized[:, :, :length - recent], gate, kv_start, block)
    kernels.recent_block_summaries(quantized, gate, kv_start, block, length_tensor(length), recent, out,
                                   key_scale=scales, dtype=DTYPES[dtype])
    last = (length - 1 - kv_start) // block  # each row's filling block
    for b in range(batch):
        torch.testing.assert_close(out[b, :, last[b]], expected[b, :, last[b]], atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="key_scale"):
        kernels.recent_block_summaries(quantized, gate, kv_start, block, length_tensor(length), recent, out)


@needs_triton
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("batch, q_heads, kv_heads, dim, dtype, num_queries", [
    (1, 8, 2, 64, "fp32", 1), (3, 8, 1, 128, "bf16", 1), (3, 4, 4, 64, "fp16", 3),
])
def test_decode_select_and_attention_with_device_length(size, batch, q_heads, kv_heads, dim, dtype, num_queries):
    """Selection and attention over a static cache's whole storage with the length on the device equal the
    reference over the valid slots."""
    gen = torch.Generator().manual_seed(seed(size, batch, q_heads, kv_heads, dim, dtype, num_queries))
    d = dims(size)
    length, capacity, block = d["length"], d["capacity"], d["block"]
    if size == "small" and not CUDA:
        # 21 valid of 32 blocks: wider than the kernel's narrowest band (16), as at real sizes (the interpreter only:
        # compiled attention kernels take blocks of 16 tokens or more)
        block = 4
    dtype = DTYPES[dtype]
    kv_start = torch.tensor([0, 11, 30][:batch], device=DEVICE)
    query = torch.randn(batch, q_heads, num_queries, dim, generator=gen).to(dtype).to(DEVICE)
    key = storage(batch, kv_heads, capacity, length, dim, dtype, gen)
    value = storage(batch, kv_heads, capacity, length, dim, dtype, gen)
    summaries = torch.full((batch, kv_heads, capacity // block, dim), 5e3, device=DEVICE)
    real = ref.block_summaries(key[:, :, :length], None, kv_start, block)
    summaries[:, :, :real.shape[2]] = real
    scale = dim ** -0.5
    top_k = (2, 3) if size == "small" else (8, 12)
    select_args = dict(scale=scale, kv_start=kv_start, block_size=block, top_k=top_k, query_tile=num_queries,
                       head_union=True, sink_blocks=1)
    # The same op with host lengths (checked against the reference in test_kernels.py; on random scores the
    # GPU's tf32 logits may flip near-ties against the float32 reference, so compare the op with itself here).
    expected = kernels.select_blocks(query, summaries, q_offset=length - num_queries, key_length=length,
                                     **select_args)
    selection = kernels.select_blocks(query, summaries, q_offset=0, length=length_tensor(length), **select_args)
    assert torch.equal(selection.counts, expected.counts)
    assert torch.equal(selection.indices, expected.indices)
    assert (expected.counts > 1).all()
    if not CUDA:  # the interpreter computes float32 logits exactly: the reference's selection too
        reference = ref.select_blocks(query, summaries, q_offset=length - num_queries, key_length=length, **select_args)
        assert torch.equal(selection.indices, reference.indices)

    expected_out, expected_lse = ref.sparse_attention(query, key[:, :, :length], value[:, :, :length], expected,
                                                      scale=scale, q_offset=length - num_queries, kv_start=kv_start)
    out, lse = kernels.sparse_attention(query, key, value, selection, scale=scale, q_offset=0, kv_start=kv_start,
                                        length=length_tensor(length))
    assert rel_err(out, expected_out) <= REL_TOL[dtype]
    torch.testing.assert_close(lse, expected_lse, atol=1e-3, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("batch, q_heads, kv_heads, dtype, num_queries", [(1, 9, 3, "bf16", 1), (3, 4, 2, "fp32", 2)])
def test_all_blocks_decode_reads_only_the_valid_blocks(size, batch, q_heads, kv_heads, dtype, num_queries):
    """A static layer's all-blocks selection lists every stored block with each row's valid block count (from the
    device length and the row's start), so the decode equals dense attention over the valid slots and the slots
    past the length (huge values) are never read."""
    from hf_sparse.attention import all_blocks_selection

    gen = torch.Generator().manual_seed(seed("all-blocks", size, batch, q_heads, dtype, num_queries))
    d = dims(size)
    length, capacity, block, dim = d["length"], d["capacity"], d["block"], 64
    dtype = DTYPES[dtype]
    layer = SparseCache(tiny_config(layers=1), block_size=block, max_cache_len=capacity).layers[0]
    layer.update(*(torch.zeros(batch, kv_heads, length, dim, dtype=dtype, device=DEVICE),) * 2)
    layer.key_storage = storage(batch, kv_heads, capacity, length, dim, dtype, gen)
    layer.value_storage = storage(batch, kv_heads, capacity, length, dim, dtype, gen)
    rows = RowLayout(torch.tensor([0, 11, 30][:batch], device=DEVICE), 0, 30 if batch > 1 else 0)
    layer.set_padding(rows)
    selection = all_blocks_selection(layer, kv_heads, num_queries)
    assert selection.indices.shape[-1] == capacity // block
    assert selection.counts[:, 0, 0].tolist() == [-(-(length - int(s)) // block) for s in rows.starts]
    query = torch.randn(batch, q_heads, num_queries, dim, generator=gen).to(dtype).to(DEVICE)
    scale = dim ** -0.5
    expected, expected_lse = ref.sparse_attention(query, layer.key_storage[:, :, :length],
                                                  layer.value_storage[:, :, :length], selection, scale=scale,
                                                  q_offset=length - num_queries, kv_start=rows)
    out, lse = kernels.sparse_attention(query, layer.key_storage, layer.value_storage, selection, scale=scale,
                                        q_offset=0, kv_start=rows, length=layer.device_length)
    assert torch.isfinite(out).all()
    assert rel_err(out, expected) <= REL_TOL[dtype]
    torch.testing.assert_close(lse, expected_lse, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("method, num_beams, dense_below", [("plas", 1, 0), ("plas", 2, 0), ("xattn", 1, 0),
                                                             ("plas", 1, (100, 0)), ("plas", 2, (100, 0)),
                                                             ("xattn", 1, (100, 0))])
def test_generate_with_static_cache_equals_dynamic(method, num_beams, dense_below):
    """generate() over an explicit static cache, greedy and beam search (the cache is expanded and reordered),
    left-padded: the dynamic cache's tokens. On the Triton path decode reads its lengths on the device. With
    ``dense_below=(100, 0)`` the prompt runs dense (the static layers take their padding layout from the first
    decode step's mask) and the decode sparse."""
    model = build(tiny_config(layers=2), "plas").to(DEVICE)
    if method == "plas":
        config = hf_sparse.PLASConfig(block_size=16, prefill_top_k=(2, 3), decode_top_k=(2, 3), dense_below=dense_below,
                                      query_union=16, decode_cuda_graph=False)
    else:
        config = hf_sparse.XAttnConfig(dense_last=0, block_size=16, stride=4, threshold=0.6, decode_threshold=0.6,
                                       dense_below=dense_below, decode_cuda_graph=False)
    hf_sparse.configure(model, config)
    ids = torch.randint(0, 128, (2, 45), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0, num_beams=num_beams)
    dynamic = model.generate(ids, **kwargs)
    static = model.generate(ids, past_key_values=SparseCache(model.config, max_cache_len=60), **kwargs)
    assert torch.equal(static, dynamic)


def test_generate_with_static_cache_on_cpu_and_wrapper_lifetime():
    """An explicit static SparseCache in generate() (PyTorch path here: no graphs) gives the dynamic cache's
    tokens; the forward wrapper is removed when generate() returns (a hook's forward is restored) and the model
    still deep-copies."""
    import copy
    import functools

    model = build(tiny_config(layers=2), "plas")
    hf_sparse.configure(model, hf_sparse.PLASConfig(block_size=16, prefill_top_k=(2, 3), decode_top_k=(2, 3),
                                                    dense_below=0, query_union=16))
    ids = torch.randint(0, 128, (1, 50), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    dynamic = model.generate(ids, **kwargs)
    hook = functools.partial(type(model).forward, model)  # what accelerate's hooks leave as `model.forward`
    model.forward = hook
    static = model.generate(ids, past_key_values=SparseCache(model.config, max_cache_len=70), **kwargs)
    assert torch.equal(static, dynamic)
    assert model.__dict__["forward"] is hook
    stats = hf_sparse.graphs.stats(model)
    assert stats is not None and stats.replays == 0 and stats.captures == 0  # CPU: every call eager
    del model.forward
    copy.deepcopy(model)


def test_transformers_static_cache_is_mapped_or_refused():
    """generate(cache_implementation="static") gets a static SparseCache of transformers' size (the same tokens as
    the default cache); a transformers StaticCache passed to forward (its keys do not end at the last query) is
    refused with an error that names the way out, instead of attending to empty slots."""
    from transformers import StaticCache

    config = tiny_config(layers=2)
    model = build(config, "plas")
    hf_sparse.configure(model, hf_sparse.PLASConfig(block_size=16, prefill_top_k=(2, 3), decode_top_k=(2, 3),
                                                    dense_below=0, query_union=16))
    ids = torch.randint(0, 128, (1, 50), generator=torch.Generator().manual_seed(6))
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    default = model.generate(ids, **kwargs)
    static = model.generate(ids, cache_implementation="static", return_dict_in_generate=True, **kwargs)
    assert isinstance(static.past_key_values, SparseCache) and static.past_key_values.static_length >= 56
    assert torch.equal(static.sequences, default)
    model.generation_config.cache_implementation = "static"  # set on the model: the same, and left as it was
    assert torch.equal(model.generate(ids, **kwargs), default)
    assert model.generation_config.cache_implementation == "static"
    with pytest.raises(ValueError, match="StaticCache are not supported"):
        model(ids, past_key_values=StaticCache(config=config, max_cache_len=64))


def test_static_cache_room_stays_under_a_sixteenth_of_the_call():
    """A static cache rounds a call's tokens up to steps of 256, or of less for short calls, so that the room beyond
    them stays under a sixteenth (at least a block)."""
    from hf_sparse.integration import STATIC_CACHE_STEP, static_cache_tokens

    for block in (16, 64, 128):
        for length in list(range(1, 300)) + [1088, 2112, 4160, 8256, 32832, 131136]:
            tokens = static_cache_tokens(length, block)
            assert tokens >= length and tokens % block == 0
            assert tokens - length < max(block, length / 16, 1) and tokens - length < max(block, STATIC_CACHE_STEP)
    assert static_cache_tokens(4160, 64) == 4352 and static_cache_tokens(1088, 64) == 1088


def test_generate_reuses_its_static_cache_while_it_fits(monkeypatch):
    """The static SparseCache generate() makes is kept for the next call: reset and reused while the call fits it
    (same batch; a prompt and new tokens within its storage, which is not more than about twice what the call
    needs), with the tokens of a fresh cache; otherwise let go before a new one is made (never two at once);
    graphs.release() frees it. (The cache's logic, on the PyTorch kernels: the interpreter would add minutes.)"""
    from hf_sparse import graphs

    monkeypatch.setenv("HF_SPARSE_BACKEND", "torch")

    model = build(tiny_config(layers=2), "plas")
    hf_sparse.configure(model, hf_sparse.PLASConfig(block_size=16, prefill_top_k=(2, 3), decode_top_k=(2, 3),
                                                    dense_below=0, query_union=16))
    ids = torch.randint(1, 128, (2, 60), generator=torch.Generator().manual_seed(7))
    kwargs = dict(do_sample=False, pad_token_id=0, cache_implementation="static", return_dict_in_generate=True)
    first = model.generate(ids, max_new_tokens=6, **kwargs)
    cache = first.past_key_values
    assert cache.layers[0].capacity == 80  # 66 tokens in steps of 16: integration.static_cache_tokens
    storage = cache.layers[0].key_storage
    graphs.release(model)
    expected = {n: model.generate(ids[:, :n], max_new_tokens=9, **kwargs).sequences for n in (60, 41)}
    graphs.release(model)
    model.generate(ids, max_new_tokens=6, **kwargs)
    for n in (60, 41):  # other lengths, same storage
        again = model.generate(ids[:, :n], max_new_tokens=9, **kwargs)
        assert again.past_key_values is graphs._STATES[model].cache
        assert again.past_key_values.layers[0].key_storage is graphs._STATES[model].cache.layers[0].key_storage
        assert torch.equal(again.sequences, expected[n])
    kept = graphs._STATES[model].cache
    single = model.generate(ids[:1], max_new_tokens=3, **kwargs).past_key_values  # another batch: a new cache
    assert single is not kept and graphs._STATES[model].cache is single
    model.to(torch.bfloat16)  # another dtype: a new cache of that dtype
    wider = model.generate(ids[:1], max_new_tokens=3, **kwargs).past_key_values
    assert wider is not single and wider.layers[0].key_storage.dtype == torch.bfloat16
    model.to(torch.float32)
    graphs.release(model)
    assert model not in graphs._STATES
    del storage


def test_static_cache_validation_and_growth():
    with pytest.raises(ValueError, match="max_cache_len"):
        SparseCache(tiny_config(), max_cache_len=0)
    cache = SparseCache(tiny_config(layers=1), block_size=16, max_cache_len=40)
    layer = cache.layers[0]
    keys = torch.randn(1, 2, 30, 16)
    layer.update(keys, keys)
    assert layer.capacity == 48 and layer.length == 30 and int(layer.device_length) == 30
    version = cache.layout_version
    more = torch.randn(1, 2, 25, 16)
    out, _ = layer.update(more, more)  # past max_cache_len: grows, keeps the contents
    assert layer.capacity >= 55 and cache.layout_version != version
    torch.testing.assert_close(out, torch.cat([keys, more], 2))
    layer.crop(-5)
    assert layer.length == 50 and int(layer.device_length) == 50
    cache.reset()
    layer.update(keys[:, :, :7], keys[:, :, :7])  # a new sequence's first call sets the device's length
    assert layer.length == 7 and int(layer.device_length) == 7


def test_a_prefill_defers_the_device_length_to_its_first_reader(monkeypatch):
    """A static layer's host-side write (a prefill, a crop) launches nothing for the device length: the value is
    written when device_length is next read, or by SparseCache.prepare_replay before a kept graph replays; a
    capture that would read a length still pending fails loudly instead of recording the fill."""
    from hf_sparse import cache as cache_module

    cache = SparseCache(tiny_config(layers=2), block_size=16, max_cache_len=40)
    keys = torch.randn(1, 2, 30, 16)
    for layer in cache.layers:
        layer.update(keys, keys)
    fills = []
    monkeypatch.setattr(torch.Tensor, "fill_", lambda self, value: fills.append(value) or self.zero_().add_(value))
    first, second = cache.layers
    assert first._pending_length == 30 and int(first._device_length) == 0 and fills == []
    assert int(first.device_length) == 30 and fills == [30] and first._pending_length is None
    int(first.device_length)
    assert fills == [30]  # written once
    cache.prepare_replay()
    assert fills == [30, 30] and int(second._device_length) == 30
    second.crop(-4)
    assert int(second._device_length) == 30 and second._pending_length == 26
    monkeypatch.setattr(cache_module, "capturing", lambda device: True)
    with pytest.raises(RuntimeError, match="not yet written when a CUDA graph capture read it"):
        second.device_length


def test_a_static_layer_writes_at_the_device_length_while_capturing(monkeypatch):
    """Outside a CUDA-graph capture a static layer writes at the host's length and sets the device's; while
    capturing it writes at (and advances) the device's, which a replay reads."""
    from hf_sparse import cache as cache_module

    layer = SparseCache(tiny_config(layers=1), block_size=16, max_cache_len=40).layers[0]
    first, step = torch.randn(1, 2, 20, 16), torch.randn(1, 2, 1, 16)
    layer.update(first, first)
    layer.device_length.fill_(5)  # as if a replay had moved the device's length on
    monkeypatch.setattr(cache_module, "capturing", lambda device: True)
    layer.update(step, step)
    assert int(layer.device_length) == 6 and layer.length == 21
    torch.testing.assert_close(layer.key_storage[:, :, 5:6], step)
    assert layer.valid_blocks is None  # no padding layout yet: nothing to count
    layer.set_padding(RowLayout(torch.tensor([2]), 2, 2))
    layer.update(step, step)  # the append also counts the row's valid blocks: ceil((7 - 2) / 16)
    assert int(layer.device_length) == 7 and layer.valid_blocks.tolist() == [1]
    from hf_sparse.attention import all_blocks_selection
    assert all_blocks_selection(layer, 2, 1).counts.flatten().tolist() == [1, 1]
    monkeypatch.setattr(cache_module, "capturing", lambda device: False)
    layer.update(step * 2, step * 2)
    assert int(layer.device_length) == 23 and layer.length == 23 and layer.valid_blocks is None
    torch.testing.assert_close(layer.key_storage[:, :, 22:23], step * 2)
    assert all_blocks_selection(layer, 2, 1).counts.flatten().tolist() == [2, 2]  # ceil(21 / 16), from the length


def test_a_reset_static_cache_summarizes_the_new_sequence_before_a_replay():
    """A kept CUDA graph replays only the rewrite of the last block: before its first replay for a new sequence
    (after a dense prefill, which summarises nothing), SparseCache.prepare_replay summarises the new
    sequence's full blocks with the gate the decode used, once."""
    cache = SparseCache(tiny_config(layers=2), block_size=16, max_cache_len=96)
    gen = torch.Generator().manual_seed(7)
    gate = torch.randn(2, 16, 16, generator=gen)
    first = torch.randn(1, 2, 70, 16, generator=gen)
    for layer in cache.layers:
        layer.update(first, first)
        layer.set_padding(RowLayout.uniform(1, "cpu"))
    cache.layers[0].summarize_full_blocks(gate, 1)  # layer 0 decodes on summaries (a warm-up did this), layer 1 not
    cache.reset()
    second = torch.randn(1, 2, 70, 16, generator=gen)
    for layer in cache.layers:
        layer.update(second, second)
        layer.set_padding(RowLayout.uniform(1, "cpu"))
    layer = cache.layers[0]
    assert layer.summarized_blocks == 0 and layer.decode_gate[0] is gate
    cache.prepare_replay()
    expected = hf_sparse.kernels.block_summaries(second, gate, RowLayout.uniform(1, "cpu"), 16)
    torch.testing.assert_close(layer.summary_storage[:, :, :4], expected[:, :, :4])  # the 4 full blocks
    assert layer.summarized_blocks == 4 and not layer._decode_summaries_due
    assert cache.layers[1].decode_gate is None and cache.layers[1].summarized_blocks == 0
    stored = layer.summary_storage.clone()
    cache.prepare_replay()  # done for this sequence: nothing recomputed
    assert torch.equal(layer.summary_storage, stored)


def padded_prompt(seed_value: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of 61 random ids, the second left-padded by 14 (ids, mask). Blocks count from a row's first valid
    slot: a 16-token block ends at slot 63 of the first row and at slot 61 (its own position 47) of the second, so
    five decode steps (slots 61..65) take both rows across a block boundary."""
    ids = torch.randint(0, 128, (2, 61), generator=torch.Generator().manual_seed(seed_value)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :14] = 0
    return ids, mask


def counted(monkeypatch, module, name: str) -> list:
    """``module.name`` wrapped to append to the returned list at every call."""
    calls, original = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


def decode_logits(model, cache, ids, mask, steps):
    """Prefill, then ``steps`` greedy decode steps; the last-position logits of every call."""
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        position = mask.sum(-1, keepdim=True) - 1
        logits = [out.logits[:, -1]]
        for _ in range(steps):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], -1)
            position = position + 1
            out = model(input_ids=token, attention_mask=mask, position_ids=position, past_key_values=cache,
                        use_cache=True)
            logits.append(out.logits[:, -1])
    return torch.stack(logits)


@pytest.mark.parametrize("method, kv_dtype, logn", [("plas", "int8", False), ("plas", "auto", True),
                                                    ("xattn", "auto", False)])
def test_static_cache_decode_equals_dynamic(monkeypatch, method, kv_dtype, logn):
    """Left-padded batch, decode across block boundaries: a static cache gives the dynamic cache's logits (float
    or int8 K/V). On the Triton path (interpreter or CUDA) decode reads its lengths on the device (and the dense
    last layer runs the decode kernel over all blocks); on the PyTorch path it is the dynamic path exactly."""
    model = build(tiny_config(layers=2), "plas").to(DEVICE)
    if method == "plas":
        config = hf_sparse.PLASConfig(block_size=16, prefill_top_k=(2, 3), decode_top_k=(2, 3), dense_below=0,
                                      query_union=16, logn_scaling=logn, logn_base=32 if logn else None)
    else:
        config = hf_sparse.XAttnConfig(dense_last=0, block_size=16, stride=4, threshold=0.6, decode_threshold=0.6, dense_below=0)
    hf_sparse.configure(model, config)
    ids, mask = padded_prompt(5)
    calls = counted(monkeypatch, kernels, "recent_block_summaries")
    steps = 5  # slots 61..65 (the padded row: 47..51 of its own): both rows cross a block boundary
    dynamic = decode_logits(model, SparseCache(model.config, kv_dtype=kv_dtype), ids, mask, steps)
    static_cache = SparseCache(model.config, max_cache_len=80, kv_dtype=kv_dtype)
    static = decode_logits(model, static_cache, ids, mask, steps)
    on_device = kernels.backend_for(ids.float()) == "triton"
    assert len(calls) == (steps if on_device else 0)  # the sparse layer of each decode step (the last is dense)
    assert static_cache.layers[0].length == 61 + steps and int(static_cache.layers[0].device_length) == 61 + steps
    if on_device:
        torch.testing.assert_close(static, dynamic, atol=1e-4, rtol=1e-4)
    else:
        assert torch.equal(static, dynamic)


@pytest.mark.parametrize("kv_dtype, logn", [("int8", False), ("auto", True)])
def test_star_static_decode_equals_dynamic(monkeypatch, kv_dtype, logn):
    """Star's generation over a static cache (its CUDA-graph path: global attention over every block through the
    decode kernel, lengths and logN positions read on the device) gives the dynamic cache's logits (sdpa, or the
    int8 kernels), left-padded, across block boundaries; on the PyTorch path it is the dynamic path exactly."""
    from hf_sparse import star_attention

    model = build(tiny_config(layers=2), "star").to(DEVICE)
    hf_sparse.configure(model, hf_sparse.StarConfig(block_size=32, anchor_size=16, dense_above_density=None,
                                                    logn_scaling=logn, logn_base=32 if logn else None))
    ids, mask = padded_prompt(6)
    calls = counted(monkeypatch, star_attention, "all_blocks_decode")
    steps = 5  # slots 61..65 (47..51 of the padded row's own): both rows cross a 16-token block boundary
    dynamic = decode_logits(model, SparseCache(model.config, kv_dtype=kv_dtype), ids, mask, steps)
    assert not calls
    static = decode_logits(model, SparseCache(model.config, max_cache_len=80, kv_dtype=kv_dtype), ids, mask, steps)
    if kernels.backend_for(ids.float()) == "triton":
        assert len(calls) == steps * 2  # every layer of every decode step
        torch.testing.assert_close(static, dynamic, atol=1e-4, rtol=1e-4)
    else:
        assert not calls and torch.equal(static, dynamic)


@needs_triton
@pytest.mark.parametrize("method", ["plas", "xattn"])
def test_static_decode_after_a_dense_prefill(method, monkeypatch):
    """A prefill that runs dense computes no block summaries; the static decode that follows summarises the
    prefill's blocks itself (also in a cache reset for reuse, whose storage holds another sequence's summaries),
    with the logits of the dynamic cache's decode. Every decode step reads its lengths on the device from the
    first on (the padding layout a dense prefill leaves to it), as a CUDA graph's warm-up and replays do."""
    model = build(tiny_config(layers=2), "plas").to(DEVICE)
    dense_below = (10_000, 0)  # prefill dense, decode sparse
    if method == "plas":
        config = hf_sparse.PLASConfig(block_size=16, prefill_top_k=(2, 3), decode_top_k=(2, 3), query_union=16,
                                      dense_below=dense_below)
    else:
        config = hf_sparse.XAttnConfig(dense_last=0, block_size=16, stride=4, threshold=0.6, decode_threshold=0.6,
                                       dense_below=dense_below)
    hf_sparse.configure(model, config)
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(0, 128, (2, 70), generator=gen).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    dynamic = decode_logits(model, SparseCache(model.config, kv_dtype="auto"), ids, mask, 3)
    static_cache = SparseCache(model.config, max_cache_len=95)
    other = torch.randint(0, 128, (2, 70), generator=gen).to(DEVICE)
    decode_logits(model, static_cache, other, mask, 3)  # another sequence's summaries in the storage
    static_cache.reset()
    decided, plan_call = [], hf_sparse.plan.plan_call
    monkeypatch.setattr(hf_sparse.plan, "plan_call", lambda call: decided.append((call.phase, call.static))
                        or plan_call(call))
    static = decode_logits(model, static_cache, ids, mask, 3)
    torch.testing.assert_close(static, dynamic, atol=1e-4, rtol=1e-4)
    assert [static for phase, static in decided if phase == "decode"] == [True] * 3 * 2


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("method, dtype, kv_dtype", [("plas", torch.float32, "auto"), ("plas", torch.bfloat16, "auto"),
                                                     ("plas", torch.bfloat16, "int8"), ("xattn", torch.float32, "auto"),
                                                     ("xattn", torch.bfloat16, "int8")])
def test_cuda_graph_decode_equals_eager_static_decode(method, dtype, kv_dtype):
    """Decode steps replayed from a captured graph give the logits of the same steps run eagerly (same kernels,
    lengths read on the device), across block boundaries, with a left-padded batch."""
    model = build(tiny_config(q_heads=8, kv_heads=2, head_dim=64, layers=3), "plas").to("cuda", dtype)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 128, (2, 300), generator=gen).cuda()
    mask = torch.ones_like(ids)
    mask[0, :17] = 0
    hf_sparse.configure(model, graph_config(method, decode_cuda_graph=False))
    eager = decode_logits(model, SparseCache(model.config, max_cache_len=340, kv_dtype=kv_dtype), ids, mask, 36)
    hf_sparse.configure(model, graph_config(method, decode_compile=False))  # the same kernels as eager
    wrapper = hf_sparse.graphs.install(model)
    try:
        replayed = decode_logits(model, SparseCache(model.config, max_cache_len=340, kv_dtype=kv_dtype), ids, mask,
                                 36)
    finally:
        hf_sparse.graphs.uninstall(model)
    assert wrapper.stats.disabled_reason is None and wrapper.stats.replays == 35  # step 1 warms up, 2..36 replay
    assert wrapper.stats.captures == 1 and "forward" not in model.__dict__
    torch.testing.assert_close(replayed, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("method, dtype, kv_dtype", [("plas", torch.float32, "auto"), ("plas", torch.bfloat16, "auto"),
                                                     ("plas", torch.bfloat16, "int8"), ("xattn", torch.bfloat16, "auto")])
def test_generate_with_cuda_graphs_equals_eager(method, dtype, kv_dtype):
    """generate() on CUDA decodes through CUDA-graph replays, with the tokens of eager decode."""
    config = tiny_config(q_heads=8, kv_heads=2, head_dim=64, layers=3)
    model = build(config, "plas").to("cuda", dtype)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (2, 300), generator=gen).cuda()
    mask = torch.ones_like(ids)
    mask[0, :17] = 0
    runs = {}
    for graphs in (False, True):
        hf_sparse.configure(model, graph_config(method, decode_cuda_graph=graphs, kv_cache_dtype=kv_dtype))
        runs[graphs] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                                      pad_token_id=0)
    stats = hf_sparse.graphs.stats(model)
    assert stats is not None and stats.disabled_reason is None and stats.captures == 1
    assert stats.replays == 38  # decode steps 2..39 replay (step 1 warms up)
    assert "forward" not in model.__dict__  # the wrapper lives for one generate() call
    # A second call fits the kept cache: no capture, every decode step replays, the same tokens.
    again = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0)
    assert stats.captures == 1 and stats.replays == 38 + 39
    assert torch.equal(again, runs[True])
    # Below dense_below the decode steps replay a graph too (every block, through the decode kernel), with the
    # tokens of eager dense decode (sdpa).
    dense = {}
    for graphs in (False, True):
        hf_sparse.configure(model, graph_config(method, decode_cuda_graph=graphs, kv_cache_dtype=kv_dtype,
                                                dense_below=(0, 10_000)))
        dense[graphs] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                       pad_token_id=0)
    assert stats.captures == 2 and stats.replays == 38 + 39 + 10
    new = slice(ids.shape[1], None)
    agree = 4 if dtype == torch.float32 else 2
    assert torch.equal(dense[True][:, new][:, :agree], dense[False][:, new][:, :agree])
    hf_sparse.graphs.release(model)
    # Under graphs the dense last layer runs the decode kernel over all blocks instead of sdpa: on this random
    # model's near-tied logits a late token may flip, after which the two continuations differ.
    new = slice(ids.shape[1], None)
    assert torch.equal(runs[True][:, new][:, :8], runs[False][:, new][:, :8])
    assert (runs[True][:, new] == runs[False][:, new]).float().mean().item() > 0.5


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_star_generate_with_cuda_graphs_equals_eager(kv_dtype):
    """Star's generate() on CUDA decodes through CUDA-graph replays (global attention over every block), with the
    tokens of its eager decode; a second call replays the graph kept with generate()'s own static cache."""
    from hf_sparse.cache import CACHE_KWARG

    model = build(tiny_config(q_heads=8, kv_heads=2, head_dim=64, layers=3), "star").to("cuda", torch.bfloat16)
    ids = torch.randint(0, 128, (2, 300), generator=torch.Generator().manual_seed(3)).cuda()
    mask = torch.ones_like(ids)
    mask[0, :17] = 0

    def run(graphs: bool):
        hf_sparse.configure(model, hf_sparse.StarConfig(block_size=128, anchor_size=64, decode_cuda_graph=graphs))
        cache = {} if kv_dtype == "auto" else {CACHE_KWARG: SparseCache(model.config, max_cache_len=330,
                                                                         kv_dtype=kv_dtype)}
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0,
                              **cache)

    eager, graphed = run(False), run(True)
    stats = hf_sparse.graphs.stats(model)
    assert stats is not None and stats.disabled_reason is None and stats.captures == 1 and stats.replays == 22
    new = slice(ids.shape[1], None)
    # Eager decode attends with sdpa (auto) and the graph with the decode kernel over every block: in bf16 on this
    # random model's near-tied logits a later token may flip (on the H100 the padded row's sixth), as in the dense
    # decode of test_generate_with_cuda_graphs_equals_eager; test_star_static_decode_equals_dynamic compares the
    # two paths' logits in float32.
    assert torch.equal(graphed[:, new][:, :2], eager[:, new][:, :2])
    if kv_dtype == "auto":
        assert torch.equal(run(True), graphed)
        assert stats.captures == 1 and stats.replays == 22 + 23
    hf_sparse.graphs.release(model)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_fused_decode_steps_leave_the_capture_stream_no_cublas_workspace(monkeypatch):
    """A model whose layers all fuse decodes from graphs that call no cuBLAS routine (decode_linear for the weight
    products and the head, Inductor's elementwise rotary embedding): a capture stream that has run nothing before
    holds no cuBLAS workspace afterwards (32 MiB on Hopper, kept for the process's life), so graph decode holds no
    memory that dense decode does not."""
    model = build(tiny_config(q_heads=8, kv_heads=2, head_dim=64, layers=2), "plas").to("cuda", torch.bfloat16)
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(7)).cuda()

    def generate(graphs: bool) -> int:
        hf_sparse.configure(model, graph_config("plas", decode_cuda_graph=graphs))
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                       pad_token_id=0)
        stats = hf_sparse.graphs.stats(model)
        captures = stats.captures if stats is not None else 0
        hf_sparse.graphs.release(model)
        gc.collect()
        torch.cuda.synchronize()
        return captures

    assert generate(False) == 0  # what any decode allocates once (the default stream's workspace, ...)
    monkeypatch.setattr(hf_sparse.graphs, "_CAPTURE_STREAMS", {})  # a capture stream that has run nothing
    held = torch.cuda.memory_allocated()
    assert generate(True) == 1
    assert torch.cuda.memory_allocated() <= held + 2**20, (held, torch.cuda.memory_allocated())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_graph_captures_of_many_models_hold_no_memory_after_release():
    """Every model captures on one stream per device (cuBLAS keeps a workspace per stream it ran on, for the
    process's life): a third model's generate() and release leave no more memory held than they found."""
    config = tiny_config(q_heads=8, kv_heads=2, head_dim=64, layers=2)
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(5)).cuda()
    held = []
    for _ in range(3):
        model = build(config, "plas").to("cuda", torch.bfloat16)
        hf_sparse.configure(model, graph_config("plas"))
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                       pad_token_id=0)
        assert hf_sparse.graphs.stats(model).captures == 1
        hf_sparse.graphs.release(model)
        del model
        gc.collect()
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated())
    assert held[2] <= held[1] + 2**20, held
    assert hf_sparse.graphs.capture_stream(ids.device) is hf_sparse.graphs.capture_stream(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("method", ["plas", "xattn"])
def test_compiled_decode_step_equals_eager_decode(method):
    """decode_compile (default): the captured step runs the fused layer forward (hf_sparse.fusion: decode_linear
    and Inductor's rotary embedding and final norm). In float32 its logits equal eager decode's to float32
    accuracy; in bfloat16 the fused kernels sum in another order, within bf16 rounding."""
    model = build(tiny_config(q_heads=8, kv_heads=2, head_dim=64, layers=3), "plas").to("cuda")
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 128, (2, 300), generator=gen).cuda()
    mask = torch.ones_like(ids)
    mask[0, :17] = 0
    hf_sparse.configure(model, graph_config(method, decode_cuda_graph=False))
    eager = decode_logits(model, SparseCache(model.config, max_cache_len=340), ids, mask, 20)
    hf_sparse.configure(model, graph_config(method))
    wrapper = hf_sparse.graphs.install(model)
    try:
        with hf_sparse.fusion.fused_modules(model) as swapped:
            # every layer whole (fused_layer_forward), every norm and MLP, the final norm, the rotary embedding
            assert swapped == 3 + 3 * 3 + 1 + 1 + 1 + 1  # ..., the rotary module and function, the head
        replayed = decode_logits(model, SparseCache(model.config, max_cache_len=340), ids, mask, 20)
    finally:
        hf_sparse.graphs.uninstall(model)
    assert wrapper.stats.disabled_reason is None and wrapper.stats.captures == 1
    assert None not in hf_sparse.fusion._COMPILED.values()  # every class compiled and ran compiled
    torch.testing.assert_close(replayed, eager, atol=1e-5, rtol=1e-5)
    # bfloat16: the first decode step (same prefill, same token; warmed up with the compiled modules) compiled vs
    # not, within bf16 rounding (later steps may take other tokens on this random model's near-tied logits).
    model = model.to(torch.bfloat16)
    steps = {}
    for compiled in (False, True):
        hf_sparse.configure(model, graph_config(method, decode_compile=compiled))
        hf_sparse.graphs.install(model)
        try:
            steps[compiled] = decode_logits(model, SparseCache(model.config, max_cache_len=340), ids, mask, 1)[1:]
        finally:
            hf_sparse.graphs.uninstall(model)
    error = (steps[True].float() - steps[False].float()).norm() / steps[False].float().norm()
    assert error < 2e-2, error


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("method", ["plas", "xattn"])
def test_kept_graphs_decode_a_new_prompt_as_fresh_graphs_do(method):
    """A second generate() with another prompt of the same length replays the graphs kept from the first (no
    capture) over a dense prefill (which summarises nothing): its sparse decode selects on the new prompt's
    summaries (SparseCache.prepare_replay), so its tokens are those of graphs captured afresh for it."""
    model = build(tiny_config(q_heads=8, kv_heads=2, head_dim=64, layers=3), "plas").to("cuda")
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 128, (1, 300), generator=gen).cuda() for _ in range(2)]
    hf_sparse.configure(model, graph_config(method, dense_below=(10_000, 0), decode_compile=False))

    def run(ids):
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                              do_sample=False, pad_token_id=0)[:, ids.shape[1]:]

    run(prompts[0])
    stats = hf_sparse.graphs.stats(model)
    captures = stats.captures
    kept = run(prompts[1])
    assert stats.captures == captures  # the kept graphs replayed
    hf_sparse.graphs.release(model)
    fresh = run(prompts[1])
    assert stats.captures == captures + 1
    assert torch.equal(kept, fresh)


def test_dependent_launch_where_the_gpu_and_triton_have_it(monkeypatch):
    """A decode step's kernels launch with programmatic dependent launch on CUDA devices of compute capability 9+
    (with Triton's grid dependency control); never on the CPU or under the interpreter; HF_SPARSE_PDL=0 turns it
    off. (The device checks are faked here; the GPU tests run the kernels with it.)"""
    from hf_sparse.kernels import _common

    assert not _common.dependent_launch(torch.device("cpu"))
    cuda = torch.device("cuda", 0)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for capability, expected in (((9, 0), True), ((8, 0), False)):
        monkeypatch.setattr(_common, "_DEPENDENT_LAUNCH", {})
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        assert _common.dependent_launch(cuda) is expected
    monkeypatch.setenv("HF_SPARSE_PDL", "0")
    assert not _common.dependent_launch(cuda)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("HF_SPARSE_PDL")
    assert not _common.dependent_launch(cuda)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("method", ["plas", "xattn"])
def test_dependent_launch_decodes_what_stream_order_does(method, monkeypatch):
    """CUDA-graph decode with programmatic dependent launch (the default on compute capability 9+) gives the tokens
    and scores of the same steps launched in plain stream order (HF_SPARSE_PDL=0): the same kernels, each launched
    while the one before runs, waiting for it before touching memory."""
    config = tiny_config(q_heads=8, kv_heads=2, head_dim=64, layers=3)
    model = build(config, "plas").to("cuda", torch.bfloat16)
    ids = torch.randint(0, 128, (2, 300), generator=torch.Generator().manual_seed(5)).cuda()
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    runs = {}
    for pdl in ("1", "0"):
        monkeypatch.setenv("HF_SPARSE_PDL", pdl)
        hf_sparse.graphs.release(model)  # fresh captures with this launch mode
        hf_sparse.configure(model, graph_config(method))
        runs[pdl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                                   pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        stats = hf_sparse.graphs.stats(model)
        assert stats is not None and stats.disabled_reason is None and stats.replays > 0
    assert torch.equal(runs["1"].sequences, runs["0"].sequences)
    assert all(torch.equal(a, b) for a, b in zip(runs["1"].scores, runs["0"].scores))
    hf_sparse.graphs.release(model)


def test_layer_runs_per_device_and_segment_buffers():
    """A model spread over devices: its decoder layers group into runs of consecutive layers on one GPU (one
    captured graph each); a segment's input buffers copy tensors nested in tuples and dicts and keep the rest."""
    from hf_sparse.graphs import _copy_into, _to_static, consecutive_runs, device_segments

    cuda = [torch.device("cuda", 0), torch.device("cuda", 1)]
    layers = [(i, cuda[0] if i < 2 or i == 4 else cuda[1], f"layer{i}") for i in (3, 0, 1, 2, 4)]
    assert consecutive_runs(layers) == [(cuda[0], ["layer0", "layer1"]), (cuda[1], ["layer2", "layer3"]),
                                        (cuda[0], ["layer4"])]
    assert consecutive_runs([(0, cuda[0], "a"), (1, cuda[0], "b")]) is None  # one device: one graph
    assert consecutive_runs([(0, torch.device("cpu"), "a"), (1, cuda[1], "b")]) is None
    assert device_segments(build(tiny_config(layers=3), "plas")) is None

    marker = object()
    value = (torch.arange(3.0), ((torch.ones(2), torch.zeros(2)), None),
             {"cache": marker, "positions": torch.arange(2)})
    buffers = _to_static(value, torch.device("cpu"))
    assert buffers[0] is not value[0] and torch.equal(buffers[0], value[0])
    assert buffers[2]["cache"] is marker and buffers[1][1] is None
    _copy_into(buffers, (value[0] + 1, ((value[1][0][0] * 5, value[1][0][1] - 1), None),
                         {"cache": marker, "positions": value[2]["positions"] + 7}))
    assert torch.equal(buffers[0], torch.arange(1.0, 4.0)) and torch.equal(buffers[1][0][0], torch.full((2,), 5.0))
    assert torch.equal(buffers[1][0][1], -torch.ones(2)) and torch.equal(buffers[2]["positions"], torch.tensor([7, 8]))
