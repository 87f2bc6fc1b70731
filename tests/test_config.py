import dataclasses
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_sparse
from hf_sparse.config import CONFIG_KEY, PLASConfig
from hf_sparse.kernels import reference
from hf_sparse.methods.plas import PLASMethod, top_k_density_floor

from conftest import build, tiny_config


def test_defaults_follow_fastdeploy():
    """FastDeploy's block size, decode top-k, union and prefill threshold rule (top_k[0] blocks); one query in 4
    searches, with a prefill top-k 10% above FastDeploy's (50, 60) for the same density; decode runs dense below
    eight times FastDeploy's threshold (102,400 tokens: where a GQA group's united selections keep most blocks,
    and where on the long-context default model reading every block is as fast and keeps the pass keys)."""
    config = PLASConfig()
    assert config.block_size == 128 and config.prefill_top_k == (55, 66) and config.decode_top_k == (100, 120)
    assert config.query_union == 128 and config.query_stride == 4 and config.dense_layers == (-1,)
    assert config.dense_threshold("prefill") == 55 * 128 and config.dense_threshold("decode") == 8 * 100 * 128 == 102400
    assert PLASConfig(dense_below=0).dense_threshold("decode") == 0
    assert PLASConfig(dense_below=(10, 20)).dense_threshold("decode") == 20


def test_prefill_top_k_grows_with_the_keys_past_its_length():
    """The prefill range holds up to prefill_top_k_length keys and scales with the keys past it (rounded up), so
    a query keeps the same share of the blocks: (110, 132) at 64K and (220, 264) at 128K, the settings measured
    within the quality budget (docs/quality.md); decode and None keep the counts; the density floor follows."""
    config = PLASConfig()
    assert config.prefill_top_k_length == 32768
    assert config.top_k("prefill") == config.top_k("prefill", 32768) == (55, 66)
    assert config.top_k("prefill", 4096) == (55, 66)
    assert config.top_k("prefill", 65536) == (110, 132) and config.top_k("prefill", 131072) == (220, 264)
    assert config.top_k("prefill", 40000) == (68, 81)  # ceil(55 * 40000 / 32768), ceil(66 * 40000 / 32768)
    assert config.top_k("decode", 131072) == (100, 120)
    assert PLASConfig(prefill_top_k_length=None).top_k("prefill", 131072) == (55, 66)
    assert PLASConfig.from_fastdeploy({}).prefill_top_k_length is None
    floor = PLASMethod(config).density_floor(1024, 131072)
    assert floor == top_k_density_floor(1024, 131072, 128, 128, 220) > top_k_density_floor(1024, 131072, 128, 128, 55)
    with pytest.raises(ValueError, match="prefill_top_k_length"):
        PLASConfig(prefill_top_k_length=0)


@pytest.mark.parametrize("kwargs, field", [
    ({"block_size": 100}, "block_size"),
    ({"block_size": 8}, "block_size"),
    ({"prefill_top_k": (60, 50)}, "prefill_top_k"),
    ({"decode_top_k": (0, 5)}, "decode_top_k"),
    ({"decode_top_k": 5}, "decode_top_k"),
    ({"query_union": 0}, "query_union"),
    ({"dense_below": -1}, "dense_below"),
    ({"dense_layers": "last"}, "dense_layers"),
    ({"search_steps": 0}, "search_steps"),
    ({"decode_cuda_graph": 1}, "decode_cuda_graph"),
    ({"decode_fused_layers": "yes"}, "decode_fused_layers"),
    ({"trim_last_layer": None}, "trim_last_layer"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PLASConfig(**kwargs)


def test_dict_round_trip_and_unknown_keys():
    config = PLASConfig(block_size=64, prefill_top_k=(4, 6), dense_layers=(0, -1), dense_below=(5, 7))
    data = json.loads(json.dumps(config.to_dict()))
    assert PLASConfig.from_dict(data) == config
    with pytest.raises(ValueError, match="unknown PLASConfig field"):
        PLASConfig.from_dict({"blocksize": 64})


def test_from_fastdeploy_keys():
    config = PLASConfig.from_fastdeploy({
        "plas_block_size": 64, "plas_encoder_top_k_left": 5, "plas_encoder_top_k_right": 9,
        "plas_decoder_top_k_left": 10, "plas_decoder_top_k_right": 12, "plas_use_decoder_seq_limit": 4096,
    })
    assert config.block_size == 64 and config.prefill_top_k == (5, 9) and config.decode_top_k == (10, 12)
    assert config.query_stride == 1  # FastDeploy's selection: every query searches
    assert config.dense_threshold("prefill") == 5 * 64 and config.dense_threshold("decode") == 4096
    legacy = PLASConfig.from_fastdeploy({"moba_encoder_top_k_left": 40, "moba_encoder_top_k_right": 48})
    assert legacy.prefill_top_k == (40, 48)
    unset = PLASConfig.from_fastdeploy({})  # FastDeploy's own prefill top-k, not ours for one query in 4
    assert unset.prefill_top_k == PLASConfig.FASTDEPLOY_PREFILL_TOP_K == (50, 60) and unset.query_stride == 1
    with pytest.raises(ValueError, match="plas_bogus"):
        PLASConfig.from_fastdeploy({"plas_bogus": 1})


def test_configure_round_trips_through_save_pretrained(tmp_path):
    model = build(tiny_config(), "sdpa")
    config = PLASConfig(block_size=32, prefill_top_k=(2, 3), dense_below=0)
    hf_sparse.configure(model, config)
    assert model.config._attn_implementation == "plas"
    model.save_pretrained(tmp_path)
    stored = json.loads((tmp_path / "config.json").read_text())[CONFIG_KEY]
    assert PLASConfig.from_dict(stored) == config
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="plas")
    assert PLASConfig.from_dict(getattr(loaded.config, CONFIG_KEY)) == config
    ids = torch.randint(0, 128, (1, 40))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, loaded(ids).logits)


def test_loaded_without_config_gets_defaults(tmp_path):
    build(tiny_config(), "sdpa").save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="plas")
    assert loaded.config._attn_implementation == "plas"
    assert hf_sparse.attention.method_config(loaded.config) == PLASConfig()


