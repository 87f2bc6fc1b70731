""""plas" on random-init models: equal to sdpa at full density, padding, beam search, assisted decoding, cache."""
import os

import pytest
import torch

import hf_sparse
from hf_sparse import log
from hf_sparse.cache import SparseCache
from hf_sparse.kernels import reference as ref
from hf_sparse.methods import METHODS

from conftest import build, counting, full_density, tiny_config, unpadded_padded_unpadded

GQA = {1: (4, 4), 3: (6, 2), 4: (8, 2)}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_full_density_equals_sdpa(arch, group):
    q_heads, kv_heads = GQA[group]
    config = tiny_config(arch, q_heads, kv_heads)
    sparse, dense = build(config, "plas"), build(config, "sdpa")
    hf_sparse.configure(sparse, full_density(block_size=16))
    ids = torch.randint(0, 128, (2, 90))  # not a multiple of the block size
    with torch.no_grad(), hf_sparse.record_sparsity() as rec:
        torch.testing.assert_close(sparse(ids).logits, dense(ids).logits, atol=2e-5, rtol=1e-4)
        out_sparse = sparse.generate(ids, max_new_tokens=12, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True)
        out_dense = dense.generate(ids, max_new_tokens=12, do_sample=False, output_logits=True,
                                   return_dict_in_generate=True)
    assert isinstance(out_sparse.past_key_values, SparseCache)
    assert torch.equal(out_sparse.sequences, out_dense.sequences)
    for a, b in zip(out_sparse.logits, out_dense.logits):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    assert {r.phase for r in rec.records} == {"prefill", "decode"}
    assert not rec.dense_layers(), "every layer ran the sparse path"
    assert rec.density() == pytest.approx(1.0)


