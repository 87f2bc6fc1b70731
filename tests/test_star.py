"""Star Attention: config, fixed selection, equality with an explicitly masked dense run, generate(), and the
distributed path (2 gloo processes on CPU) against one process."""
from __future__ import annotations

import os
import socket
import tempfile
import traceback
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import hf_sparse
from hf_sparse import distributed, star_attention
from hf_sparse.cache import DECODE_MAX_QUERY
from hf_sparse.config import CONFIG_KEY, StarConfig, config_from_dict
from hf_sparse.integration import padding_mask
from hf_sparse.methods.star import StarMethod

from conftest import build, tiny_config



def explicit_star_mask(kv_start: torch.Tensor, q_len: int, k_len: int, context: int, block: int, anchor: int):
    """Boolean ``[B, q_len, k_len]`` Star mask written from the definition: a context query (slot < ``context``)
    sees the causal keys of its own block and the anchor (first ``anchor`` tokens of its row); a query token sees
    every causal key. Blocks count from each row's first real token (left padding)."""
    q_slot = (k_len - q_len) + torch.arange(q_len)
    k_slot = torch.arange(k_len)
    rel_q = q_slot[None, :] - kv_start[:, None]
    rel_k = k_slot[None, :] - kv_start[:, None]
    causal = (rel_k[:, None, :] >= 0) & (k_slot[None, None, :] <= q_slot[None, :, None])
    same_block = torch.div(rel_q, block, rounding_mode="floor")[:, :, None] == \
        torch.div(rel_k, block, rounding_mode="floor")[:, None, :]
    in_anchor = (rel_k < anchor)[:, None, :]
    is_query = (q_slot >= context)[None, :, None]
    mask = causal & (is_query | same_block | in_anchor)
    return mask | (q_slot[None, :, None] == k_slot[None, None, :])  # padding queries: self only (no NaN)


def _reference_attention(star_config: StarConfig):
    """A dense attention function applying :func:`explicit_star_mask` (the last ``query_tokens`` are the query)."""
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        batch, heads, q_len, _ = query.shape
        k_len = key.shape[2]
        kv_start = torch.zeros(batch, dtype=torch.long) if attention_mask is None else \
            k_len - attention_mask[:, -k_len:].sum(-1)
        context = k_len - star_config.query_tokens if k_len == q_len else 0
        mask = explicit_star_mask(kv_start, q_len, k_len, context, star_config.block_size, star_config.anchor_size)
        group = heads // key.shape[1]
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(group, 1), value.repeat_interleave(group, 1), attn_mask=mask[:, None],
            scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    return attention


def star_model(config, star_config: StarConfig, seed: int = 0):
    model = build(config, "star", seed=seed)
    setattr(model.config, CONFIG_KEY, star_config.to_dict())
    return model


# -- config and selection ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    (dict(block_size=24), "block_size"), (dict(block_size=0), "block_size"), (dict(block_size=32.0), "block_size"),
    (dict(block_size=64, anchor_size=48), "anchor_size"), (dict(block_size=64, anchor_size=128), "anchor_size"),
    (dict(query_tokens=-1), "query_tokens"), (dict(dense_below=-5), "dense_below"),
    (dict(dense_layers=3), "dense_layers"),
])
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        StarConfig(**kwargs)


def test_config_round_trip_and_defaults():
    config = StarConfig(block_size=96, anchor_size=32, query_tokens=5, dense_layers=(0, -1), dense_below=0)
    assert config_from_dict(config.to_dict()) == config
    assert StarConfig.from_dict({"block_size": 256}).anchor_size == 256
    assert config.kernel_block_size == 32 and StarConfig(block_size=1024).kernel_block_size == 128
    assert StarConfig(block_size=512).dense_threshold("context") == 512 and config.dense_threshold("query") == 0
    assert config.is_dense_layer(3, 4) and config.is_dense_layer(0, 4) and not config.is_dense_layer(1, 4)
    with pytest.raises(ValueError, match="unknown StarConfig field"):
        StarConfig.from_dict({"block_sise": 64})
    with pytest.raises(ValueError, match="not a Star"):
        StarConfig.from_dict({"method": "plas"})


