"""XAttention ("xattn"): config, antidiagonal scoring vs a direct computation, threshold selection, chunking,
equality with sdpa at full density, left padding, decode with the SparseCache."""
from __future__ import annotations

import json
import math

import pytest
import torch

import hf_sparse
from hf_sparse.cache import SparseCache
from hf_sparse.config import XAttnConfig, config_from_dict
from hf_sparse.kernels import reference as ref
from hf_sparse.methods import METHODS, XAttnMethod

from conftest import build, tiny_config

IMPL = "xattn"


def xattn_model(model_config, config: XAttnConfig, seed: int = 0):
    model = build(model_config, IMPL, seed=seed)
    model.config.hf_sparse = config.to_dict()
    return model


# -- config -------------------------------------------------------------------------------------------------
def test_config_defaults_and_registry():
    """Threshold 0.99: the lowest within the quality budget at 64K on the long-context model (docs/quality.md)."""
    config = XAttnConfig()
    assert (config.block_size, config.stride, config.pool, config.threshold, config.gqa_reduce) == \
        (128, 16, "mean", 0.99, "any")
    assert config.dense_last == 128
    assert config.keep_sink and config.keep_diagonal and config.dense_layers == (-1,)
    assert config.dense_threshold("prefill") == 8 * 128 and config.dense_threshold("decode") == 2048 * 128
    assert XAttnConfig(dense_below=(10, 20)).dense_threshold("decode") == 20
    assert config.mass_threshold("decode") == 0.99
    assert XAttnConfig(threshold=0.9, decode_threshold=None).mass_threshold("decode") == 0.9
    assert XAttnConfig(threshold=0.9).mass_threshold("decode") == 0.99
    assert XAttnConfig(dense_last=0, decode_threshold=0.99).mass_threshold("decode") == 0.99
    assert config.is_dense_layer(29, 30) and not config.is_dense_layer(0, 30)
    assert METHODS["xattn"] is XAttnMethod


def test_long_threshold_takes_over_past_its_keys():
    """Past 65,536 keys a prefill selects at 0.999 (0.99 is outside the quality budget at 96K and 128K on the
    long-context model); decode keeps decode_threshold; None keeps threshold at every length."""
    config = XAttnConfig()
    assert config.long_threshold == (65536, 0.999)
    assert config.mass_threshold("prefill") == 0.99
    assert config.mass_threshold("prefill", 65536) == 0.99 and config.mass_threshold("prefill", 65537) == 0.999
    assert config.mass_threshold("decode", 131072) == 0.99
    assert XAttnConfig(long_threshold=None).mass_threshold("prefill", 131072) == 0.99
    assert XAttnConfig(long_threshold=[100, 0.5]).long_threshold == (100, 0.5)
    # A configuration stored before the field existed keeps its one threshold; a partial dict gets the default.
    stored = XAttnConfig(threshold=0.9).to_dict()
    del stored["long_threshold"]
    assert XAttnConfig.from_dict(stored).long_threshold is None
    assert XAttnConfig.from_dict({"stride": 8}).long_threshold == (65536, 0.999)


@pytest.mark.parametrize("value", [0.999, (65536,), (65536, 0.0), (65536, 1.5), (0, 0.9), (65536.0, 0.9),
                                   (65536, True)])
def test_long_threshold_invalid_names_the_field(value):
    with pytest.raises(ValueError, match="long_threshold"):
        XAttnConfig(long_threshold=value)


def test_prefill_selection_takes_the_call_length_threshold():
    """A prefill past long_threshold's keys selects as a config with that threshold does, and the density probe's
    sample selects at its call's length (call_length), not its own."""
    torch.manual_seed(3)
    query, key = torch.randn(1, 4, 150, 16), torch.randn(1, 2, 150, 16)
    kwargs = dict(scale=0.25, q_offset=0, kv_start=torch.tensor([0]))
    base = dict(dense_last=0, block_size=16, stride=4)
    long = XAttnMethod(XAttnConfig(threshold=0.3, long_threshold=(100, 0.9), **base))
    high = XAttnMethod(XAttnConfig(threshold=0.9, long_threshold=None, **base))
    low = XAttnMethod(XAttnConfig(threshold=0.3, long_threshold=None, **base))
    mask = long.select_prefill(query, None, key, **kwargs).to_mask(10)
    assert torch.equal(mask, high.select_prefill(query, None, key, **kwargs).to_mask(10))
    assert mask.sum() > low.select_prefill(query, None, key, **kwargs).to_mask(10).sum()
    short = long.select_prefill(query[:, :, :80], None, key[:, :, :80], **kwargs).to_mask(5)
    assert torch.equal(short, low.select_prefill(query[:, :, :80], None, key[:, :, :80], **kwargs).to_mask(5))
    probe = long.select_prefill(query[:, :, :80], None, key[:, :, :80], probe=True, call_length=150, **kwargs)
    assert torch.equal(probe.to_mask(5), high.select_prefill(query[:, :, :80], None, key[:, :, :80], probe=True,
                                                             **kwargs).to_mask(5))
    assert config_from_dict({"method": "xattn", "stride": 4}) == XAttnConfig(stride=4)


