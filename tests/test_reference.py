"""The PyTorch reference ops: properties of selection, and sparse attention vs dense attention."""
import math

import pytest
import torch

from hf_sparse.kernels import reference as ref
from hf_sparse.selection import BlockSelection


def dense_attention(query, key, value, q_offset, kv_start):
    group = query.shape[1] // key.shape[1]
    keys, values = key.repeat_interleave(group, 1).double(), value.repeat_interleave(group, 1).double()
    slots = torch.arange(key.shape[2])
    q_slot = q_offset + torch.arange(query.shape[2])
    visible = (slots[None, :] <= q_slot[:, None])[None] & (slots[None, None, :] >= kv_start[:, None, None])
    scores = query.double() @ keys.transpose(-1, -2) / math.sqrt(query.shape[-1])
    probs = torch.softmax(scores.masked_fill(~visible[:, None], float("-inf")), -1).nan_to_num(0.0)
    return probs @ values


@pytest.mark.parametrize("batch, q_heads, kv_heads, length, block", [(1, 4, 4, 100, 16), (3, 6, 2, 77, 32), (2, 8, 1, 130, 16)])
def test_full_selection_equals_dense(batch, q_heads, kv_heads, length, block):
    torch.manual_seed(length)
    q = torch.randn(batch, q_heads, length, 32)
    k = torch.randn(batch, kv_heads, length, 32)
    v = torch.randn(batch, kv_heads, length, 24)  # Dk != Dv
    kv_start = torch.randint(0, 20, (batch,))
    summaries = ref.block_summaries(k, None, kv_start, block)
    selection = ref.select_blocks(q, summaries, scale=32 ** -0.5, q_offset=0, kv_start=kv_start, block_size=block,
                                  top_k=(1000, 1000), query_tile=32, head_union=False)
    out, lse = ref.sparse_attention(q, k, v, selection, scale=32 ** -0.5, q_offset=0, kv_start=kv_start)
    expected = dense_attention(q, k, v, 0, kv_start)
    valid = (torch.arange(length)[None, :] >= kv_start[:, None])[:, None, :, None]
    torch.testing.assert_close(out.double() * valid, expected * valid, atol=1e-5, rtol=1e-5)
    assert torch.isinf(lse[~valid[..., 0].expand_as(lse)]).all()


def test_threshold_topk_lands_in_range():
    torch.manual_seed(0)
    logits = torch.randn(5, 7, 200) * 3
    available = torch.ones_like(logits, dtype=torch.bool)
    chosen = ref.threshold_topk(logits, available, (10, 14), search_steps=30)
    counts = chosen.sum(-1)
    assert counts.min() >= 10 and counts.max() <= 14
    # the selected set is a top set: every chosen score beats every unchosen one
    assert (logits.masked_fill(~chosen, 1e9).amin(-1) >= logits.masked_fill(chosen, -1e9).amax(-1)).all()


def test_threshold_topk_reaches_blocks_far_below_the_best():
    """A row whose 10th block sits 20-60 nats under its best (a sharp head: probabilities under 2^-16 of the
    top one, where halving f from 1 never gets to) still selects 10-14 blocks, not every block."""
    torch.manual_seed(1)
    logits = torch.randn(6, 300) - 60.0
    logits[:, 0] = 0.0
    logits[:3, 1:12] = -20.0 - torch.rand(3, 11)  # ranks 2-12 near -20, the rest near -60
    available = torch.ones_like(logits, dtype=torch.bool)
    available[4, 150:] = False
    chosen = ref.threshold_topk(logits, available, (10, 14), search_steps=16)
    counts = chosen.sum(-1)
    assert counts.min() >= 10 and counts.max() <= 14
    assert not (chosen & ~available).any()
    assert (logits.masked_fill(~chosen, 1e9).amin(-1) >= logits.masked_fill(chosen | ~available, -1e9).amax(-1)).all()
    # and rows whose top blocks are close land as before: the first bisection alone decides them
    near = torch.randn(4, 300)
    one_phase = ref.threshold_topk(near, torch.ones_like(near, dtype=torch.bool), (10, 14), search_steps=16)
    assert (one_phase.sum(-1) >= 10).all() and (one_phase.sum(-1) <= 14).all()