def test_shard_blocks_contiguous_and_balanced():
    assert distributed.shard_blocks(5, 2) == [(0, 3), (3, 5)]
    assert distributed.shard_blocks(2, 3) == [(0, 1), (1, 2), (2, 2)]
    assert distributed.rank_and_world() == (0, 1) and not distributed.is_distributed()


@pytest.mark.parametrize("prefix", [0, 16])
def test_context_selection_is_anchor_plus_own_block(prefix):
    """Token-level expansion of the fixed selection equals the definition, with and without the anchor prefix."""
    config = StarConfig(block_size=64, anchor_size=16)
    length = prefix + 200
    selection = StarMethod(config).context_selection(1, 2, length, torch.device("cpu"), prefix_tokens=prefix)
    granule = config.kernel_block_size
    blocks = selection.to_mask(-(-length // granule))[0, 0]                      # [tiles, blocks]
    tokens = blocks.repeat_interleave(granule, 0).repeat_interleave(granule, 1)[:length, :length]
    slot = torch.arange(length)
    block_of = torch.where(slot < prefix, torch.full_like(slot, -1), torch.div(slot - prefix, 64, rounding_mode="floor"))
    causal = slot[None, :] <= slot[:, None]
    expected = causal & ((block_of[:, None] == block_of[None, :]) | (slot[None, :] < 16))
    # Within a tile the selection covers whole blocks; the kernel applies causality per token.
    assert torch.equal(tokens & causal, expected)
    assert selection.indices.shape[0] == 1 and selection.num_heads == 2


# -- one process ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
@pytest.mark.parametrize("block_size, anchor_size", [(32, 32), (32, 16)])
@pytest.mark.parametrize("query_tokens", [7, 40], ids=["sdpa_query", "kernel_query"])
def test_star_equals_dense_with_explicit_mask(heads, block_size, anchor_size, query_tokens, monkeypatch):
    """Phase 1 and phase 2 against the mask written out; 40 query tokens (more than DECODE_MAX_QUERY) run phase 2
    through the sparse attention kernel over every block, 7 through sdpa."""
    assert 7 <= DECODE_MAX_QUERY < 40
    config = tiny_config("llama", *heads)
    star_config = StarConfig(block_size=block_size, anchor_size=anchor_size, query_tokens=query_tokens, dense_below=0,
                             dense_above_density=None)
    model = star_model(config, star_config)
    long_queries = []
    original = star_attention._all_blocks_attention
    monkeypatch.setattr(star_attention, "_all_blocks_attention",
                        lambda *args: long_queries.append(args[1].shape[2]) or original(*args))
    name = f"star_reference_{block_size}_{anchor_size}_{query_tokens}"
    AttentionInterface.register(name, _reference_attention(star_config))
    AttentionMaskInterface.register(name, padding_mask)
    reference = build(config, name)
    torch.manual_seed(1)
    ids = torch.randint(3, 128, (2, 150))       # 150 = 4 blocks + 22, not a multiple of the block size
    mask = torch.ones_like(ids)
    mask[1, :37] = 0                            # row 1 left-padded: its blocks count from slot 37
    with torch.no_grad(), hf_sparse.record_sparsity() as recorder:
        got = model(ids, attention_mask=mask).logits
        want = reference(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)
    assert recorder.density("context") < (0.8 if query_tokens <= DECODE_MAX_QUERY else 0.9), \
        "the context really ran block-sparse"
    assert not any(r.dense_reason for r in recorder.records if r.phase == "context")
    assert long_queries == ([query_tokens] * config.num_hidden_layers if query_tokens > DECODE_MAX_QUERY else [])
    # And it is not dense attention: the logits differ from sdpa.
    dense = build(config, "sdpa")
    with torch.no_grad():
        assert (dense(ids, attention_mask=mask).logits[real] - got[real]).abs().max() > 1e-3


@pytest.mark.parametrize("num_queries, block_size, anchor_size", [(100, 32, 16), (257, 64, 64), (1000, 128, 32),
                                                                   (4095, 512, 128), (31, 32, 32)])
def test_context_density_is_the_selections(num_queries, block_size, anchor_size):
    """StarMethod.context_density (host arithmetic) equals the attended / causal tiles of the selection itself."""
    method = StarMethod(StarConfig(block_size=block_size, anchor_size=anchor_size))
    selection = method.context_selection(1, 1, num_queries, torch.device("cpu"))
    tiles = selection.counts.shape[-1]
    causal = tiles * (tiles + 1) / 2
    assert method.context_density(num_queries) == pytest.approx(selection.counts.sum().item() / causal)


def test_a_dense_pattern_runs_dense():
    """A context whose pattern keeps more than dense_above_density of the causal blocks runs sdpa (bit-equal), and
    says why; below the threshold (or with None) phase 1 runs its pattern."""
    config = tiny_config("llama", 4, 2)
    dense = build(config, "sdpa")
    ids = torch.randint(3, 128, (1, 129), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = dense(ids).logits
    for threshold, runs_dense in ((0.4, True), (0.6, True), (0.8, False), (None, False)):
        # block 32 = anchor over 128 context tokens: 4 context blocks of one tile, the pattern keeps 7 of 10 tiles
        model = star_model(config, StarConfig(block_size=32, anchor_size=32, dense_above_density=threshold))
        with torch.no_grad(), hf_sparse.record_sparsity() as recorder:
            got = model(ids).logits
        reasons = recorder.dense_layers("context")
        assert (set(reasons) == {0, 1}) == runs_dense
        if runs_dense:
            assert torch.equal(got, want) and "keeps 0.700" in reasons[0]
        else:
            assert not torch.equal(got, want)


def test_logn_scaling_scales_each_query_by_its_true_position():
    """logN on the Star path equals the explicit-mask reference on queries scaled by their row positions, and
    star_attention.generate (positions passed per phase) equals a plain generate() with it."""
    import dataclasses

    from hf_sparse.kernels import reference as ref

    config = tiny_config("llama", 8, 2)
    star_config = StarConfig(block_size=32, anchor_size=16, query_tokens=7, dense_below=0, dense_above_density=None, logn_scaling=True,
                             logn_base=16)
    model = star_model(config, star_config)
    unscaled = dataclasses.replace(star_config, logn_scaling=False, logn_base=None)
    masked = _reference_attention(unscaled)

    def scaled_reference(module, query, key, value, attention_mask, **kwargs):
        q_len, k_len = query.shape[2], key.shape[2]
        kv_start = k_len - attention_mask[:, -k_len:].sum(-1)
        factor = ref.logn_factors((k_len - q_len + torch.arange(q_len))[None, :] - kv_start[:, None], 16)
        return masked(module, (query.float() * factor[:, None, :, None]).to(query.dtype), key, value, attention_mask,
                      **kwargs)

    AttentionInterface.register("star_reference_logn", scaled_reference)
    AttentionMaskInterface.register("star_reference_logn", padding_mask)
    reference = build(config, "star_reference_logn")
    torch.manual_seed(4)
    ids = torch.randint(3, 128, (2, 150))
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    real = mask.bool()
    positions = (mask.cumsum(-1) - 1).clamp_min(0)  # row positions, as generate() passes them (and RoPE uses)
    with torch.no_grad(), hf_sparse.record_sparsity() as recorder:
        got = model(ids, attention_mask=mask, position_ids=positions).logits
        want = reference(ids, attention_mask=mask, position_ids=positions).logits
        plain = star_model(config, unscaled)(ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)
    assert (got[real] - plain[real]).abs().max() > 1e-3, "logN changed nothing"
    assert recorder.density("context") < 0.8

    kwargs = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        whole = model.generate(ids, attention_mask=mask, **kwargs)
        split = star_attention.generate(model, ids[:, :-7], ids[:, -7:], attention_mask=mask[:, :-7], **kwargs)
    assert torch.equal(split.sequences, whole.sequences)
    for a, b in zip(split.logits, whole.logits):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="logn_scaling"):
        StarConfig(logn_base=4096)


def test_short_context_is_bit_equal_to_sdpa():
    config = tiny_config("llama", 8, 2)
    model = star_model(config, StarConfig(block_size=64, query_tokens=4))   # dense_below defaults to block_size
    dense = build(config, "sdpa")
    ids = torch.randint(3, 128, (1, 60))
    with torch.no_grad(), hf_sparse.record_sparsity() as recorder:
        assert torch.equal(model(ids).logits, dense(ids).logits)
    assert set(recorder.dense_layers("context").values()) == {"context 56 < dense_below 64"}


@pytest.mark.parametrize("query_tokens", [6, 40], ids=["sdpa_query", "kernel_query"])
def test_star_generate_equals_plain_generate_with_the_same_split(query_tokens, monkeypatch):
    """star_attention.generate's query phase (a call with a past) against a plain generate() whose last
    query_tokens are the query; 40 of them run the query phase through the sparse kernel over every block (left
    padding in row 0), both ways."""
    config = tiny_config("llama", 8, 2)
    long_queries = []
    original = star_attention._all_blocks_attention
    monkeypatch.setattr(star_attention, "_all_blocks_attention",
                        lambda *args: long_queries.append(args[1].shape[2]) or original(*args))
    star_config = StarConfig(block_size=32, anchor_size=16, query_tokens=query_tokens, dense_above_density=None)
    model = star_model(config, star_config)
    torch.manual_seed(2)
    ids = torch.randint(3, 128, (2, 156))
    mask = torch.ones_like(ids)
    mask[0, :21] = 0
    context, query = ids[:, :-query_tokens], ids[:, -query_tokens:]
    kwargs = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad(), hf_sparse.record_sparsity() as recorder:
        plain = model.generate(ids, attention_mask=mask, **kwargs)
        split = star_attention.generate(model, context, query, attention_mask=mask[:, :-query_tokens], **kwargs)
    assert recorder.density("context") < 0.8
    assert long_queries == ([query_tokens] * 2 * config.num_hidden_layers if query_tokens > DECODE_MAX_QUERY else [])
    assert torch.equal(split.sequences, plain.sequences)
    for a, b in zip(split.logits, plain.logits):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)

    # One encoded context answers two queries, each as a fresh run would.
    other = torch.randint(3, 128, (2, 9))
    encoded = star_attention.encode_context(model, context, attention_mask=mask[:, :-query_tokens])
    first = star_attention.generate_from_context(model, encoded, query, max_new_tokens=8, do_sample=False, pad_token_id=0)
    second = star_attention.generate_from_context(model, encoded, other, max_new_tokens=5, do_sample=False, pad_token_id=0)
    fresh = star_attention.generate(model, context, other, attention_mask=mask[:, :-query_tokens], max_new_tokens=5,
                          do_sample=False, pad_token_id=0)
    assert torch.equal(first, plain.sequences[:, context.shape[1]:])
    assert torch.equal(second, fresh[:, context.shape[1]:])
    assert encoded.cache.get_seq_length() == context.shape[1]


def test_generate_errors():
    config = tiny_config("llama", 4, 2)
    ids = torch.randint(3, 128, (1, 40))
    dense = build(config, "sdpa")
    with pytest.raises(ValueError, match="never called the Star attention"):
        star_attention.generate(dense, ids[:, :30], ids[:, 30:], config=StarConfig(block_size=16), max_new_tokens=2)
    model = star_model(config, StarConfig(block_size=16))
    with pytest.raises(TypeError, match="attention_mask"):
        star_attention.generate_from_context(model, star_attention.encode_context(model, ids[:, :30]), ids[:, 30:],
                                   attention_mask=torch.ones_like(ids))
    with pytest.raises(ValueError, match="query_ids"):
        star_attention.generate_from_context(model, star_attention.encode_context(model, ids[:, :30]), ids[0, 30:])


def test_sharded_context_refuses_a_tensor_parallel_model(monkeypatch):
    """Star's context sharding and tensor parallelism would use the same ranks: refused up front, by name."""
    config = tiny_config("llama", 4, 2)
    model = star_model(config, StarConfig(block_size=16))
    model._tp_size = 2  # what from_pretrained(tp_plan=...) sets
    monkeypatch.setattr(distributed, "is_distributed", lambda group=None: True)
    monkeypatch.setattr(distributed, "rank_and_world", lambda group=None: (0, 2))
    with pytest.raises(ValueError, match="tensor parallelism .*tp_size 2"):
        star_attention.encode_context(model, torch.randint(3, 128, (1, 40)))



def test_tensor_parallel_kwargs_follow_the_installed_transformers(monkeypatch):
    """tp_plan= up to transformers 5.17, distributed_config= from 5.18 (tests/test_multi_gpu.py loads through it).
    The version is patched on the module hf_sparse.distributed imported: a test run can leave another object in
    sys.modules["transformers"] (the module's lazy loader is rebuilt), whose attributes distributed never reads."""
    transformers = distributed.transformers
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    assert distributed.tensor_parallel_kwargs() == {"tp_plan": "auto"}
    if hasattr(transformers, "DistributedConfig"):
        monkeypatch.setattr(transformers, "__version__", "5.24.0")
        kwargs = distributed.tensor_parallel_kwargs({"layers.*.self_attn.q_proj": "colwise"})
        assert list(kwargs) == ["distributed_config"]
        assert kwargs["distributed_config"].tp_plan == {"layers.*.self_attn.q_proj": "colwise"}


# -- two processes (gloo) ---------------------------------------------------------------------------------------
DIST_CONFIG = dict(block_size=32, anchor_size=16, logn_scaling=True, logn_base=16,  # logN: global positions per rank
                   dense_above_density=None)
DIST_CONTEXT, DIST_QUERY, DIST_NEW = 150, 6, 8
DIST_TIMEOUT_S = 150


def _dist_inputs():
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 128, (2, DIST_CONTEXT + DIST_QUERY), generator=generator)
    return ids[:, :DIST_CONTEXT], ids[:, DIST_CONTEXT:]