def test_configure_rejects_wrong_types():
    model = build(tiny_config(), "sdpa")
    with pytest.raises(TypeError, match="PLASConfig"):
        hf_sparse.configure(model, {"block_size": 64})
    with pytest.raises(TypeError, match="PreTrainedModel"):
        hf_sparse.configure(torch.nn.Linear(2, 2))


def test_model_without_attention_interface_is_rejected():
    model = build(tiny_config(), "sdpa")
    model._supports_attention_backend = False
    with pytest.raises(ValueError, match="AttentionInterface"):
        hf_sparse.configure(model)


@pytest.mark.parametrize("method", ["plas", "xattn", "star"])
def test_every_registered_method_is_exact_on_short_inputs(method):
    """Each registered implementation runs with its default config; short inputs run dense, bit-equal to sdpa."""
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    expected = build(tiny_config(), "sdpa")(ids).logits
    model = build(tiny_config(), method)
    assert torch.equal(model(ids).logits, expected)
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, build(tiny_config(), "sdpa").generate(ids, max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("stride", [0, -4, 2.5, "4"])
def test_query_stride_below_one_or_not_an_integer_is_refused(stride):
    with pytest.raises((ValueError, TypeError), match="query_stride"):
        hf_sparse.PLASConfig(query_union=128, query_stride=stride)
    # Past the tile only its last query searches; the default stride fits any tile.
    assert hf_sparse.PLASConfig(query_union=128, query_stride=129).query_stride == 129
    assert hf_sparse.PLASConfig(query_union=2).query_stride == 4


def test_plas_prefill_selects_with_the_scaled_range():
    """PLASMethod.select_prefill hands the selection the range scaled to the call's key length (queries past a
    prefix: q_offset counts), the same selection the reference makes with that range and not the given one; the
    density probe's runs (queries inside a longer call, ``call_length``) select with the call's range."""
    torch.manual_seed(0)
    config = PLASConfig(block_size=16, prefill_top_k=(2, 3), prefill_top_k_length=64, query_union=16,
                        query_stride=2, sink_blocks=1, search_steps=12)
    query, summaries = torch.randn(1, 4, 96, 8), torch.randn(1, 2, 16, 8)
    kv_start = torch.zeros(1, dtype=torch.int64)
    method = PLASMethod(config)
    assert config.top_k("prefill", 256) == (8, 12) and config.top_k("prefill", 192) == (6, 9)

    def with_range(top_k, queries=query, q_offset=160):
        return reference.select_blocks(queries, summaries, scale=8 ** -0.5, q_offset=q_offset, kv_start=kv_start,
                                       block_size=16, top_k=top_k, query_tile=16, head_union=False, sink_blocks=1,
                                       search_steps=12, query_stride=2)

    def same(a, b):
        return torch.equal(a.counts, b.counts) and torch.equal(a.indices, b.indices)

    chosen = method.select_prefill(query, summaries, None, scale=8 ** -0.5, q_offset=160, kv_start=kv_start)
    assert same(chosen, with_range((8, 12))) and not same(chosen, with_range((2, 3)))
    # a probe run, one searching query per tile: queries 224..255 of a 512-key call (15 and 16 causal blocks)
    method = PLASMethod(dataclasses.replace(config, query_stride=16))
    run = query[:, :, :32]
    probed = method.select_prefill(run, summaries, None, scale=8 ** -0.5, q_offset=224, kv_start=kv_start,
                                   probe=True, call_length=512)
    alone = method.select_prefill(run, summaries, None, scale=8 ** -0.5, q_offset=224, kv_start=kv_start)
    assert probed.counts.tolist() == [[[15, 16]] * 4]  # the call's 16-24 blocks: every causal one
    assert int(alone.counts.max()) <= 12 + 2  # its own length's 8-12, with the sink and the diagonal block


def test_a_plas_config_stored_before_the_length_rule_keeps_its_counts():
    """from_dict of a full dict without prefill_top_k_length (save_pretrained of an earlier version) keeps the
    fixed counts it ran with; a partial dict gets the defaults; today's dicts round-trip."""
    stored = PLASConfig().to_dict()
    del stored["prefill_top_k_length"]
    assert PLASConfig.from_dict(stored).prefill_top_k_length is None
    oldest = {name: stored[name] for name in PLASConfig.STORED_FIELDS}  # the first version's fields only
    assert PLASConfig.from_dict(oldest).prefill_top_k_length is None
    assert PLASConfig.from_dict({"block_size": 64}).prefill_top_k_length == 32768
    for config in (PLASConfig(), PLASConfig(prefill_top_k_length=None), PLASConfig(prefill_top_k_length=65536)):
        assert PLASConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