@pytest.mark.parametrize("kwargs, field", [
    ({"block_size": 96}, "block_size"),
    ({"stride": 3}, "stride"),
    ({"stride": 256}, "stride"),
    ({"pool": "sum"}, "pool"),
    ({"dense_last": -1}, "dense_last"),
    ({"threshold": 0.0}, "threshold"),
    ({"threshold": 1.5}, "threshold"),
    ({"decode_threshold": 0}, "decode_threshold"),
    ({"chunk_size": 100}, "chunk_size"),
    ({"gqa_reduce": "all"}, "gqa_reduce"),
    ({"vote_ratio": 1.0}, "vote_ratio"),
    ({"keep_sink": 1}, "keep_sink"),
    ({"dense_below": -1}, "dense_below"),
    ({"dense_layers": "last"}, "dense_layers"),
    ({"prefill_chunk": 130}, "prefill_chunk"),
    ({"decode_cuda_graph": "yes"}, "decode_cuda_graph"),
    ({"logn_scaling": 1}, "logn_scaling"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        XAttnConfig(**kwargs)


def test_dict_round_trip_and_unknown_keys():
    config = XAttnConfig(block_size=64, stride=4, pool="max", dense_last=0, threshold=0.8, gqa_reduce="vote", dense_layers=(0, -1),
                         dense_below=(5, 7), prefill_chunk=None)
    data = json.loads(json.dumps(config.to_dict()))
    assert data["method"] == "xattn" and XAttnConfig.from_dict(data) == config
    with pytest.raises(ValueError, match="unknown XAttnConfig field"):
        XAttnConfig.from_dict({"treshold": 0.9})
    with pytest.raises(ValueError, match="not a XAttnConfig configuration"):
        XAttnConfig.from_dict({"method": "plas"})


# -- antidiagonal scoring -----------------------------------------------------------------------------------
def direct_block_scores(query, key, *, scale, q_offset, kv_start, block_size, stride, pool="mean"):
    """The scoring rule written out element by element (slow; tiny inputs only); missing tokens give products
    of zero."""
    batch, q_heads, num_queries, _ = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    num_blocks = math.ceil((length - int(kv_start.min())) / block_size)
    pads = [min(max(int(s) - q_offset, 0), num_queries) for s in kv_start]
    num_tiles = max(1, max(math.ceil((num_queries - p) / block_size) for p in pads))
    out = torch.zeros(batch, q_heads, num_tiles, num_blocks, dtype=torch.float64)
    for b in range(batch):
        start, pad = int(kv_start[b]), pads[b]
        num_key_groups = math.ceil((length - start) / stride)
        for h in range(q_heads):
            q, k = query[b, h].double(), key[b, h // group].double()
            for t in range(num_tiles):
                for g in range(block_size // stride):
                    first = pad + t * block_size + g * stride
                    if first >= num_queries:
                        continue
                    last_slot = q_offset + first + stride - 1 - start
                    logits = []
                    for r in range(num_key_groups):
                        if r * stride > last_slot:
                            break
                        products = []
                        for m in range(stride):
                            qi, slot = first + stride - 1 - m, start + r * stride + m
                            products.append(float(q[qi] @ k[slot]) if qi < num_queries and slot < length else 0.0)
                        pooled = max(products) if pool == "max" else sum(products) / stride
                        logits.append(pooled * scale)
                    probs = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
                    for r, p in enumerate(probs):
                        out[b, h, t, r * stride // block_size] += p
    return out


@pytest.mark.parametrize("q_offset", [0, 21])
@pytest.mark.parametrize("stride", [1, 4])
@pytest.mark.parametrize("pool", ["mean", "max"])
def test_antidiagonal_scores_match_direct_computation(q_offset, stride, pool):
    torch.manual_seed(1)
    length, block_size = 75, 16
    query = torch.randn(2, 4, length - q_offset, 8)
    key = torch.randn(2, 2, length, 8)
    kv_start = torch.tensor([0, 11])
    kwargs = dict(scale=0.4, q_offset=q_offset, kv_start=kv_start, block_size=block_size, stride=stride, pool=pool)
    got = ref.antidiagonal_block_scores(query, key, **kwargs)
    expected = direct_block_scores(query, key, **kwargs)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    # Masses of a tile add up to its number of real query groups.
    assert torch.allclose(got.sum(-1)[0, 0, 0], torch.tensor(block_size / stride))


def test_stride_one_gives_the_exact_attention_mass_per_block():
    torch.manual_seed(2)
    query, key = torch.randn(1, 2, 64, 8), torch.randn(1, 2, 64, 8)
    got = ref.antidiagonal_block_scores(query, key, scale=0.35, q_offset=0, kv_start=torch.tensor([0]),
                                        block_size=16, stride=1)
    causal = torch.ones(64, 64, dtype=torch.bool).tril()
    probs = torch.softmax((query @ key.transpose(-1, -2) * 0.35).masked_fill(~causal, float("-inf")), -1)
    expected = probs.view(1, 2, 4, 16, 4, 16).sum(5).sum(3)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softcap", [1.0, 4.0])
def test_softcap_gives_the_capped_attention_mass_per_block(softcap):
    """With Gemma 2's softcapping the masses are those of the capped attention: stride 1 against the capped causal
    softmax (prefill), the decode block scores against the softmax of the capped summary logits."""
    torch.manual_seed(3)
    query, key = torch.randn(1, 2, 64, 8) * 2, torch.randn(1, 2, 64, 8)
    got = ref.antidiagonal_block_scores(query, key, scale=0.35, q_offset=0, kv_start=torch.tensor([0]),
                                        block_size=16, stride=1, softcap=softcap)
    causal = torch.ones(64, 64, dtype=torch.bool).tril()
    logits = softcap * torch.tanh(query @ key.transpose(-1, -2) * 0.35 / softcap)
    probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)
    torch.testing.assert_close(got, probs.view(1, 2, 4, 16, 4, 16).sum(5).sum(3), atol=1e-5, rtol=1e-5)
    summaries = ref.block_summaries(key, None, torch.tensor([0]), 16)
    available = ref.block_availability(1, 4, 63, torch.tensor([0]), 16, 64)
    got = torch.softmax(ref.block_logits(query[:, :, -1:], summaries, 0.35, available, softcap=softcap), -1)
    expected = torch.softmax(softcap * torch.tanh(query[:, :, -1:] @ summaries.transpose(-1, -2) * 0.35 / softcap), -1)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_softcap_flattens_the_masses_so_the_threshold_keeps_more_blocks():
    """A cap keeps each query's ranking of blocks but flattens their masses, so the mass threshold keeps more
    blocks: in decode (per query head, then united) a superset of those kept without the cap; in prefill, where
    a block's mass sums many query groups' probabilities, more blocks in all."""
    torch.manual_seed(4)
    query, key = torch.randn(1, 4, 160, 16) * 3, torch.randn(1, 2, 160, 16)
    kv_start = torch.tensor([0])
    method = XAttnMethod(XAttnConfig(block_size=16, stride=4, threshold=0.6, decode_threshold=0.6, dense_last=0))
    summaries = ref.block_summaries(key, None, kv_start, 16)
    args = dict(scale=0.25, q_offset=0, kv_start=kv_start)
    for select, q, offset in ((method.select_prefill, query, 0), (method.select_decode, query[:, :, -1:], 159)):
        plain = select(q, summaries, key, **{**args, "q_offset": offset}).to_mask(10)
        capped = select(q, summaries, key, **{**args, "q_offset": offset}, softcap=1.0).to_mask(10)
        assert capped.sum() > plain.sum()
        assert offset == 0 or (capped | ~plain).all()


# -- threshold selection ------------------------------------------------------------------------------------
def test_cumulative_threshold_select_is_the_smallest_set_reaching_the_threshold():
    torch.manual_seed(3)
    mass = torch.rand(6, 40) ** 4
    available = torch.arange(40)[None, :] < torch.tensor([40, 40, 30, 12, 3, 1])[:, None]
    forced = torch.zeros_like(available)
    forced[:, 0] = True
    forced[torch.arange(6), available.sum(-1) - 1] = True
    for threshold in (0.3, 0.8, 0.95):
        chosen = ref.cumulative_threshold_select(mass, available, forced, threshold)
        assert not (chosen & ~available).any() and (chosen | ~forced).all()
        total = (mass * available).sum(-1)
        kept = (mass * chosen).sum(-1)
        assert (kept >= threshold * total - 1e-6).all()
        for row in range(6):
            optional = (chosen[row] & ~forced[row]).nonzero().flatten()
            if len(optional):  # dropping the lightest optional block falls below the threshold
                lightest = mass[row, optional].min()
                assert kept[row] - lightest < threshold * total[row]
                # ... and every unchosen available block is no heavier than the lightest chosen one
                unchosen = available[row] & ~chosen[row]
                assert (mass[row][unchosen] <= lightest).all()
    low = ref.cumulative_threshold_select(mass, available, forced, 0.5)
    high = ref.cumulative_threshold_select(mass, available, forced, 0.9)
    assert (high | ~low).all() and high.sum() > low.sum()
    assert torch.equal(ref.cumulative_threshold_select(mass, available, forced, 1.0), available)


def test_prefill_forces_sink_and_diagonal_and_respects_causality():
    torch.manual_seed(4)
    query, key = torch.randn(1, 4, 160, 16), torch.randn(1, 2, 160, 16)
    method = XAttnMethod(XAttnConfig(dense_last=0, block_size=16, stride=4, threshold=0.3))
    selection = method.select_prefill(query, None, key, scale=0.25, q_offset=0, kv_start=torch.tensor([0]))
    mask = selection.to_mask(10)
    assert selection.num_heads == 2 and selection.query_tile == 16 and mask.shape == (1, 2, 10, 10)
    assert mask[..., 0].all() and mask.diagonal(dim1=2, dim2=3).all()
    assert not mask.triu(1).any(), "no block after the tile's own"
    assert mask.sum() < mask.new_ones(10, 10).tril().sum() * 2, "threshold 0.3 leaves blocks out"


@pytest.mark.parametrize("kv_start", [[0], [0, 37]])
def test_dense_last_tiles_keep_every_causal_block_and_leave_the_others(kv_start):
    """Tri-shape: the tiles holding the last ``dense_last`` queries of each row attend to all of their causal
    blocks; every other tile's selection is the same as without it (left padding: tiles counted per row)."""
    torch.manual_seed(5)
    batch = len(kv_start)
    query, key = torch.randn(batch, 4, 170, 16), torch.randn(batch, 2, 170, 16)
    kv_start = torch.tensor(kv_start)
    kwargs = dict(scale=0.25, q_offset=0, kv_start=kv_start)
    plain = XAttnMethod(XAttnConfig(dense_last=0, block_size=16, stride=4, threshold=0.3)).select_prefill(query, None, key, **kwargs)
    tail = XAttnMethod(XAttnConfig(block_size=16, stride=4, threshold=0.3, dense_last=20)).select_prefill(
        query, None, key, **kwargs)
    num_blocks = plain.to_mask(11).shape[-1]
    plain_mask, tail_mask = plain.to_mask(num_blocks), tail.to_mask(num_blocks)
    for row, start in enumerate(kv_start.tolist()):
        real = 170 - start
        tiles = -(-real // 16)
        dense_tiles = [t for t in range(tiles) if min(16 * t + 15, real - 1) >= real - 20]
        assert len(dense_tiles) == 2  # 20 queries end in the last tile or the one before
        for t in range(tiles):
            causal = torch.arange(num_blocks) <= min(16 * t + 15, real - 1) // 16
            if t in dense_tiles:
                assert torch.equal(tail_mask[row, :, t], causal.expand(2, -1))
            else:
                assert torch.equal(tail_mask[row, :, t], plain_mask[row, :, t])
        assert not plain_mask[row, :, dense_tiles[0]].all(), "threshold 0.3 leaves blocks out of those tiles"


def test_density_probe_sample_has_no_dense_tail():
    """The density probe selects for a prefill's last queries as a sample of the whole call: the tail does not
    apply to it (else every probe would read density 1 and send the layer to dense attention)."""
    torch.manual_seed(6)
    query, key = torch.randn(1, 4, 64, 16), torch.randn(1, 2, 300, 16)
    kwargs = dict(scale=0.25, q_offset=236, kv_start=torch.tensor([0]))
    tail = XAttnMethod(XAttnConfig(block_size=16, stride=4, threshold=0.3, dense_last=128))
    plain = XAttnMethod(XAttnConfig(block_size=16, stride=4, threshold=0.3, dense_last=0))
    sample = tail.select_prefill(query, None, key, probe=True, **kwargs).to_mask(19)
    assert torch.equal(sample, plain.select_prefill(query, None, key, **kwargs).to_mask(19))
    assert sample.sum() < tail.select_prefill(query, None, key, **kwargs).to_mask(19).sum()


def test_prefill_after_a_cached_prefix_forces_the_tiles_own_blocks():
    torch.manual_seed(9)
    query, key = torch.randn(1, 4, 40, 16), torch.randn(1, 2, 90, 16)  # 50 cached tokens, 40 new queries
    method = XAttnMethod(XAttnConfig(dense_last=0, block_size=16, stride=4, threshold=0.2))
    selection = method.select_prefill(query, None, key, scale=0.25, q_offset=50, kv_start=torch.tensor([0]))
    mask = selection.to_mask(6)
    assert selection.num_query_tiles == 3
    for tile in range(3):  # queries at slots 50 + 16 * tile + [0, 16), clipped to the 90 keys
        first_own, last_own = (50 + 16 * tile) // 16, min(50 + 16 * tile + 15, 89) // 16
        assert mask[0, :, tile, [0, first_own, last_own]].all()
        assert not mask[0, :, tile, last_own + 1 :].any()


def test_vote_is_a_subset_of_any_and_equals_it_without_gqa():
    torch.manual_seed(5)
    kv_start = torch.tensor([0, 7])
    for q_heads, kv_heads in ((8, 2), (4, 4)):
        query, key = torch.randn(2, q_heads, 150, 16), torch.randn(2, kv_heads, 150, 16)
        masks = {}
        for reduce in ("any", "vote"):
            method = XAttnMethod(XAttnConfig(dense_last=0, block_size=16, stride=4, threshold=0.6, gqa_reduce=reduce))
            masks[reduce] = method.select_prefill(query, None, key, scale=0.25, q_offset=0, kv_start=kv_start).to_mask(10)
        assert (masks["any"] | ~masks["vote"]).all()
        if q_heads == kv_heads:
            assert torch.equal(masks["any"], masks["vote"])
        else:
            assert masks["vote"].sum() < masks["any"].sum()


def test_chunked_prefill_scoring_equals_unchunked():
    torch.manual_seed(6)
    query, key = torch.randn(2, 6, 230, 16), torch.randn(2, 2, 230, 16)
    kv_start = torch.tensor([0, 37])
    base = dict(block_size=16, stride=4, threshold=0.7)
    whole = XAttnMethod(XAttnConfig(**base, prefill_chunk=None, chunk_size=256))
    chunked = XAttnMethod(XAttnConfig(**base, prefill_chunk=32, chunk_size=48))
    args = dict(scale=0.25, q_offset=0, kv_start=kv_start)
    a, b = whole.select_prefill(query, None, key, **args), chunked.select_prefill(query, None, key, **args)
    assert torch.equal(a.indices, b.indices) and torch.equal(a.counts, b.counts)
    mass_whole = ref.antidiagonal_block_scores(query, key, **args, block_size=16, stride=4)
    mass_parts = torch.cat([ref.antidiagonal_block_scores(query, key, **args, block_size=16, stride=4, first_tile=t,
                                                          num_tiles=min(2, 15 - t), key_chunk=48)
                            for t in range(0, 15, 2)], dim=2)
    torch.testing.assert_close(mass_parts, mass_whole, atol=1e-5, rtol=1e-5)


def test_decode_selection_threshold_on_block_summaries():
    torch.manual_seed(7)
    key = torch.randn(2, 2, 200, 16)
    kv_start = torch.tensor([0, 30])
    summaries = ref.block_summaries(key, None, kv_start, 16)
    query = torch.randn(2, 4, 1, 16)
    args = dict(scale=0.25, q_offset=199, kv_start=kv_start)
    sparse = XAttnMethod(XAttnConfig(dense_last=0, block_size=16, stride=4, threshold=0.5, decode_threshold=None)).select_decode(query, summaries, key, **args)
    full_config = XAttnConfig(dense_last=0, block_size=16, stride=4, threshold=0.5, decode_threshold=1.0)
    full = XAttnMethod(full_config).select_decode(query, summaries, key, **args)
    assert sparse.num_heads == 2 and sparse.num_query_tiles == 1 and sparse.query_tile == 1
    row_blocks = torch.tensor([13, 11])  # ceil((200 - kv_start) / 16)
    assert torch.equal(full.counts[:, :, 0], row_blocks[:, None].expand(2, 2).int())
    mask = sparse.to_mask(13)
    assert mask[..., 0].all() and mask[0, :, 0, 12].all() and mask[1, :, 0, 10].all()
    assert (sparse.counts < full.counts).all()
    # Same rule by hand: per query head, smallest mass-ordered set, united over the GQA group.
    available = ref.block_availability(1, 13, 199, kv_start, 16, 200)
    probs = torch.softmax(ref.block_logits(query, summaries, 0.25, available), -1).nan_to_num(0.0)
    forced = torch.zeros(2, 1, 1, 13, dtype=torch.bool)
    forced[..., 0] = True
    forced[0, ..., 12] = forced[1, ..., 10] = True
    chosen = ref.cumulative_threshold_select(probs, available[:, None], forced, 0.5)
    assert torch.equal(mask, chosen.view(2, 2, 2, 1, 13).any(2))


# -- models ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("q_heads, kv_heads", [(8, 2), (6, 6)])
def test_full_density_equals_sdpa_in_prefill_and_decode(q_heads, kv_heads):
    """Threshold 1.0 keeps every causal block: the sparse path must reproduce sdpa in fp32."""
    model_config = tiny_config("llama", q_heads, kv_heads)
    config = XAttnConfig(block_size=16, stride=4, threshold=1.0, dense_below=0, dense_layers=())
    sparse, dense = xattn_model(model_config, config), build(model_config, "sdpa")
    ids = torch.randint(0, 128, (2, 90))  # not a multiple of the block size
    kwargs = dict(max_new_tokens=10, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad(), hf_sparse.record_sparsity() as rec:
        torch.testing.assert_close(sparse(ids).logits, dense(ids).logits, atol=2e-5, rtol=1e-4)
        out_sparse = sparse.generate(ids, past_key_values=SparseCache(sparse.config), **kwargs)
        out_dense = dense.generate(ids, **kwargs)
    assert torch.equal(out_sparse.sequences, out_dense.sequences)
    for a, b in zip(out_sparse.logits, out_dense.logits):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    assert {r.phase for r in rec.records} == {"prefill", "decode"} and not rec.dense_layers()
    assert rec.density() == pytest.approx(1.0)


def test_prefill_in_two_calls_equals_sdpa_at_full_density():
    """A second prefill call over a cached prefix (q_offset 50, tiles not block-aligned) at full density."""
    model_config = tiny_config("llama", 8, 2)
    config = XAttnConfig(block_size=16, stride=4, threshold=1.0, dense_below=0, dense_layers=())
    sparse, dense = xattn_model(model_config, config), build(model_config, "sdpa")
    ids = torch.randint(0, 128, (1, 90))
    cache = SparseCache(sparse.config)
    with torch.no_grad(), hf_sparse.record_sparsity() as rec:
        sparse(ids[:, :50], past_key_values=cache, use_cache=True)
        second = sparse(ids[:, 50:], past_key_values=cache, use_cache=True).logits
        expected = dense(ids).logits[:, 50:]
    torch.testing.assert_close(second, expected, atol=2e-5, rtol=1e-4)
    assert [r.phase for r in rec.records] == ["prefill"] * 4 and rec.density() == pytest.approx(1.0)


def test_left_padded_batch_equals_each_prompt_alone():
    model = xattn_model(tiny_config("llama", 6, 2),
                        XAttnConfig(dense_last=0, block_size=16, stride=4, threshold=0.3, decode_threshold=0.3, dense_below=0,
                                    dense_layers=()))
    torch.manual_seed(8)
    long_ids, short_ids = torch.randint(3, 128, (1, 300)), torch.randint(3, 128, (1, 219))
    batch = torch.zeros(2, 300, dtype=torch.long)
    mask = torch.zeros(2, 300, dtype=torch.long)
    batch[0], mask[0] = long_ids[0], 1
    batch[1, 81:], mask[1, 81:] = short_ids[0], 1

    def generate(ids, attention_mask=None):
        return model.generate(ids, attention_mask=attention_mask, past_key_values=SparseCache(model.config),
                              max_new_tokens=8, do_sample=False, pad_token_id=0)

    with torch.no_grad(), hf_sparse.record_sparsity() as rec:
        together = generate(batch, mask)
        alone_long, alone_short = generate(long_ids), generate(short_ids)
    assert rec.density("prefill") < 0.8 and rec.density("decode") < 0.8, "selection really was sparse"
    assert torch.equal(together[0, 300:], alone_long[0, 300:])
    assert torch.equal(together[1, 300:], alone_short[0, 219:])