def _dist_run(model, context, query, **extra):
    return star_attention.generate(model, context, query, max_new_tokens=DIST_NEW, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0, **extra)


def _dist_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    try:
        torch.set_num_threads(1)
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                             world_size=world_size, timeout=timedelta(seconds=60))
        model = star_model(tiny_config("llama", 8, 2), StarConfig(**DIST_CONFIG))
        context, query = _dist_inputs()
        result = _dist_run(model, context, query)
        stored = [layer.get_seq_length() for layer in result.past_key_values.layers]
        encoded = star_attention.encode_context(model, context)
        short = _dist_run(model, context[:, :24], query)          # < dense_below: every rank encodes it whole
        try:
            star_attention.encode_context(model, context, attention_mask=torch.ones_like(context).index_fill_(1, torch.tensor([0]), 0))
            padded_rejected = False
        except NotImplementedError:
            padded_rejected = True
        torch.save(dict(sequences=result.sequences, logits=torch.stack(result.logits), stored=stored,
                        shard=encoded.shard, short=short.sequences, padded_rejected=padded_rejected),
                   os.path.join(out_dir, f"rank{rank}.pt"))
        torch.distributed.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as handle:
            handle.write(traceback.format_exc())
        raise


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_distributed_two_gloo_ranks_equal_one_process():
    world_size = 2
    context, query = _dist_inputs()
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.get_context("spawn")
        port = _free_port()
        procs = [ctx.Process(target=_dist_worker, args=(rank, world_size, port, out_dir)) for rank in range(world_size)]
        for proc in procs:
            proc.start()
        # Single-process reference while the ranks run.
        model = star_model(tiny_config("llama", 8, 2), StarConfig(**DIST_CONFIG))
        single = _dist_run(model, context, query)
        single_short = _dist_run(model, context[:, :24], query)
        for proc in procs:
            proc.join(DIST_TIMEOUT_S)
        hung = [p for p in procs if p.is_alive()]
        for proc in hung:
            proc.kill()
            proc.join()
        errors = {name: open(os.path.join(out_dir, name)).read() for name in os.listdir(out_dir) if name.endswith(".err")}
        assert not hung, f"distributed ranks hung past {DIST_TIMEOUT_S} s; errors: {errors}"
        assert all(p.exitcode == 0 for p in procs), f"exit codes {[p.exitcode for p in procs]}: {errors}"
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world_size)]

    single_logits = torch.stack(single.logits)
    for result in results:
        assert torch.equal(result["sequences"], single.sequences)
        torch.testing.assert_close(result["logits"], single_logits, atol=1e-4, rtol=1e-4)
        assert torch.equal(result["short"], single_short.sequences)
        assert result["padded_rejected"]
    assert torch.equal(results[0]["logits"], results[1]["logits"]), "every rank merges the same partials"
    # 5 blocks of 32: rank 0 keeps blocks 0-2, rank 1 blocks 3-4 plus the query and generated tokens' KV.
    assert results[0]["shard"] == (0, 96) and results[1]["shard"] == (96, DIST_CONTEXT)
    assert set(results[0]["stored"]) == {96}
    assert set(results[1]["stored"]) == {DIST_CONTEXT - 96 + DIST_QUERY + DIST_NEW - 1}