def test_threshold_topk_selects_all_when_few_available():
    logits = torch.randn(2, 9)
    available = torch.zeros(2, 9, dtype=torch.bool)
    available[:, :5] = True
    assert torch.equal(ref.threshold_topk(logits.masked_fill(~available, float("-inf")), available, (6, 8), 16),
                       available)


def test_selection_forces_diagonal_and_sink_and_respects_causality():
    torch.manual_seed(1)
    q = torch.randn(1, 2, 64, 16)
    k = torch.randn(1, 2, 64 + 100, 16)
    kv_start = torch.tensor([20])  # row blocks start at slot 20: block j = slots 20 + [16j, 16j + 16)
    summaries = ref.block_summaries(k, None, kv_start, 16)
    assert summaries.shape[2] == 9
    args = dict(scale=0.25, q_offset=100, kv_start=kv_start, block_size=16, top_k=(1, 1), head_union=False)
    sel = ref.select_blocks(q, summaries, query_tile=16, **args)
    mask = sel.to_mask(9)
    for tile in range(4):
        first_slot, last_slot = 100 + tile * 16, 100 + tile * 16 + 15
        assert mask[0, :, tile, 0].all(), "sink: the row's first block"
        assert mask[0, :, tile, (first_slot - 20) // 16].all() and mask[0, :, tile, (last_slot - 20) // 16].all()
        assert not mask[0, :, tile, (last_slot - 20) // 16 + 1:].any(), "causal"
    per_query = ref.select_blocks(q, summaries, query_tile=1, **args)
    assert (per_query.counts <= 3).all(), "one chosen block + sink + diagonal"
    assert torch.equal(per_query.to_mask(9).view(1, 2, 4, 16, 9).any(3), mask), "tiles unite their queries"


def test_left_padded_row_is_processed_like_the_sequence_alone():
    torch.manual_seed(6)
    alone_q, alone_k, alone_v = torch.randn(1, 4, 70, 16), torch.randn(1, 2, 70, 16), torch.randn(1, 2, 70, 16)
    pad = 23
    padded = [torch.cat([torch.randn(1, t.shape[1], pad, 16), t], 2) for t in (alone_q, alone_k, alone_v)]
    args = dict(scale=0.25, q_offset=0, block_size=16, top_k=(2, 2), query_tile=16, head_union=False)
    results = []
    for (q, k, v), kv_start in (((alone_q, alone_k, alone_v), torch.tensor([0])), (padded, torch.tensor([pad]))):
        summaries = ref.block_summaries(k, None, kv_start, 16)
        sel = ref.select_blocks(q, summaries, kv_start=kv_start, **args)
        out, _ = ref.sparse_attention(q, k, v, sel, scale=0.25, q_offset=0, kv_start=kv_start)
        results.append((sel, out))
    assert torch.equal(results[0][0].indices, results[1][0].indices)
    assert results[0][0].counts.float().mean() < 4.5, "really sparse"
    torch.testing.assert_close(results[1][1][:, :, pad:], results[0][1])
    assert (results[1][1][:, :, :pad] == 0).all()


def test_head_union_is_union_of_group_heads():
    torch.manual_seed(2)
    q = torch.randn(2, 6, 3, 16)
    k = torch.randn(2, 2, 300, 16)
    kv_start = torch.tensor([0, 33])
    summaries = ref.block_summaries(k, None, kv_start, 16)
    args = dict(scale=0.25, q_offset=297, kv_start=kv_start, block_size=16, top_k=(3, 4), query_tile=3)
    per_head = ref.select_blocks(q, summaries, head_union=False, **args).to_mask(19)
    grouped = ref.select_blocks(q, summaries, head_union=True, **args).to_mask(19)
    assert torch.equal(grouped, per_head.view(2, 2, 3, 1, 19).any(2))


def test_block_summaries_mean_and_gate():
    torch.manual_seed(3)
    k = torch.randn(2, 3, 50, 8)
    kv_start = torch.tensor([0, 5])
    mean = ref.block_summaries(k, None, kv_start, 16)
    assert mean.shape == (2, 3, 4, 8)
    torch.testing.assert_close(mean[1, :, 0], k[1, :, 5:21].mean(1))  # row blocks start at kv_start
    torch.testing.assert_close(mean[1, :, 2], k[1, :, 37:50].mean(1))  # partial last block: exact mean
    torch.testing.assert_close(mean[0, :, 3], k[0, :, 48:50].mean(1))
    gate = torch.randn(3, 16, 8)
    gated = ref.block_summaries(k, gate, kv_start, 16)
    torch.testing.assert_close(gated[0, :, 1], (k[0, :, 16:32] * gate).sum(1))
    torch.testing.assert_close(gated[0, :, 3], (k[0, :, 48:50] * gate[:, :2]).sum(1))
    part = ref.block_summaries(k, gate, kv_start, 16, first_block=2, num_blocks=1)
    torch.testing.assert_close(part[:, :, 0], gated[:, :, 2])


def test_merge_lse_equals_attention_over_the_union():
    torch.manual_seed(4)
    q = torch.randn(1, 2, 5, 16)
    k = torch.randn(1, 2, 96, 16)
    v = torch.randn(1, 2, 96, 16)
    kv_start = torch.tensor([0])
    parts = []
    for blocks in ([0, 2], [1, 3, 4, 5]):
        mask = torch.zeros(1, 2, 1, 6, dtype=torch.bool)
        mask[..., blocks] = True
        parts.append(ref.sparse_attention(q, k, v, BlockSelection.from_mask(mask, 16, 5), scale=0.25, q_offset=91,
                                          kv_start=kv_start))
    merged, lse = ref.merge_lse(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    full_mask = torch.ones(1, 2, 1, 6, dtype=torch.bool)
    full, full_lse = ref.sparse_attention(q, k, v, BlockSelection.from_mask(full_mask, 16, 5), scale=0.25, q_offset=91,
                                          kv_start=kv_start)
    torch.testing.assert_close(merged, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, full_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("density", [0.0, 0.5, 1.0])
def test_block_selection_mask_round_trip(density):
    mask = torch.rand(2, 3, 4, 9, generator=torch.Generator().manual_seed(1)) < density
    sel = BlockSelection.from_mask(mask, 16, 8)
    assert sel.indices.dtype == torch.int32 and sel.indices.is_contiguous()
    assert torch.equal(sel.counts, mask.sum(-1, dtype=torch.int32))
    assert torch.equal(sel.to_mask(9), mask)
    valid = torch.arange(9) < sel.counts[..., None]
    assert (sel.indices[~valid] == -1).all()
    ids = sel.indices.masked_fill(~valid, 99)
    assert (ids[..., 1:] > ids[..., :-1]).logical_or(~valid[..., 1:]).all(), "ascending"
    with pytest.raises(ValueError, match="disagree"):
        BlockSelection(sel.indices, sel.counts[:, :, :2], 16, 8)


def logn_scaled_query(query, q_offset, kv_start, logn_base):
    """Qwen's logN scaling applied to the queries themselves: row position n (1-based from the row's first
    valid slot) times max(1, log(n) / log(m))."""
    position = (q_offset + torch.arange(query.shape[2]))[None, :] - kv_start[:, None] + 1  # [B, Sq]
    factor = (position.clamp_min(1).double().log() / math.log(logn_base)).clamp_min(1.0)
    return query.double() * factor[:, None, :, None]


@pytest.mark.parametrize("q_offset", [0, 60])
def test_logn_scaling_equals_dense_with_scaled_queries(q_offset):
    torch.manual_seed(7)
    batch, q_heads, kv_heads, length, block, logn_base = 3, 4, 2, 130, 16, 24
    k = torch.randn(batch, kv_heads, length, 32)
    v = torch.randn(batch, kv_heads, length, 32)
    q = torch.randn(batch, q_heads, length - q_offset, 32) * 2
    kv_start = torch.tensor([0, 9, 30])
    summaries = ref.block_summaries(k, None, kv_start, block)
    selection = ref.select_blocks(q, summaries, scale=32 ** -0.5, q_offset=q_offset, kv_start=kv_start,
                                  block_size=block, top_k=(1000, 1000), query_tile=32, head_union=False)
    out, _ = ref.sparse_attention(q, k, v, selection, scale=32 ** -0.5, q_offset=q_offset, kv_start=kv_start,
                                  logn_base=logn_base)
    expected = dense_attention(logn_scaled_query(q, q_offset, kv_start, logn_base), k, v, q_offset, kv_start)
    plain = dense_attention(q, k, v, q_offset, kv_start)
    valid = ((q_offset + torch.arange(q.shape[2]))[None, :] >= kv_start[:, None])[:, None, :, None]
    torch.testing.assert_close(out.double() * valid, expected * valid, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out.double() * valid, plain * valid, atol=1e-3)  # the scaling did something
    with pytest.raises(ValueError, match="logn_base"):
        ref.sparse_attention(q, k, v, selection, scale=1.0, q_offset=q_offset, kv_start=kv_start, logn_base=1)


def test_skipped_rows_are_left_untouched():
    torch.manual_seed(8)
    q, k, v = torch.randn(3, 4, 40, 16), torch.randn(3, 2, 40, 16), torch.randn(3, 2, 40, 16)
    kv_start = torch.tensor([0, 5, 3])
    summaries = ref.block_summaries(k, None, kv_start, 16)
    selection = ref.select_blocks(q, summaries, scale=0.25, q_offset=0, kv_start=kv_start, block_size=16,
                                  top_k=(2, 2), query_tile=16, head_union=False)
    expected_out, expected_lse = ref.sparse_attention(q, k, v, selection, scale=0.25, q_offset=0, kv_start=kv_start)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"))
    skip = torch.tensor([False, True, False])
    ref.sparse_attention(q, k, v, selection, scale=0.25, q_offset=0, kv_start=kv_start, skip=skip, out=out, lse=lse)
    assert torch.isnan(out[1]).all() and torch.isnan(lse[1]).all()
    torch.testing.assert_close(out[~skip], expected_out[~skip])
    torch.testing.assert_close(lse[~skip], expected_lse[~skip])


def test_alibi_equals_dense_with_bias():
    torch.manual_seed(9)
    batch, q_heads, kv_heads, length, block = 2, 4, 2, 90, 16
    q, k, v = torch.randn(batch, q_heads, length, 32), torch.randn(batch, kv_heads, length, 32), torch.randn(batch, kv_heads, length, 32)
    kv_start = torch.tensor([0, 11])
    slopes = 2.0 ** (-torch.arange(1, q_heads + 1).float())
    summaries = ref.block_summaries(k, None, kv_start, block)
    selection = ref.select_blocks(q, summaries, scale=32 ** -0.5, q_offset=0, kv_start=kv_start, block_size=block,
                                  top_k=(1000, 1000), query_tile=32, head_union=False)
    out, _ = ref.sparse_attention(q, k, v, selection, scale=32 ** -0.5, q_offset=0, kv_start=kv_start, alibi_slopes=slopes)
    group = q_heads // kv_heads
    keys, values = k.repeat_interleave(group, 1).double(), v.repeat_interleave(group, 1).double()
    slots = torch.arange(length)
    bias = slopes.double()[:, None, None] * (slots[None, None, :] - slots[None, :, None])  # [H, Sq, Skv]
    visible = (slots[None, :] <= slots[:, None])[None] & (slots[None, None, :] >= kv_start[:, None, None])
    scores = q.double() @ keys.transpose(-1, -2) * 32 ** -0.5 + bias[None]
    expected = torch.softmax(scores.masked_fill(~visible[:, None], float("-inf")), -1).nan_to_num(0.0) @ values
    valid = (slots[None, :] >= kv_start[:, None])[:, None, :, None]
    torch.testing.assert_close(out.double() * valid, expected * valid, atol=1e-5, rtol=1e-5)


def test_alibi_selection_prefers_near_blocks():
    """With ALiBi slopes and uninformative keys, each query's selected blocks are its nearest ones."""
    torch.manual_seed(10)
    q, k = torch.randn(1, 2, 128, 16) * 0.01, torch.randn(1, 2, 128, 16) * 0.01
    kv_start = torch.zeros(1, dtype=torch.long)
    summaries = ref.block_summaries(k, None, kv_start, 16)
    selection = ref.select_blocks(q, summaries, scale=0.25, q_offset=0, kv_start=kv_start, block_size=16,
                                  top_k=(2, 2), query_tile=1, head_union=False, sink_blocks=0,
                                  alibi_slopes=torch.tensor([0.1, 0.05]))
    mask = selection.to_mask(8)  # [1, 2, 128 tiles, 8 blocks]
    for query in range(16, 128):
        own = query // 16
        assert mask[0, :, query, own - 1:own + 1].all() and not mask[0, :, query, :max(0, own - 2)].any()


def test_row_layout_carries_its_range_and_plain_tensors_are_read():
    from hf_sparse.selection import RowLayout

    layout = RowLayout.read(torch.tensor([0, 5, 2]))
    assert (layout.low, layout.high) == (0, 5) and ref.kv_start_range(layout) == (0, 5)
    assert ref.kv_start_range(torch.tensor([3, 7])) == (3, 7)  # a plain tensor: read
    uniform = RowLayout.uniform(3, "cpu", start=16)
    assert uniform.aligned(16) and not uniform.aligned(32) and torch.equal(uniform.starts, torch.full((3,), 16))
    assert not layout.aligned(1)  # rows start at different slots
    assert RowLayout.of(layout) is layout
    # the layout's range is what the kernels size their grids by: no read of the tensor
    assert ref.num_row_blocks(40, RowLayout(torch.tensor([7, 9]), 7, 9), 16) == 3
    with pytest.raises(ValueError, match="integer \\[batch\\]"):
        RowLayout(torch.zeros(2, 2, dtype=torch.long), 0, 0)
    with pytest.raises(ValueError, match="low <= high"):
        RowLayout(torch.tensor([1, 2]), 2, 1)


@pytest.mark.parametrize("softcap, sinks", [(5.0, False), (None, True), (2.0, True)])
@pytest.mark.parametrize("q_offset", [0, 60])
def test_softcap_and_sinks_equal_dense(softcap, sinks, q_offset):
    """Gemma 2's softcapping and GPT-OSS's sinks at full selection: a plain dense computation (float64) that caps
    the scaled scores before the mask and appends each head's sink logit as a column whose probability is
    dropped, as transformers' eager attention does."""
    torch.manual_seed(11)
    batch, q_heads, kv_heads, length, block = 3, 6, 2, 130, 16
    q = torch.randn(batch, q_heads, length - q_offset, 32) * 3
    k, v = torch.randn(batch, kv_heads, length, 32), torch.randn(batch, kv_heads, length, 24)
    kv_start = torch.tensor([0, 9, 30])
    sink_logits = torch.randn(q_heads) + 3.0 if sinks else None
    summaries = ref.block_summaries(k, None, kv_start, block)
    selection = ref.select_blocks(q, summaries, scale=32 ** -0.5, q_offset=q_offset, kv_start=kv_start,
                                  block_size=block, top_k=(1000, 1000), query_tile=32, head_union=False)
    out, lse = ref.sparse_attention(q, k, v, selection, scale=32 ** -0.5, q_offset=q_offset, kv_start=kv_start,
                                    softcap=softcap, sinks=sink_logits)
    group = q_heads // kv_heads
    keys, values = k.repeat_interleave(group, 1).double(), v.repeat_interleave(group, 1).double()
    slots, q_slot = torch.arange(length), q_offset + torch.arange(q.shape[2])
    visible = (slots[None, :] <= q_slot[:, None])[None] & (slots[None, None, :] >= kv_start[:, None, None])
    scores = q.double() @ keys.transpose(-1, -2) * 32 ** -0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    expected_lse = torch.logsumexp(scores, -1)
    if sinks:
        column = sink_logits.double()[None, :, None, None].expand(batch, -1, q.shape[2], 1)
        probs = torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1).nan_to_num(0.0)  # rows that see no key: zeros
    expected = probs @ values
    valid = (q_slot[None, :] >= kv_start[:, None])[:, None, :]
    torch.testing.assert_close(out.double() * valid[..., None], expected * valid[..., None], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double()[valid.expand_as(lse)], expected_lse[valid.expand_as(lse)], atol=1e-5,
                               rtol=1e-5)  # the lse of the real keys, without the sink
    assert (out[~valid.expand_as(lse)] == 0).all() and torch.isinf(lse[~valid.expand_as(lse)]).all()
    plain, _ = ref.sparse_attention(q, k, v, selection, scale=32 ** -0.5, q_offset=q_offset, kv_start=kv_start)
    assert not torch.allclose(out * valid[..., None], plain * valid[..., None], atol=1e-2)  # the features did something


def test_softcap_and_sinks_errors():
    q, k = torch.randn(1, 4, 20, 16), torch.randn(1, 2, 20, 16)
    selection = ref.select_blocks(q, ref.block_summaries(k, None, torch.zeros(1, dtype=torch.long), 16), scale=0.25,
                                  q_offset=0, kv_start=torch.zeros(1, dtype=torch.long), block_size=16, top_k=(2, 2),
                                  query_tile=16, head_union=False)
    args = dict(scale=0.25, q_offset=0, kv_start=torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="softcap .* positive finite number, got 0"):
        ref.sparse_attention(q, k, k, selection, softcap=0, **args)
    with pytest.raises(ValueError, match=r"sinks .* \[q_heads=4\] .* got torch.float32 \(2,\)"):
        ref.sparse_attention(q, k, k, selection, sinks=torch.zeros(2), **args)
    with pytest.raises(ValueError, match="softcap"):
        ref.antidiagonal_block_scores(q, k, softcap=-1.0, block_size=16, stride=4, **args)


@pytest.mark.parametrize("head_union, stride, q_offset", [(False, 1, 0), (True, 1, 0), (True, 4, 40)])
def test_selection_from_logits_equals_selection_from_their_summaries(head_union, stride, q_offset):
    """Block logits computed from summaries (``block_logits``) and handed to ``select_blocks_from_logits`` select what
    ``select_blocks`` selects from the summaries: the two share every step after the logits."""
    torch.manual_seed(3)
    batch, q_heads, kv_heads, dim, length, block = 2, 6, 2, 16, 150, 8
    num_queries = length - q_offset
    kv_start = torch.tensor([0, 23])
    num_blocks = ref.num_row_blocks(length, kv_start, block)
    query = torch.randn(batch, q_heads, num_queries, dim)
    summaries = torch.randn(batch, kv_heads, num_blocks, dim)
    kwargs = dict(q_offset=q_offset, kv_start=kv_start, block_size=block, top_k=(3, 4), query_tile=16,
                  head_union=head_union, key_length=length, query_stride=stride)
    everything = torch.ones(batch, num_queries, num_blocks, dtype=torch.bool)
    logits = ref.block_logits(query, summaries, 0.25, everything)
    from_logits = ref.select_blocks_from_logits(logits, kv_heads=kv_heads, **kwargs)
    from_summaries = ref.select_blocks(query, summaries, scale=0.25, **kwargs)
    assert torch.equal(from_logits.counts, from_summaries.counts)
    assert torch.equal(from_logits.indices, from_summaries.indices)
    assert (from_logits.counts < num_blocks).any()
    with pytest.raises(ValueError, match="kv_heads"):
        ref.select_blocks_from_logits(logits, kv_heads=4, **kwargs)


@pytest.mark.parametrize("num_queries, tile, stride", [(100, 16, 4), (100, 16, 5), (37, 64, 8), (64, 16, 16)])
def test_searching_queries_are_the_selections(num_queries, tile, stride):
    """``searching_queries`` lists (with the repeats at a tile's end) exactly the queries ``select_blocks`` searches
    for with ``query_stride``: the last of each group of the stride in a tile, each tile's last, the call's last."""
    listed = ref.searching_queries(num_queries, tile, stride)
    assert listed.numel() == -(-num_queries // tile) * -(-tile // stride)
    within = torch.arange(num_queries) % tile
    searching = (within % stride == stride - 1) | (within == tile - 1) | (torch.arange(num_queries) == num_queries - 1)
    assert set(listed.tolist()) == set(torch.nonzero(searching)[:, 0].tolist())
    assert (listed[1:] >= listed[:-1]).all()