def test_left_padded_batch_equals_each_prompt_alone():
    config = tiny_config("llama", 6, 2)
    model = build(config, "plas")
    hf_sparse.configure(model, hf_sparse.PLASConfig(block_size=16, prefill_top_k=(1, 1), decode_top_k=(3, 4),
                                                    dense_below=0, dense_layers=(), query_union=8))
    torch.manual_seed(5)
    long_ids, short_ids = torch.randint(3, 128, (1, 300)), torch.randint(3, 128, (1, 219))
    batch = torch.zeros(2, 300, dtype=torch.long)
    mask = torch.zeros(2, 300, dtype=torch.long)
    batch[0], mask[0] = long_ids[0], 1
    batch[1, 81:], mask[1, 81:] = short_ids[0], 1
    with torch.no_grad(), hf_sparse.record_sparsity() as rec:
        together = model.generate(batch, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
        alone_long = model.generate(long_ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
        alone_short = model.generate(short_ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert rec.density("prefill") < 0.8 and rec.density("decode") < 0.8, "selection really was sparse"
    assert torch.equal(together[0, 300:], alone_long[0, 300:])
    assert torch.equal(together[1, 300:], alone_short[0, 219:])


def test_right_padding_runs_dense_equal_to_sdpa(caplog):
    """Rule `padding`: a right-padded mask (sdpa takes it) runs dense, equal to sdpa, with one warning."""
    sparse, dense = build(tiny_config(), "plas"), build(tiny_config(), "sdpa")
    hf_sparse.configure(sparse, full_density())
    ids = torch.randint(3, 128, (2, 40))
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0
    log.WARNED.discard("padding")
    with torch.no_grad(), hf_sparse.record_sparsity() as rec:
        logits = sparse(ids, attention_mask=mask).logits
        sparse(ids, attention_mask=mask)
    assert torch.equal(logits, dense(ids, attention_mask=mask).logits)
    assert set(rec.dense_layers().values()) == {"not left padding"}
    assert sum("right padding" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense-fallback"])
def test_padding_layout_is_read_once_per_forward(monkeypatch, dense):
    """Every layer gets the same mask: its host read (a sync on CUDA) happens once per forward, and the
    outputs stay those of sdpa for the padded batch. A forward that runs dense reads whether the mask holds padding
    (one value), a sparse one its layout."""
    from hf_sparse import padding

    reads = []
    read_layout, read_unpadded = padding.read_layout, padding.read_unpadded
    monkeypatch.setattr(padding, "read_layout", lambda *args: reads.append("layout") or read_layout(*args))
    monkeypatch.setattr(padding, "read_unpadded", lambda *args: reads.append("unpadded") or read_unpadded(*args))
    config = tiny_config("llama", 6, 2)
    model, reference_model = build(config, "plas"), build(config, "sdpa")
    hf_sparse.configure(model, hf_sparse.PLASConfig(block_size=16, prefill_top_k=(10_000, 10_000),
                                                    dense_below=10**6 if dense else 0, dense_layers=()))
    ids = torch.randint(3, 128, (2, 70))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    with torch.no_grad():
        for attention_mask in (mask, torch.ones_like(ids)):
            reads.clear()
            torch.testing.assert_close(model(ids, attention_mask=attention_mask).logits,
                                       reference_model(ids, attention_mask=attention_mask).logits,
                                       atol=2e-5, rtol=1e-4)
            assert reads == ["unpadded" if dense else "layout"], f"host reads of the mask: {reads}"


def test_a_mask_without_padding_has_its_layout_from_one_value(monkeypatch):
    """holds_no_padding reads one value of a mask (memoised like mask_layout): a mask without padding then has its
    layout (every row from slot 0) with no other read; a padded one's layout is read when asked for, once."""
    from hf_sparse import padding

    reads = []
    read_layout, read_unpadded = padding.read_layout, padding.read_unpadded
    monkeypatch.setattr(padding, "read_layout", lambda *args: reads.append("layout") or read_layout(*args))
    monkeypatch.setattr(padding, "read_unpadded", lambda *args: reads.append("unpadded") or read_unpadded(*args))
    cpu = torch.device("cpu")
    mask = torch.ones(2, 10, dtype=torch.long)
    assert padding.holds_no_padding(mask, 10, cpu) and reads == ["unpadded"]
    rows, left_padded = padding.mask_layout(mask, 10, cpu)
    assert reads == ["unpadded"] and left_padded and (rows.low, rows.high) == (0, 0) and rows.starts.tolist() == [0, 0]
    padded = mask.clone()
    padded[1, :3] = 0
    assert not padding.holds_no_padding(padded, 10, cpu) and reads == ["unpadded"] * 2
    rows, left_padded = padding.mask_layout(padded, 10, cpu)
    assert reads[-1] == "layout" and left_padded and (rows.low, rows.high) == (0, 3) and rows.starts.tolist() == [0, 3]
    assert not padding.holds_no_padding(padded, 10, cpu) and padding.mask_layout(padded, 10, cpu)[0] is rows
    assert len(reads) == 3
    assert padding.holds_no_padding(padded, 7, cpu)  # its last 7 slots
    padded[0, 0] = 0  # written in place: read again
    assert not padding.holds_no_padding(padded, 10, cpu) and reads[-1] == "unpadded" and len(reads) == 5


def test_beam_search_with_sparse_cache():
    config = tiny_config("llama", 8, 2)
    sparse, dense = build(config, "plas"), build(config, "sdpa")
    hf_sparse.configure(sparse, full_density())
    ids = torch.randint(3, 128, (2, 50))
    with torch.no_grad():
        a = sparse.generate(ids, max_new_tokens=8, num_beams=2, do_sample=False, return_dict_in_generate=True)
        b = dense.generate(ids, max_new_tokens=8, num_beams=2, do_sample=False)
    assert isinstance(a.past_key_values, SparseCache)
    assert torch.equal(a.sequences, b)


def test_assisted_decoding_crops_the_sparse_cache():
    config = tiny_config("llama", 8, 2)
    target = build(config, "plas", seed=0)
    hf_sparse.configure(target, full_density())
    assistant = build(tiny_config("llama", 4, 2, layers=1), "sdpa", seed=1)
    dense = build(config, "sdpa", seed=0)
    ids = torch.randint(3, 128, (1, 60))
    crops = []
    original = hf_sparse.cache.SparseCacheLayer.crop

    def counting_crop(self, tokens):
        crops.append(tokens)
        return original(self, tokens)

    hf_sparse.cache.SparseCacheLayer.crop = counting_crop
    try:
        with torch.no_grad():
            assisted = target.generate(ids, assistant_model=assistant, max_new_tokens=16, do_sample=False)
            plain = dense.generate(ids, max_new_tokens=16, do_sample=False)
    finally:
        hf_sparse.cache.SparseCacheLayer.crop = original
    assert crops, "assisted decoding rolled the cache back"
    assert torch.equal(assisted, plain)


def test_cache_summaries_match_recomputation_after_many_steps():
    config = tiny_config("llama", 4, 2)
    model = build(config, "plas")
    hf_sparse.configure(model, hf_sparse.PLASConfig(block_size=16, prefill_top_k=(2, 3), decode_top_k=(2, 3),
                                                    dense_below=0, dense_layers=()))
    ids = torch.randint(3, 128, (2, 37))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=45, do_sample=False,
                             return_dict_in_generate=True, pad_token_id=0)
    cache = out.past_key_values
    for layer in cache.layers:
        assert layer.length == 37 + 44  # the last generated token is not fed back
        assert layer.summarized_blocks == (layer.length - 9) // 16  # blocks full in every row
        kv_start = torch.tensor([0, 9])
        keys = layer.key_storage[:, :, : layer.length]
        recomputed = ref.block_summaries(keys, None, kv_start, 16)
        cached = layer.block_summaries(None, kv_start)
        torch.testing.assert_close(cached, recomputed, atol=1e-6, rtol=1e-6)


def test_a_prefill_keeps_no_summaries_and_the_first_decode_step_makes_them():
    """A sparse prefill summarises its keys for its own call: the cache holds no summary storage until the first
    decode step (nothing of it in the prefill's peak memory), which summarises every full block; the outputs are
    those of summaries kept from the prefill (the same values)."""
    from hf_sparse.cache import CACHE_KWARG, SparseCache

    model = build(tiny_config("llama", 4, 2), "plas")
    hf_sparse.configure(model, hf_sparse.PLASConfig(block_size=16, prefill_top_k=(2, 3), decode_top_k=(2, 3),
                                                    dense_below=0, dense_layers=(), query_union=16))
    ids = torch.randint(3, 128, (2, 150), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    step = torch.randint(3, 128, (2, 1), generator=torch.Generator().manual_seed(5))
    cache = SparseCache(model.config, block_size=16)
    with torch.no_grad(), hf_sparse.record_sparsity() as recorder:
        model(input_ids=ids, attention_mask=mask, **{CACHE_KWARG: cache})
        assert recorder.density("prefill") < 1.0  # the prefill ran sparse (it summarised)
        assert all(layer.summary_storage is None for layer in cache.layers)
        logits = model(input_ids=step, attention_mask=torch.cat([mask, torch.ones_like(step)], 1),
                       **{CACHE_KWARG: cache}).logits
    for layer in cache.layers:
        assert layer.summary_storage is not None and layer.summarized_blocks == (151 - 5) // 16
        torch.testing.assert_close(layer.summary_storage[:, :, : layer.summarized_blocks],
                                   ref.block_summaries(layer.key_storage[:, :, :151], None, torch.tensor([0, 5]),
                                                       16)[:, :, : layer.summarized_blocks], atol=1e-6, rtol=1e-6)
    # the same step over a cache whose prefill kept its summaries (allocated before the prefill)
    kept = SparseCache(model.config, block_size=16)
    with torch.no_grad():
        model(input_ids=ids[:, :1], attention_mask=mask[:, :1], **{CACHE_KWARG: kept})
        kept.crop(-1)  # empty, storage kept
        for layer in kept.layers:
            layer._summary_buffer()
        model(input_ids=ids, attention_mask=mask, **{CACHE_KWARG: kept})
        expected = model(input_ids=step, attention_mask=torch.cat([mask, torch.ones_like(step)], 1),
                         **{CACHE_KWARG: kept}).logits
    torch.testing.assert_close(logits, expected, atol=1e-6, rtol=1e-6)


def test_cache_grows_by_chunks_and_supports_batch_ops():
    layer = hf_sparse.cache.SparseCacheLayer(block_size=16, chunk_blocks=2)
    k = torch.randn(2, 2, 5, 8)
    keys, values = layer.update(k, k + 1)
    assert layer.capacity == 32 and keys.shape == (2, 2, 5, 8)
    storage = layer.key_storage
    for _ in range(20):
        layer.update(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8))
    assert layer.key_storage is storage, "no reallocation while within capacity"
    layer.update(torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8))
    assert layer.capacity == 64 and layer.get_seq_length() == 35
    assert torch.equal(layer.keys[:, :, :5], k)
    layer.crop(-3)
    assert layer.get_seq_length() == 32 and layer.keys.shape[2] == 32
    layer.crop(30)
    assert layer.get_seq_length() == 30
    layer.batch_select_indices(torch.tensor([1]))
    assert layer.keys.shape[0] == 1
    layer.batch_repeat_interleave(3)
    assert layer.keys.shape[0] == 3
    layer.reorder_cache(torch.tensor([2, 0, 1]))
    layer.reset()
    assert layer.get_seq_length() == 0
    cache = SparseCache(tiny_config(layers=3), block_size=32)
    assert len(cache.layers) == 3 and cache.get_seq_length() == 0
    assert cache.get_mask_sizes(7, 0) == (7, 0)


def test_user_passed_cache_wins_and_dynamic_cache_stays_correct():
    from transformers import DynamicCache

    config = tiny_config("llama", 4, 2)
    sparse, dense = build(config, "plas"), build(config, "sdpa")
    hf_sparse.configure(sparse, full_density())
    ids = torch.randint(3, 128, (1, 40))
    cache = DynamicCache(config=sparse.config)
    with torch.no_grad():
        out = sparse.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=False,
                              return_dict_in_generate=True)
        ref_out = dense.generate(ids, max_new_tokens=6, do_sample=False)
    assert out.past_key_values is cache
    assert torch.equal(out.sequences, ref_out)


def test_generate_makes_no_dynamic_cache_it_would_replace(monkeypatch):
    """generate() of our implementations skips transformers' cache preparation where it would make a new, empty
    DynamicCache only for the hook to replace it (each cache layer an object: host time of a short prompt), and
    keeps calling it where transformers' preparation decides (a user's cache, use_cache=False, a quantized
    cache, sdpa)."""
    from transformers import DynamicCache

    from hf_sparse import integration

    prepared = []
    original = integration._ORIGINAL["prepare_cache"]
    monkeypatch.setitem(integration._ORIGINAL, "prepare_cache",
                        lambda *a, **k: prepared.append(1) or original(*a, **k))
    config = tiny_config("llama", 4, 2)
    sparse, dense = build(config, "plas"), build(config, "sdpa")
    hf_sparse.configure(sparse, full_density())
    ids = torch.randint(3, 128, (1, 40))
    with torch.no_grad():
        out = sparse.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
        assert prepared == [] and isinstance(out.past_key_values, hf_sparse.SparseCache)
        assert torch.equal(out.sequences, dense.generate(ids, max_new_tokens=4, do_sample=False))
        assert prepared == [1]  # sdpa: transformers' own
        sparse.generate(ids, max_new_tokens=2, do_sample=False, past_key_values=DynamicCache(config=sparse.config))
        sparse.generate(ids, max_new_tokens=2, do_sample=False, use_cache=False)
        assert prepared == [1, 1, 1]
        with pytest.raises((ValueError, ImportError), match="quanto"):  # transformers' own answer
            sparse.generate(ids, max_new_tokens=2, do_sample=False, cache_implementation="quantized")
        assert prepared == [1, 1, 1, 1]


def test_a_reset_static_layer_takes_a_layout_again_in_one_step():
    """Every layer of a reset static cache taking the layout it took last keeps its copy (same object, same
    version: graphs over it stay valid); another layout is copied in or kept anew."""
    from hf_sparse.selection import RowLayout

    layer = SparseCache(tiny_config(layers=1), block_size=16, max_cache_len=64).layers[0]
    uniform, padded = RowLayout.uniform(2, "cpu"), RowLayout(torch.tensor([5, 0]), 0, 5)
    layer.set_padding(uniform)
    kept, version = layer.row_layout, layer.version
    layer.reset()
    layer.set_padding(uniform)
    assert layer.row_layout is kept and layer.version == version
    for layout, starts in ((padded, [5, 0]), (RowLayout(torch.tensor([0, 3]), 0, 5), [0, 3]), (uniform, [0, 0]),
                           (uniform, [0, 0]), (padded, [5, 0])):
        layer.reset()
        layer.set_padding(layout)
        assert layer.row_layout.starts.tolist() == starts
    assert uniform.starts.tolist() == [0, 0] and padded.starts.tolist() == [5, 0]


def test_density_floor_memo_equals_the_estimate():
    from hf_sparse import density
    from hf_sparse.methods import METHODS

    for method, config in (("plas", hf_sparse.PLASConfig()), ("xattn", hf_sparse.XAttnConfig()),
                           ("plas", hf_sparse.PLASConfig(dense_above_density=0.5))):
        for length in (4096, 8192, 65536, 131072):
            for _ in range(2):
                assert density.known_floor_and_threshold(METHODS[method], config, length, length, 64) == \
                    density.floor_and_threshold(METHODS[method](config), config.dense_above_density, length, length,
                                                64)


def test_bad_inputs_get_clear_errors(caplog):
    """Rule `inputs`: a dtype no kernel takes is refused by name; output_attentions=True gives no weights (None,
    as sdpa's) and the logits of the call without it, with one warning."""
    model = build(tiny_config(), "plas")
    hf_sparse.configure(model, full_density())
    ids = torch.randint(3, 128, (1, 40))
    log.WARNED.discard("output_attentions")
    with torch.no_grad():
        out = model(ids, output_attentions=True)
        model(ids, output_attentions=True)
        assert torch.equal(out.logits, model(ids).logits)
    assert out.attentions is None or all(a is None for a in out.attentions)
    assert sum("output_attentions" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(TypeError, match="float32/float16/bfloat16"):
        model.to(torch.float64)(ids)


def test_dense_layers_are_reported_and_logged(caplog):
    model = build(tiny_config(layers=3), "plas")
    hf_sparse.configure(model, hf_sparse.PLASConfig(block_size=16, prefill_top_k=(1, 1), dense_below=(0, 10_000),
                                                    dense_layers=(0,), query_union=8))
    ids = torch.randint(3, 128, (1, 200))
    with caplog.at_level("DEBUG", logger="hf_sparse"), torch.no_grad(), hf_sparse.record_sparsity() as rec:
        model.generate(ids, max_new_tokens=2, do_sample=False)
    assert rec.dense_layers("prefill") == {0: "dense_layers"}
    assert set(rec.dense_layers("decode")) == {0, 1, 2}
    assert all("dense_below" in reason for layer, reason in rec.dense_layers("decode").items() if layer)
    assert "layer 0 prefill: dense (dense_layers)" in caplog.text
    assert rec.density("prefill") < 1.0


def fallback_configs(method: str):
    """(a config that selects every block, one that selects few) of ``method``, every layer sparse."""
    import dataclasses

    if method == "plas":
        dense_config = full_density(block_size=16)
        return dense_config, dataclasses.replace(dense_config, prefill_top_k=(1, 1), decode_top_k=(1, 1),
                                                 query_union=16)
    dense_config = hf_sparse.XAttnConfig(dense_last=0, block_size=16, stride=4, threshold=1.0, dense_below=0, dense_layers=())
    return dense_config, dataclasses.replace(dense_config, threshold=0.3, decode_threshold=0.3)


@pytest.mark.parametrize("method", ["plas", "xattn"])
def test_dense_selection_falls_back_to_sdpa_where_measured(method, monkeypatch):
    """Where the density fallback applies (CUDA with the Triton kernels; forced here), a prefill whose selection
    keeps at least ``dense_above_density`` of the causal blocks runs exactly what sdpa runs; a sparse one, or the
    fallback switched off, stays sparse. Decode never falls back."""
    import dataclasses

    import hf_sparse.attention as attention

    monkeypatch.setattr(hf_sparse.density, "falls_back_by_density", lambda query: True)
    # the measured density decides here, not the selection's cost estimate (test_density_floor_and_memory)
    monkeypatch.setattr(attention.METHODS[method], "density_floor", lambda self, num_queries, key_length: 0.0)
    monkeypatch.setattr(attention.METHODS[method], "selection_share", lambda self, num_queries, head_dim: 0.0)
    config = tiny_config("llama", 4, 2)
    sparse, dense = build(config, method), build(config, "sdpa")
    dense_config, sparse_config = fallback_configs(method)
    ids = torch.randint(0, 128, (1, 600), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = dense(ids).logits
        hf_sparse.configure(sparse, dense_config)
        with hf_sparse.record_sparsity() as rec:
            out = sparse(ids).logits
            generated = sparse.generate(ids, max_new_tokens=3, do_sample=False)
        assert torch.equal(out, expected)
        reasons = rec.dense_layers("prefill")
        assert set(reasons) == {0, 1} and all(r.startswith("density 1.000 >= dense_above_density 0.75")
                                              for r in reasons.values())  # generate()'s prefill: remembered
        assert not rec.dense_layers("decode") and generated.shape[1] == ids.shape[1] + 3
        for config_ in (dataclasses.replace(dense_config, dense_above_density=None), sparse_config):
            hf_sparse.configure(sparse, config_)
            with hf_sparse.record_sparsity() as rec:
                sparse(ids)
            assert not rec.dense_layers(), config_
    with pytest.raises(ValueError, match="dense_above_density"):
        dataclasses.replace(dense_config, dense_above_density=1.5)


def test_probe_threshold_counts_the_selection_still_to_run():
    """The probe's dense threshold: dense_above_density less the selection's share of dense time (measured
    shares: PLAS's falls with queries x head dim, XAttention's scoring is quadratic like attention)."""
    from hf_sparse import density
    from hf_sparse.methods import METHODS

    assert density.probe_threshold(0.75, 0.0) == 0.75
    assert density.probe_threshold(0.75, 0.2) == pytest.approx(0.6)
    assert density.probe_threshold(0.75, 1.5) == 0.0
    plas = METHODS["plas"](hf_sparse.PLASConfig())
    assert plas.selection_share(32768, 64) == pytest.approx(4 * plas.selection_share(131072, 64))
    assert plas.selection_share(32768, 64) == pytest.approx(2 * plas.selection_share(32768, 128))
    assert 0.05 < plas.selection_share(131072, 128) < 0.1 < plas.selection_share(32768, 64) < 0.5
    xattn = METHODS["xattn"](hf_sparse.XAttnConfig())
    assert xattn.selection_share(32768, 64) > 1.0 > 0.3 < xattn.selection_share(131072, 64) < 0.4
    assert 0.05 < xattn.selection_share(131072, 128) < xattn.selection_share(32768, 128) < 0.5
    narrow = METHODS["xattn"](hf_sparse.XAttnConfig(stride=8))  # twice the strided products of the default 16
    assert narrow.selection_share(131072, 64) == pytest.approx(xattn.selection_share(131072, 64) + xattn.SHARE_SCORES / 128)


def test_density_probe_runs_are_tiles_of_the_full_selection():
    """The probe's runs are spread over the prefill (the last at its end), aligned to whole tiles, and each run's
    selection, its keys cut at its end, equals the full selection's rows for those tiles (a row without padding;
    a padded row's tiles start at its first slot): the probe density is attended / causal blocks summed over the
    runs (PLAS reference, a left-padded batch)."""
    from hf_sparse.density import probe_density, probe_runs, row_block_counts
    from hf_sparse.padding import padding_layout

    assert probe_runs(4096, 1024, 128) == [(start, 128) for start in range(384, 4096, 512)]
    assert probe_runs(1000, 64, 16) == [(start, 8) for start in (104, 232, 360, 488, 616, 728, 856, 992)]
    config = hf_sparse.PLASConfig(block_size=16, query_union=16, prefill_top_k=(2, 3))
    policy = METHODS["plas"](config)
    gen = torch.Generator().manual_seed(7)
    query, key = torch.randn(2, 4, 512, 16, generator=gen), torch.randn(2, 2, 512, 16, generator=gen)
    mask = torch.ones(2, 512, dtype=torch.long)
    mask[1, :40] = 0
    rows = padding_layout(mask, 2, 512, query.device, validate=True)
    summaries = hf_sparse.kernels.block_summaries(key, None, rows, 16)
    kwargs = dict(scale=0.25, kv_start=rows)
    full = policy.select_prefill(query, summaries, key, q_offset=0, **kwargs)
    seen = []

    def select(run_query, run_key, run_scale, offset):
        run = policy.select_prefill(run_query, summaries, run_key, q_offset=offset, probe=True, **kwargs)
        tiles = slice(offset // 16, (offset + run_query.shape[2]) // 16)
        assert torch.equal(run.counts[0], full.counts[0, :, tiles])  # (the padded row's tiles start at its slot 40)
        seen.append((offset, run_query.shape[2], run_key.shape[2]))
        return run

    density = probe_density(select, query, key, None, 0, rows, 128, 16)
    assert seen == [(end - 16, 16, end) for end in range(64, 513, 64)]
    runs = [policy.select_prefill(query[:, :, first:first + size], summaries, key[:, :, :end], q_offset=first,
                                  probe=True, **kwargs) for first, size, end in seen]
    attended = sum(run.counts.sum((1, 2)) for run in runs)
    causal = sum(row_block_counts(run, size, first, rows)[1] for run, (first, size, _) in zip(runs, seen))
    assert density.shape == (2,)  # one density per row
    assert torch.allclose(density, attended.double() / causal.double()) and (0 < density).all() and (density < 1).all()


@pytest.mark.parametrize("method", ["plas", "xattn"])
def test_density_probe_decides_long_prefills(method, monkeypatch):
    """A long prefill first selects for PROBE_QUERIES of its queries (in PROBE_RUNS runs): a dense probe runs sdpa (exactly) without
    selecting for the rest; a sparse one goes on to the full selection, with the output the call has without a
    probe. Runs the Triton selection kernels under TRITON_INTERPRET=1 (and on CUDA)."""
    import hf_sparse.attention as attention

    monkeypatch.setattr(hf_sparse.density, "falls_back_by_density", lambda query: True)
    monkeypatch.setattr(attention.METHODS[method], "density_floor", lambda self, num_queries, key_length: 0.0)
    monkeypatch.setattr(attention.METHODS[method], "selection_share", lambda self, num_queries, head_dim: 0.0)
    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    config = tiny_config("llama", 4, 2)
    sparse, dense = build(config, method).to(device), build(config, "sdpa").to(device)
    dense_config, sparse_config = fallback_configs(method)
    length = 320  # >= 4 x the probe's 64 queries: probed; < 4 x 1024: not
    ids = torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(3)).to(device)
    calls = []
    policy = attention.METHODS[method]
    original = policy.select_prefill
    monkeypatch.setattr(policy, "select_prefill", lambda self, query, *a, **k: calls.append(query.shape[2])
                        or original(self, query, *a, **k))
    with torch.no_grad():
        monkeypatch.setattr(hf_sparse.density, "PROBE_QUERIES", 64)
        hf_sparse.configure(sparse, dense_config)
        with hf_sparse.record_sparsity() as rec:
            out = sparse(ids).logits
        assert torch.equal(out, dense(ids).logits)
        assert calls == [8] * 16  # one probe of eight runs per layer, no full selection
        assert all(r.startswith("probe density 1.000 (64 queries in 8 runs) >= ") and "dense_above_density 0.75" in r
                   for r in rec.dense_layers("prefill").values()) and len(rec.dense_layers("prefill")) == 2
        hf_sparse.configure(sparse, sparse_config)
        # a selection costing dense attention's time: dense at any density, decided before selecting anything
        monkeypatch.setattr(policy, "selection_share", lambda self, num_queries, head_dim: 1.0)
        calls.clear()
        with hf_sparse.record_sparsity() as rec:
            assert torch.equal(sparse(ids).logits, dense(ids).logits)
        assert calls == [] and all(r.startswith("the sparsest selection keeps 0.000 >= 0.000")
                                   for r in rec.dense_layers("prefill").values())
        # a sparse probe: on to the full selection, whose density is checked and remembered
        monkeypatch.setattr(policy, "selection_share", lambda self, num_queries, head_dim: 0.0)
        calls.clear()
        with hf_sparse.record_sparsity() as rec:
            probed = sparse(ids).logits
        assert calls == ([8] * 8 + [length]) * 2 and not rec.dense_layers()
        monkeypatch.setattr(hf_sparse.density, "PROBE_QUERIES", 1024)
        calls.clear()
        unprobed = sparse(ids).logits
        assert calls == [length, length]
        assert torch.equal(probed, unprobed)
        # the decisions are remembered: no probe now either (a remembered sparse layer reads no density back)
        monkeypatch.setattr(hf_sparse.density, "PROBE_QUERIES", 64)
        calls.clear()
        assert torch.equal(sparse(ids).logits, probed) and calls == [length, length]
        # forgotten: the first layer probes again (stopped at its first selection: the kernels ran above)
        hf_sparse.density.forget_decisions(sparse)
        calls.clear()

        class Probed(Exception):
            pass

        def select_and_stop(self, query, *args, **kwargs):
            calls.append(query.shape[2])
            raise Probed

        monkeypatch.setattr(policy, "select_prefill", select_and_stop)
        with pytest.raises(Probed):
            sparse(ids)
        assert calls == [8]


@pytest.mark.parametrize("method", ["plas", "xattn", "star"])
def test_first_layer_decides_a_dense_forward(method, monkeypatch):
    """A prompt below dense_below is decided dense by its first layer (PLAS / XAttention: one plan per forward;
    Star: one pass through its own dense path); the later layers reuse the decision (rule `forward`): sdpa straight
    where the mask holds no padding, else dense_attention. Logits equal sdpa's either way; the next forward (a new
    mask) decides again; decode steps and recording are decided per layer."""
    import hf_sparse.attention as attention
    import hf_sparse.star_attention as star_attention
    from hf_sparse.cache import CACHE_KWARG

    config = tiny_config("llama", 4, 2, layers=4)
    sparse, dense = build(config, method), build(config, "sdpa")
    if method == "star":  # Star's own dense path (its dense_attention is its module's name, not counted below)
        hf_sparse.configure(sparse, hf_sparse.StarConfig(block_size=64, query_tokens=4))
        decisions = counting(monkeypatch, star_attention, "_global_attention")
        first_dense, recorded, phase = 0, 4, "context"
    else:
        decisions = counting(monkeypatch, hf_sparse.plan, "plan_call")
        first_dense, recorded, phase = 1, 4, "prefill"  # recording plans every layer
    dense_calls = counting(monkeypatch, attention, "dense_attention")
    ids, masks = unpadded_padded_unpadded()
    with torch.no_grad():
        for mask, padded in zip(masks, (False, True, False)):
            decisions.clear(), dense_calls.clear()
            assert torch.equal(sparse(ids, attention_mask=mask).logits, dense(ids, attention_mask=mask).logits)
            assert len(decisions) == 1 and len(dense_calls) == first_dense + (3 if padded else 0)
        # Without a mask the forward's position_ids tell the forwards apart: the model's own (new each forward),
        # or the caller's, reused while the configuration stays (configure() stores a new one: decided again).
        positions = torch.arange(ids.shape[1])[None]
        for kwargs, expected in (({}, 1), ({}, 1), ({"position_ids": positions}, 1), ({"position_ids": positions}, 0)):
            decisions.clear(), dense_calls.clear()
            assert torch.equal(sparse(ids, **kwargs).logits, dense(ids).logits)
            assert len(decisions) == expected and len(dense_calls) == first_dense * expected
        hf_sparse.configure(sparse, hf_sparse.config.method_config(sparse.config, method))
        decisions.clear()
        sparse(ids, position_ids=positions)
        assert len(decisions) == 1
        out = sparse(ids, attention_mask=masks[0], use_cache=True)
        decisions.clear()
        step = sparse(ids[:, -1:], attention_mask=torch.ones(2, 41, dtype=ids.dtype),
                      **{CACHE_KWARG: out.past_key_values})
        assert len(decisions) == 4 and torch.isfinite(step.logits).all()  # decode: no forward-wide decision
        decisions.clear()
        with hf_sparse.record_sparsity() as rec:
            sparse(ids, attention_mask=masks[0])
        assert len(decisions) == recorded and len(rec.dense_layers(phase)) == 4


def test_density_floor_matches_the_sparsest_selection():
    """PLAS's density floor is the density of a selection where every query of a tile keeps the same top_k[0]
    blocks (within the causal ones): counted here by brute force over the tiles."""
    from hf_sparse.methods.plas import top_k_density_floor

    for num_queries, key_length, tile, block, k in [(300, 300, 32, 16, 3), (4096, 4096, 128, 128, 50),
                                                    (100, 700, 16, 16, 5), (16384, 16384, 128, 128, 50)]:
        q_offset = key_length - num_queries
        attended = causal = 0
        for query in range(num_queries):
            if query % tile == tile - 1 or query == num_queries - 1:
                blocks = (q_offset + query) // block + 1
                attended, causal = attended + min(blocks, k), causal + blocks
        assert top_k_density_floor(num_queries, key_length, tile, block, k) == pytest.approx(attended / causal)
    assert top_k_density_floor(4096, 4096, 128, 128, 50) == 1.0  # 32 blocks: every tile keeps all


@pytest.mark.parametrize("method", ["plas", "xattn"])
def test_density_floor_and_memory(method, monkeypatch):
    """A prefill whose sparsest possible selection already reaches the dense threshold runs sdpa (exactly)
    without selecting; a measured decision is remembered per layer and length bucket (density_memory), not with
    density_memory=False."""
    import dataclasses

    import hf_sparse.attention as attention

    monkeypatch.setattr(hf_sparse.density, "falls_back_by_density", lambda query: True)
    config = tiny_config("llama", 4, 2)
    sparse, dense = build(config, method), build(config, "sdpa")
    _, sparse_config = fallback_configs(method)
    policy = attention.METHODS[method]
    calls = []
    original = policy.select_prefill
    monkeypatch.setattr(policy, "select_prefill", lambda self, query, *a, **k: calls.append(query.shape[2])
                        or original(self, query, *a, **k))
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(policy, "selection_share", lambda self, num_queries, head_dim: 0.0)
    with torch.no_grad():
        monkeypatch.setattr(policy, "density_floor", lambda self, num_queries, key_length: 0.9)
        hf_sparse.configure(sparse, sparse_config)
        with hf_sparse.record_sparsity() as rec:
            assert torch.equal(sparse(ids).logits, dense(ids).logits)
        assert calls == [] and all(r.startswith("the sparsest selection keeps 0.900 >= ")
                                   for r in rec.dense_layers("prefill").values())
        dense_calls = []
        monkeypatch.setattr(attention, "dense_attention", lambda *a, **k: dense_calls.append(1) or
                            hf_sparse.dense.dense_attention(*a, **k))
        assert torch.equal(sparse(ids).logits, dense(ids).logits)  # unrecorded: the forward-wide decision
        assert calls == [] and len(dense_calls) == 1  # the first layer decides the forward, the second runs sdpa
        monkeypatch.setattr(policy, "density_floor", lambda self, num_queries, key_length: 0.0)
        reads = []
        monkeypatch.setattr(hf_sparse.density, "row_densities",
                            lambda *a: reads.append(1) or torch.tensor([0.1], dtype=torch.float64))
        for memory, expected_reads in ((True, 2), (False, 6)):
            hf_sparse.configure(sparse, dataclasses.replace(sparse_config, density_memory=memory))
            reads.clear()
            for length in (200, 190, 210):  # one half-octave bucket
                sparse(ids[:, :length])
            assert len(reads) == expected_reads, memory
        reads.clear()
        sparse(ids[:, :100])  # another bucket: decided anew
        assert len(reads) == 2


@pytest.mark.parametrize("method", ["plas", "xattn"])
def test_generate_trims_the_last_layer_to_the_rows_it_reads(method):
    """A generate() prefill in which a layer ran sparse computes the last layer's attention for the last position
    only (the rows nothing reads are zero), with the same tokens and logits as every row computed; a prefill dense
    throughout (short), hidden states asked for, or a plain forward compute every row."""
    config = tiny_config("llama", layers=3)
    model = build(config, "sdpa")
    base = dict(block_size=16, dense_below=32)
    make = hf_sparse.PLASConfig if method == "plas" else hf_sparse.XAttnConfig
    seen = []
    model.model.layers[-1].self_attn.register_forward_hook(lambda module, args, output: seen.append(output[0]))
    ids = torch.randint(1, 128, (1, 80), generator=torch.Generator().manual_seed(0))

    def prefill_rows(trim, prompt=ids, **kwargs):
        hf_sparse.configure(model, make(**base, trim_last_layer=trim))
        seen.clear()
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False,
                             return_dict_in_generate=True, output_logits=True, pad_token_id=0, **kwargs)
        zero_rows = int((seen[0][0].abs().sum(-1) == 0).sum())
        return out, zero_rows

    hooked = []  # the generate() hooks present at each forward: the prefill's, gone from the decode steps on
    model.model.register_forward_pre_hook(lambda module, args: hooked.append(len(model._forward_pre_hooks)))
    with torch.no_grad():
        full, zero_full = prefill_rows(False)
        hooked.clear()
        trimmed, zero_trimmed = prefill_rows(True)
        assert (zero_full, zero_trimmed) == (0, ids.shape[1] - 1)
        assert hooked == [1, 0, 0] and not model._forward_pre_hooks and not model._forward_hooks
        assert torch.equal(full.sequences, trimmed.sequences)
        for a, b in zip(full.logits, trimmed.logits):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert prefill_rows(True, output_hidden_states=True)[1] == 0
        assert prefill_rows(True, prompt=ids[:, :24])[1] == 0  # below dense_below: every row, as sdpa
        seen.clear()
        model(ids)
        assert int((seen[0][0].abs().sum(-1) == 0).sum()) == 0
        # a left-padded batch: each row's last position is real, and the tokens are those of every row computed
        batch = torch.cat([ids, ids.roll(7, dims=1)])
        mask = torch.ones_like(batch)
        batch[1, :9], mask[1, :9] = 0, 0
        runs = {}
        for trim in (False, True):
            hf_sparse.configure(model, make(**base, trim_last_layer=trim))
            seen.clear()
            runs[trim] = model.generate(batch, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
            # (untrimmed, the padded row's 9 padding queries see no key: zero outputs)
            assert int((seen[0][1].abs().sum(-1) == 0).sum()) == (ids.shape[1] - 1 if trim else 9)
        assert torch.equal(runs[False], runs[True])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["plas", "xattn"])
def test_trimmed_last_layer_on_cuda(method):
    """On the GPU path (Triton kernels, static cache, CUDA-graph decode) the trimmed last layer gives the prefill's
    logits of every row computed, within bf16 rounding (the first token equal where it is no near-tie)."""
    model = build(tiny_config("llama", layers=3), "sdpa").to("cuda", torch.bfloat16)
    make = hf_sparse.PLASConfig if method == "plas" else hf_sparse.XAttnConfig
    ids = torch.randint(1, 128, (2, 700), generator=torch.Generator().manual_seed(1)).cuda()
    outs = {}
    with torch.no_grad():
        for trim in (False, True):
            hf_sparse.configure(model, make(block_size=64, dense_below=128, dense_above_density=None,
                                            trim_last_layer=trim))
            outs[trim] = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                        return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    full, trimmed = outs[False].logits[0].float(), outs[True].logits[0].float()
    torch.testing.assert_close(full, trimmed, rtol=2e-2, atol=2e-2)
    top = full.topk(2).values
    clear = (top[:, 0] - top[:, 1]) > 0.1
    assert torch.equal(full.argmax(-1)[clear], trimmed.argmax(-1)[clear])
