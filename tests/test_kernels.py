"""Each Triton op against its PyTorch reference on fresh random inputs.

Without CUDA the kernels run in Triton's CPU interpreter at small sizes (block size 16, a few blocks):
``TRITON_INTERPRET=1 pytest tests/test_kernels.py`` (triton reads the variable when first imported, so it
must be set for the process; without it and without CUDA this module skips). With CUDA the same tests run
compiled, and the ``gpu``-marked copies (``pytest -m gpu``) run them at real sizes (block 128, 4K tokens).
Outputs are poisoned (NaN, or -7 for indices) before every run so an element a kernel fails to write fails.
"""
from __future__ import annotations

import importlib
import math
import os
import zlib

import pytest
import torch

from hf_sparse import kernels
from hf_sparse.kernels import reference as ref
from hf_sparse.kernels._common import fixed_max
from hf_sparse.selection import BlockSelection

triton = pytest.importorskip("triton")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and not INTERPRETED
if not CUDA and not INTERPRETED:
    # triton decides when it is first imported (transformers imports it) whether to interpret.
    pytest.skip("the Triton kernels need CUDA or the interpreter: run `TRITON_INTERPRET=1 pytest tests/test_kernels.py`",
                allow_module_level=True)
DEVICE = "cuda" if CUDA else "cpu"

# The op modules (`hf_sparse.kernels.<op>` as an attribute is the dispatching function of the same name).
OPS = {name: importlib.import_module(f"hf_sparse.kernels.{name}")
       for name in ("block_summaries", "merge_lse", "select_blocks", "sparse_prefill", "sparse_decode",
                    "quantize_append", "append_kv", "decode_linear")}

# (size id, device, marks): "small" runs everywhere (interpreter on CPU), "large" only with `-m gpu` on CUDA.
SIZES = [
    pytest.param("small", id="small"),
    pytest.param("large", id="large", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]),
]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Relative error bound ||out - ref|| / ||ref|| per input dtype (the reference accumulates in float32 too).
REL_TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
# (batch, q_heads, kv_heads, head_dim, head_dim_v, dtype): batch 1/3, GQA 1/4/8, head dims 64/128, Dk != Dv.
SHAPES = [
    (1, 4, 4, 64, 64, "fp32"),
    (3, 8, 2, 128, 64, "bf16"),
    (1, 8, 1, 64, 128, "fp16"),
    (3, 4, 1, 128, 128, "fp32"),
    (3, 8, 8, 64, 64, "bf16"),
]


def seed(*parts) -> int:
    """A fixed seed per parametrization (str hashes change between runs)."""
    return zlib.crc32(repr(parts).encode())


def dims(size: str) -> dict:
    """Lengths that are not multiples of the block size, per size class."""
    if size == "small":
        return {"length": 83, "block": 16, "tile": 32, "chunk": 37}
    return {"length": 4096 + 77, "block": 128, "tile": 128, "chunk": 1000}


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    out, expected = out.double(), expected.double()
    return float((out - expected).norm() / expected.norm().clamp_min(1e-30))


def left_padding(batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """Per-row leading padding: row 0 none, the others random (up to a third of the length)."""
    pads = torch.randint(0, max(1, length // 3), (batch,), generator=generator)
    pads[0] = 0
    return pads


def bnsd(batch: int, heads: int, length: int, dim: int, dtype: torch.dtype, layout: str, generator) -> torch.Tensor:
    """A random BNSD tensor, stored as BNSD or as a transposed BSND buffer (non-contiguous view)."""
    if layout == "bsnd":
        data = torch.randn(batch, length, heads, dim, generator=generator).to(dtype)
        return data.to(DEVICE).transpose(1, 2)
    return torch.randn(batch, heads, length, dim, generator=generator).to(dtype).to(DEVICE)


def random_selection(batch, heads, tiles, num_blocks, block_size, query_tile, generator, density=0.5):
    """Random ascending selections, some rows empty."""
    mask = torch.rand(batch, heads, tiles, num_blocks, generator=generator) < density
    mask[0, 0, 0] = False  # an empty row: zeros and -inf
    selection = BlockSelection.from_mask(mask, block_size=block_size, query_tile=query_tile)
    return BlockSelection(selection.indices.to(DEVICE), selection.counts.to(DEVICE), block_size, query_tile)


def assert_attention_close(out, lse, expected_out, expected_lse, dtype):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "unwritten (NaN-poisoned) elements remain"
    assert rel_err(out, expected_out) <= REL_TOL[dtype], rel_err(out, expected_out)
    finite = torch.isfinite(expected_lse)
    assert torch.equal(finite, torch.isfinite(lse)), "log-sum-exp -inf pattern differs"
    torch.testing.assert_close(lse[finite], expected_lse[finite], atol=1e-3 if dtype != torch.float32 else 1e-4, rtol=1e-4)
    assert (out[~finite] == 0).all(), "queries that see no key must output zeros"


# -- block_summaries ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("batch, heads, dim, dtype, gated, layout", [
    (1, 2, 64, "fp32", False, "bnsd"),
    (3, 4, 128, "bf16", True, "bsnd"),
    (3, 1, 64, "fp16", True, "bnsd"),
    (1, 8, 128, "bf16", False, "bsnd"),
])
def test_block_summaries(size, batch, heads, dim, dtype, gated, layout):
    gen = torch.Generator().manual_seed(seed(batch, heads, dim, dtype, gated, layout))
    d = dims(size)
    length, block = d["length"], d["block"]
    keys = bnsd(batch, heads, length, dim, DTYPES[dtype], layout, gen)
    kv_start = left_padding(batch, length, gen).to(DEVICE)
    gate = torch.randn(heads, block, dim, generator=gen).to(DTYPES[dtype]).to(DEVICE) if gated else None
    expected = ref.block_summaries(keys, gate, kv_start, block)
    out = torch.full_like(expected, float("nan"))
    OPS["block_summaries"].block_summaries(keys, gate, kv_start, block, out=out)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)
    # the decode update: the last (partial) block only, no host read of kv_start
    nb = expected.shape[2]
    last = OPS["block_summaries"].block_summaries(keys, gate, kv_start, block, first_block=nb - 1, num_blocks=1)
    torch.testing.assert_close(last, expected[:, :, nb - 1:], atol=1e-4, rtol=1e-5)


# -- merge_lse ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("parts, dim, dtype", [(1, 64, "fp32"), (3, 128, "bf16"), (5, 80, "fp16")])
def test_merge_lse(size, parts, dim, dtype):
    gen = torch.Generator().manual_seed(parts * 1000 + dim)
    batch, heads, queries = (3, 4, 5) if size == "small" else (8, 32, 16)
    outputs = torch.randn(parts, batch, heads, queries, dim, generator=gen).to(DTYPES[dtype]).to(DEVICE)
    lses = (torch.randn(parts, batch, heads, queries, generator=gen) * 4).to(DEVICE)
    lses[0, 0, 0, 0] = float("-inf")  # one part unseen
    lses[:, 1 % batch, 0] = float("-inf")  # rows that saw nothing at all
    expected_out, expected_lse = ref.merge_lse(outputs, lses)
    # the merged output as a BSND view: strided rows
    out = torch.full((batch, queries, heads, dim), float("nan"), dtype=DTYPES[dtype], device=DEVICE).transpose(1, 2)
    out_lse = torch.full((batch, heads, queries), float("nan"), device=DEVICE)
    OPS["merge_lse"].merge_lse(outputs, lses, out=out, out_lse=out_lse)
    assert_attention_close(out, out_lse, expected_out, expected_lse, DTYPES[dtype])


# -- sparse attention: prefill kernel --------------------------------------------------------------------------
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows, q_offset_kind, layout", [
    ("q_heads", "prefill", "bnsd"),
    ("kv_heads", "chunk", "bsnd"),
])
def test_sparse_prefill(size, shape, rows, q_offset_kind, layout):
    batch, q_heads, kv_heads, dim, dim_v, dtype_name = shape
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed(shape, rows, q_offset_kind))
    d = dims(size)
    length, block, tile = d["length"], d["block"], d["tile"]
    # "chunk": a later chunk of a chunked prefill (q_offset > 0, Sq not a multiple of the tile)
    num_queries = length if q_offset_kind == "prefill" else d["chunk"]
    q_offset = length - num_queries
    query = bnsd(batch, q_heads, num_queries, dim, dtype, layout, gen)
    key = bnsd(batch, kv_heads, length, dim, dtype, layout, gen)
    value = bnsd(batch, kv_heads, length, dim_v, dtype, layout, gen)
    kv_start = left_padding(batch, length, gen).to(DEVICE)
    if q_offset_kind == "chunk":
        kv_start[-1] = min(length - 1, q_offset + 3)  # a row whose padding reaches into this chunk
    tiles = ref.num_query_tiles(num_queries, q_offset, kv_start, tile)
    num_blocks = ref.num_row_blocks(length, kv_start, block)
    selection = random_selection(batch, q_heads if rows == "q_heads" else kv_heads, tiles, num_blocks, block, tile, gen)
    scale = dim ** -0.5
    expected_out, expected_lse = ref.sparse_attention(query, key, value, selection, scale=scale, q_offset=q_offset,
                                                      kv_start=kv_start)
    out = torch.full((batch, q_heads, num_queries, dim_v), float("nan"), dtype=dtype, device=DEVICE)
    lse = torch.full((batch, q_heads, num_queries), float("nan"), device=DEVICE)
    OPS["sparse_prefill"].sparse_prefill(query, key, value, selection, scale=scale, q_offset=q_offset,
                                         kv_start=kv_start, out=out, lse=lse)
    assert_attention_close(out, lse, expected_out, expected_lse, dtype)



@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("shape", SHAPES[:3])
def test_sparse_prefill_one_tile_over_every_block_is_causal_attention(size, shape):
    """Star's phase 2 of a long query (``star_attention._all_blocks_attention``): the last ``Sq`` queries as one tile
    over every key block (``StarMethod.full_selection``), left-padded rows, equal exact causal attention written
    out in float64."""
    from hf_sparse.config import StarConfig
    from hf_sparse.methods.star import StarMethod

    batch, q_heads, kv_heads, dim, dim_v, dtype_name = shape
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed(shape, "one tile"))
    d = dims(size)
    length, block, num_queries = d["length"], d["block"], d["chunk"]
    q_offset = length - num_queries
    query = bnsd(batch, q_heads, num_queries, dim, dtype, "bnsd", gen)
    key = bnsd(batch, kv_heads, length, dim, dtype, "bsnd", gen)
    value = bnsd(batch, kv_heads, length, dim_v, dtype, "bsnd", gen)
    kv_start = left_padding(batch, length, gen).to(DEVICE)
    kv_start[-1] = q_offset + 5  # a row whose padding reaches into the query
    selection = StarMethod(StarConfig(block_size=block)).full_selection(batch, kv_heads, num_queries, length,
                                                                        torch.device(DEVICE))
    assert selection.num_query_tiles == 1 and selection.query_tile == num_queries
    out, _ = kernels.sparse_attention(query, key, value, selection, scale=dim ** -0.5, q_offset=q_offset,
                                      kv_start=kv_start)
    group = q_heads // kv_heads
    logits = query.double() @ key.double().repeat_interleave(group, 1).transpose(-1, -2) * dim ** -0.5
    q_slot = torch.arange(q_offset, length, device=DEVICE)
    k_slot = torch.arange(length, device=DEVICE)
    visible = (k_slot[None, None, :] <= q_slot[None, :, None]) & (k_slot[None, None, :] >= kv_start[:, None, None])
    real = q_slot[None, :] >= kv_start[:, None]  # [B, Sq]
    probs = torch.softmax(logits.masked_fill(~visible[:, None], float("-inf")), -1).nan_to_num()
    expected = probs @ value.double().repeat_interleave(group, 1)
    real_rows = real[:, None, :].expand(-1, q_heads, -1)
    assert rel_err(out[real_rows], expected[real_rows]) <= REL_TOL[dtype]
    assert (out[~real_rows] == 0).all()


@pytest.mark.parametrize("block, block_n", [(32, 16), (64, 16)])
@pytest.mark.parametrize("variant", ["plain", "chunk", "softcap", "int8"])
def test_sparse_prefill_several_key_tiles_per_block(block, block_n, variant, monkeypatch):
    """Launch settings whose key tile is shorter than the block (head dim 128 takes 64-key tiles of 128-token
    blocks): one tile per loop step, each block's tiles in order, the masked tiles past the length and on the
    diagonal included; the reference's result for plain, chunked, capped and int8 K/V prefill."""
    from hf_sparse.kernels import sparse_prefill

    monkeypatch.setattr(sparse_prefill, "launch_configs", lambda *args: [(64, block_n, 2)])
    batch, q_heads, kv_heads, dim, dim_v, dtype_name = SHAPES[1]
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed("tiles per block", block, block_n, variant))
    length = 150
    num_queries = 61 if variant == "chunk" else length
    q_offset = length - num_queries
    query = bnsd(batch, q_heads, num_queries, dim, dtype, "bnsd", gen) * 3
    key = bnsd(batch, kv_heads, length, dim, dtype, "bsnd", gen)
    value = bnsd(batch, kv_heads, length, dim_v, dtype, "bnsd", gen)
    kv_start = left_padding(batch, length, gen).to(DEVICE)
    tiles = ref.num_query_tiles(num_queries, q_offset, kv_start, 32)
    selection = random_selection(batch, kv_heads, tiles, ref.num_row_blocks(length, kv_start, block), block, 32, gen)
    extra = {"softcap": 5.0} if variant == "softcap" else {}
    if variant == "int8":
        (key, key_scale), (value, value_scale) = ref.quantize_per_token(key), ref.quantize_per_token(value)
        extra.update(key_scale=key_scale, value_scale=value_scale)
    expected_out, expected_lse = ref.sparse_attention(query, key, value, selection, scale=dim ** -0.5,
                                                      q_offset=q_offset, kv_start=kv_start, **extra)
    out, lse = sparse_prefill.sparse_prefill(query, key, value, selection, scale=dim ** -0.5, q_offset=q_offset,
                                             kv_start=kv_start, **extra)
    assert_attention_close(out, lse, expected_out, expected_lse, dtype)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
def test_sparse_prefill_three_heads_per_kv_head(size, dtype_name):
    """A selection per KV head whose rows serve three query heads (SmolLM2's GQA): with query tiles of 64 or more
    each program takes one head's queries (``program_heads``), not a third of the tile's queries of all three."""
    from hf_sparse.kernels.sparse_prefill import launch_settings, program_heads

    batch, q_heads, kv_heads, dim = 2, 6, 2, 64
    dtype = DTYPES[dtype_name]
    length, block, tile = (150, 16, 64) if size == "small" else (4096 + 77, 128, 128)
    assert program_heads(q_heads // kv_heads, tile, launch_settings(dim)["block_m"]) == 1
    gen = torch.Generator().manual_seed(seed("three heads", size, dtype_name))
    query = bnsd(batch, q_heads, length, dim, dtype, "bnsd", gen)
    key = bnsd(batch, kv_heads, length, dim, dtype, "bsnd", gen)
    value = bnsd(batch, kv_heads, length, dim, dtype, "bnsd", gen)
    kv_start = left_padding(batch, length, gen).to(DEVICE)
    tiles = ref.num_query_tiles(length, 0, kv_start, tile)
    selection = random_selection(batch, kv_heads, tiles, ref.num_row_blocks(length, kv_start, block), block, tile, gen)
    expected_out, expected_lse = ref.sparse_attention(query, key, value, selection, scale=dim ** -0.5, q_offset=0,
                                                      kv_start=kv_start)
    out, lse = OPS["sparse_prefill"].sparse_prefill(query, key, value, selection, scale=dim ** -0.5, q_offset=0,
                                                    kv_start=kv_start)
    assert_attention_close(out, lse, expected_out, expected_lse, dtype)


def test_program_heads():
    """Heads per program: the fewest rows computed per tile, then the most heads (they share K/V loads)."""
    from hf_sparse.kernels.sparse_prefill import program_heads

    assert program_heads(1, 128, 128) == 1
    assert program_heads(3, 128, 128) == 1   # 3 x 128 rows, not 4 programs of 3 x 42 queries (512 rows)
    assert program_heads(3, 16, 64) == 3     # one program of 48 queries' rows, not three programs of 16 (64 each)
    assert program_heads(4, 128, 128) == 4   # 4 x 32 queries fill 128 rows: as few rows, fewer K/V loads
    assert program_heads(8, 128, 128) == 8
    assert program_heads(6, 128, 128) == 2   # 2 x 64
    assert program_heads(5, 128, 64) == 1    # 5 heads x 16 rows do not fit 64


# -- sparse attention: decode kernel ---------------------------------------------------------------------------
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("num_queries, rows, splits", [(1, "kv_heads", None), (4, "kv_heads", 6), (2, "q_heads", 1)])
def test_sparse_decode(size, shape, num_queries, rows, splits):
    batch, q_heads, kv_heads, dim, dim_v, dtype_name = shape
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed(shape, num_queries, rows, splits))
    d = dims(size)
    length, block = d["length"], d["block"]
    q_offset = length - num_queries
    layout = "bsnd" if num_queries == 4 else "bnsd"
    query = bnsd(batch, q_heads, num_queries, dim, dtype, layout, gen)
    key = bnsd(batch, kv_heads, length, dim, dtype, layout, gen)
    value = bnsd(batch, kv_heads, length, dim_v, dtype, layout, gen)
    kv_start = left_padding(batch, length, gen).to(DEVICE)
    num_blocks = ref.num_row_blocks(length, kv_start, block)
    selection = random_selection(batch, kv_heads if rows == "kv_heads" else q_heads, 1, num_blocks, block,
                                 num_queries, gen, density=0.3)
    scale = dim ** -0.5
    expected_out, expected_lse = ref.sparse_attention(query, key, value, selection, scale=scale, q_offset=q_offset,
                                                      kv_start=kv_start)
    out = torch.full((batch, q_heads, num_queries, dim_v), float("nan"), dtype=dtype, device=DEVICE)
    lse = torch.full((batch, q_heads, num_queries), float("nan"), device=DEVICE)
    OPS["sparse_decode"].sparse_decode(query, key, value, selection, scale=scale, q_offset=q_offset,
                                       kv_start=kv_start, splits=splits, out=out, lse=lse)
    assert_attention_close(out, lse, expected_out, expected_lse, dtype)


# -- select_blocks ---------------------------------------------------------------------------------------------
def separated_problem(batch, q_heads, kv_heads, num_queries, dim, num_blocks, top_k, dtype, gen, two_level,
                      alibi=None, deep=False):
    """Queries and summaries whose block scores are far from every bisection point the search visits.

    Each query is a one-hot vector on a random channel; channel ``c`` of the summaries holds a logit profile
    over blocks: within the first ``top_k[1] + 1`` blocks (all visible to any query that searches at all),
    a "high" set of size in ``[left, right]`` (``exp(l - max)`` in [0.74, 1]) and otherwise low values
    (<= 0.15), so the search lands at its first step (f = 1/2). With ``two_level`` a top set smaller than
    ``left`` (>= 0.8) plus a middle set ([0.3, 0.45]) land at the second step (f = 1/4).

    With ``alibi = (slopes [Hq], block_size)`` the profiles are those of the biased logits: each query head
    reads its own share of the channels, whose summaries have the head's ALiBi bias at the block centres
    subtracted, so q . Kc * scale + bias is the profile plus one constant per query. A query's own block may
    get less bias than was subtracted (its centre past the query): the profile is set on the first
    ``top_k[1]`` blocks only, which precede the own block of every query that searches, and the own block
    stays low. All queries of a (batch, KV head) row read one profile (each head its share's copy), so that
    the tile and head unions do not hide a missing bias.

    With ``deep`` the top block (0) stands alone above ``-11.1`` (16 halvings of f): the rest of the high set
    lies in [-21, -20] and the low values in [-45, -40], so the first bisection never sees too many blocks and
    the second (between the row's lowest logit and -11.1) lands at its first cut, in [-28.1, -25.5].
    """
    left, right = top_k
    scale = dim ** -0.5
    logits = -2.0 - 3.0 * torch.rand(batch, kv_heads, num_blocks, dim, generator=gen)  # e <= 0.135
    if deep:
        logits = -40.0 - 5.0 * torch.rand(batch, kv_heads, num_blocks, dim, generator=gen)
    profiled = right if alibi is not None else right + 1
    for b in range(batch):
        for h in range(kv_heads):
            for c in range(dim):
                order = torch.randperm(profiled, generator=gen)
                if two_level:
                    top = int(torch.randint(1, left, (1,), generator=gen)) if left > 1 else 0
                    middle = int(torch.randint(left - top, right - top + 1, (1,), generator=gen))
                    logits[b, h, order[:top], c] = -0.2 * torch.rand(top, generator=gen)
                    logits[b, h, order[top:top + middle], c] = -0.8 - 0.4 * torch.rand(middle, generator=gen)
                    logits[b, h, order[top], c] = 0.0  # the maximum is in the high set
                else:
                    high = int(torch.randint(left, right + 1, (1,), generator=gen))
                    spread = -0.3 * torch.rand(high, generator=gen)
                    logits[b, h, order[:high], c] = spread - 20.0 if deep else spread
                    logits[b, h, order[0], c] = 0.0
    if alibi is None:
        channel = torch.randint(0, dim, (batch, q_heads, num_queries), generator=gen)
    else:
        slopes, block_size = alibi
        group = q_heads // kv_heads
        share = dim // group  # channels of each query head of a GQA group
        logits = logits[..., :share].repeat(1, 1, 1, group)
        channel_head = torch.arange(kv_heads)[:, None] * group + torch.arange(dim)[None, :] // share  # [Hkv, D]
        centre = torch.arange(num_blocks) * block_size + (block_size - 1) / 2  # from the row's first slot
        logits = logits - slopes.cpu()[channel_head][:, None, :] * centre[:, None]
        row_channel = torch.randint(0, share, (batch, kv_heads, 1), generator=gen).repeat_interleave(group, 1)
        channel = (torch.arange(q_heads) % group * share)[None, :, None] + row_channel.expand(-1, -1, num_queries)
    summaries = (logits / scale).to(DEVICE)
    query = torch.nn.functional.one_hot(channel, dim).to(dtype).to(DEVICE)
    return query, summaries, scale


def run_select(query, summaries, **kwargs):
    """The Triton selection into poisoned buffers, checked against the reference's format."""
    batch, q_heads, num_queries = query.shape[:3]
    heads = summaries.shape[1] if kwargs["head_union"] else q_heads
    tiles = ref.num_query_tiles(num_queries, kwargs["q_offset"], kwargs["kv_start"], kwargs["query_tile"])
    indices = torch.full((batch, heads, tiles, summaries.shape[2]), -7, dtype=torch.int32, device=DEVICE)
    counts = torch.full((batch, heads, tiles), -7, dtype=torch.int32, device=DEVICE)
    selection = OPS["select_blocks"].select_blocks(query, summaries, out=(indices, counts), **kwargs)
    assert selection.indices is indices and selection.counts is counts
    return selection


def slopes_for(q_heads: int, block: int, gen: torch.Generator | None = None) -> torch.Tensor:
    """Per-head slopes whose bias over one block spans 4 * 2^(-8 h / H) (the usual geometric ALiBi series, per
    block rather than per token: strong enough to change a selection at any block size), or with ``gen``
    random ones from 0.2 to 1.2 per block, small enough for the separated problems' precision."""
    if gen is None:
        return (4.0 * 2.0 ** (-8.0 * torch.arange(1, q_heads + 1) / q_heads) / block).to(DEVICE)
    return ((0.2 + torch.rand(q_heads, generator=gen)) / block).to(DEVICE)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
@pytest.mark.parametrize("phase, batch, q_heads, kv_heads, dim, dtype, two_level", [
    ("prefill", 1, 4, 4, 64, "fp32", False),
    ("prefill", 3, 8, 2, 128, "bf16", True),
    ("prefill_union", 3, 8, 1, 64, "fp16", False),
    ("decode_3q", 3, 8, 2, 128, "bf16", False),
    ("decode_1q", 1, 8, 1, 64, "fp32", True),
    ("decode_1q", 3, 4, 2, 64, "fp16", False),
])
def test_select_blocks_exact_on_separated_scores(size, alibi, phase, batch, q_heads, kv_heads, dim, dtype, two_level):
    """Prefill (several tiles, per head or united over GQA groups) and decode (1 or 3 queries, united), left
    padded: the same selection as the reference, with and without ALiBi slopes."""
    gen = torch.Generator().manual_seed(seed(phase, batch, q_heads, dim, two_level))
    d = dims(size)
    length, block, tile = d["length"], d["block"], d["tile"]
    if alibi and size == "small":
        block = 8  # 11 blocks: most queries search, so a missing bias would show
    top_k = (3, 5) if size == "small" else (8, 12)
    num_queries = length if phase.startswith("prefill") else int(phase[-2])
    q_offset = length - num_queries
    kv_start = left_padding(batch, length, gen).to(DEVICE)
    num_blocks = ref.num_row_blocks(length, kv_start, block)
    slopes = slopes_for(q_heads, block, gen) if alibi else None
    query, summaries, scale = separated_problem(batch, q_heads, kv_heads, num_queries, dim, num_blocks, top_k,
                                                DTYPES[dtype], gen, two_level, (slopes, block) if alibi else None)
    kwargs = dict(scale=scale, q_offset=q_offset, kv_start=kv_start, block_size=block, top_k=top_k,
                  query_tile=tile if phase.startswith("prefill") else num_queries, head_union=phase != "prefill",
                  sink_blocks=1 if size == "small" else 2, key_length=length, alibi_slopes=slopes)
    expected = ref.select_blocks(query, summaries, **kwargs)
    selection = run_select(query, summaries, **kwargs)
    assert torch.equal(selection.counts, expected.counts)
    assert torch.equal(selection.indices, expected.indices)
    assert (selection.counts > 0).any()
    if alibi:  # the bias really changed the selection (of single queries: tile unions may hide it)
        single = {**kwargs, "query_tile": 1, "head_union": False}
        biased = ref.select_blocks(query, summaries, **single).to_mask(num_blocks)
        unbiased = ref.select_blocks(query, summaries, **{**single, "alibi_slopes": None}).to_mask(num_blocks)
        assert not torch.equal(unbiased, biased)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("phase, batch, q_heads, kv_heads, dim, dtype", [
    ("prefill", 2, 4, 2, 64, "bf16"),
    ("prefill_union", 1, 8, 1, 128, "fp32"),
    ("decode_1q", 3, 8, 2, 64, "fp16"),
])
def test_select_blocks_exact_when_the_top_k_sits_deep(size, phase, batch, q_heads, kv_heads, dim, dtype):
    """Rows whose ``top_k[0]``-th block lies 20 nats under their best (a sharp head) land in ``top_k`` through
    the second bisection, as in the reference, instead of selecting every block."""
    gen = torch.Generator().manual_seed(seed("deep", phase, batch, q_heads, dim))
    d = dims(size)
    length, block, tile = d["length"], d["block"], d["tile"]
    if size == "small":
        block = 4  # 21 blocks, most of them past the profile
    top_k = (3, 5) if size == "small" else (8, 12)
    num_queries = length if phase.startswith("prefill") else int(phase[-2])
    kv_start = left_padding(batch, length, gen).to(DEVICE)
    num_blocks = ref.num_row_blocks(length, kv_start, block)
    query, summaries, scale = separated_problem(batch, q_heads, kv_heads, num_queries, dim, num_blocks, top_k,
                                                DTYPES[dtype], gen, False, deep=True)
    kwargs = dict(scale=scale, q_offset=length - num_queries, kv_start=kv_start, block_size=block, top_k=top_k,
                  query_tile=tile if phase.startswith("prefill") else num_queries, head_union=phase != "prefill",
                  sink_blocks=1, key_length=length)
    expected = ref.select_blocks(query, summaries, **kwargs)
    selection = run_select(query, summaries, **kwargs)
    assert torch.equal(selection.counts, expected.counts)
    assert torch.equal(selection.indices, expected.indices)
    # single queries that search choose top_k blocks (+ forced ones), far from all they could see
    single = ref.select_blocks(query, summaries, **{**kwargs, "query_tile": 1, "head_union": False})
    searched = single.counts[..., -1]
    assert (searched <= top_k[1] + 2).all() and num_blocks > 2 * (top_k[1] + 2)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("stride", [3, 8, 1000])
@pytest.mark.parametrize("phase, batch, q_heads, kv_heads, dim, dtype", [
    ("prefill", 3, 4, 2, 64, "bf16"),
    ("prefill_union", 2, 8, 2, 128, "fp32"),
])
def test_select_blocks_query_stride(size, stride, phase, batch, q_heads, kv_heads, dim, dtype):
    """With ``query_stride`` only every stride-th query of a tile (and its last) searches, past the tile's length
    its last only; the others add their own blocks: the kernel equals the reference, a subset of the selection
    without a stride (a strict one per head at the small size), and every query's own block is in its tile's
    selection."""
    gen = torch.Generator().manual_seed(seed("stride", stride, phase, batch, q_heads, dim))
    d = dims(size)
    length, block, tile = d["length"], d["block"], d["tile"]
    if size == "small":
        block = 4  # 21 blocks; tiles of 32 span 8: the skipped queries' own blocks matter
    top_k = (2, 3) if size == "small" else (8, 12)
    kv_start = left_padding(batch, length, gen).to(DEVICE)
    num_blocks = ref.num_row_blocks(length, kv_start, block)
    # Two exact logit levels (no cut falls near a logit in any precision): per channel, top_k[0] blocks anywhere
    # in the row at 0, the rest at -4; each query reads one channel, so queries choose different blocks.
    high = torch.rand(batch, kv_heads, dim, num_blocks, generator=gen).argsort(-1)[..., : top_k[0]]
    logits = torch.full((batch, kv_heads, dim, num_blocks), -4.0).scatter_(-1, high, 0.0).transpose(2, 3)
    scale = 0.5
    summaries = (logits / scale).to(DEVICE)
    channel = torch.randint(0, dim, (batch, q_heads, length), generator=gen)
    query = torch.nn.functional.one_hot(channel, dim).to(DTYPES[dtype]).to(DEVICE)
    kwargs = dict(scale=scale, q_offset=0, kv_start=kv_start, block_size=block, top_k=top_k, query_tile=tile,
                  head_union=phase != "prefill", sink_blocks=1, key_length=length, query_stride=stride)
    expected = ref.select_blocks(query, summaries, **kwargs)
    selection = run_select(query, summaries, **kwargs)
    assert torch.equal(selection.counts, expected.counts)
    assert torch.equal(selection.indices, expected.indices)
    every = ref.select_blocks(query, summaries, **{**kwargs, "query_stride": 1})
    mask = expected.to_mask(num_blocks)  # [B, H, tiles, nb]
    every_mask = every.to_mask(num_blocks)
    assert not (mask & ~every_mask).any()
    # Per head and small, the skipped queries' blocks are missed. United over heads, or over the 33 blocks a large
    # tile sees, the searching queries' channels cover the row as every query's do.
    assert phase == "prefill_union" or size == "large" or not torch.equal(mask, every_mask)
    for b in range(batch):
        pad = int(kv_start[b])
        for q in range(pad, length):
            assert mask[b, :, (q - pad) // tile, (q - pad) // block].all()
    with pytest.raises(ValueError, match="query_stride"):
        ref.select_blocks(query, summaries, **{**kwargs, "query_stride": 0})


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("phase, batch, q_heads, kv_heads, stride", [
    ("prefill", 1, 4, 4, 1), ("prefill_union", 3, 8, 2, 1), ("chunk_union", 3, 6, 2, 1), ("prefill", 2, 4, 2, 3),
    ("chunk_union", 2, 8, 1, 8),
])
def test_select_blocks_from_logits(size, phase, batch, q_heads, kv_heads, stride):
    """Given block logits (e.g. a key scorer's; a transposed, non-contiguous view), the selection kernel equals the
    reference: prefill and a later chunk (q_offset > 0), per head or united over GQA groups, with a query stride,
    left padding. Three exact logit levels, so no cut falls near a logit in any arithmetic."""
    gen = torch.Generator().manual_seed(seed("from logits", phase, batch, q_heads, stride))
    d = dims(size)
    length, block, tile = d["length"], d["block"], d["tile"]
    if size == "small":
        block = 4  # 21 blocks
    top_k = (2, 3) if size == "small" else (8, 12)
    num_queries = length if phase.startswith("prefill") else d["chunk"]
    q_offset = length - num_queries
    kv_start = left_padding(batch, length, gen).to(DEVICE)
    num_blocks = ref.num_row_blocks(length, kv_start, block)
    levels = torch.tensor([0.0, -4.0, -8.0])
    logits = levels[torch.randint(0, 3, (batch, q_heads, num_blocks, num_queries), generator=gen)]
    logits = logits.to(DEVICE).transpose(2, 3)  # [B, Hq, Sq, nb], block-major in memory
    kwargs = dict(kv_heads=kv_heads, q_offset=q_offset, kv_start=kv_start, block_size=block, top_k=top_k,
                  query_tile=tile, head_union=phase.endswith("union"), sink_blocks=1, key_length=length,
                  query_stride=stride)
    expected = ref.select_blocks_from_logits(logits, **kwargs)
    selection = kernels.select_blocks_from_logits(logits, **kwargs)
    assert torch.equal(selection.counts, expected.counts)
    assert torch.equal(selection.indices, expected.indices)
    assert (expected.counts > 0).any() and (expected.counts < num_blocks).any()
    if stride > 1:  # only the searching queries' rows (unpadded): the same selection
        kv_start.zero_()
        expected = ref.select_blocks_from_logits(logits, **kwargs)
        rows = ref.searching_queries(num_queries, tile, stride).to(DEVICE)
        compact = logits[:, :, rows]
        assert compact.shape[2] < num_queries
        for op in (ref.select_blocks_from_logits, kernels.select_blocks_from_logits):
            got = op(compact, num_queries=num_queries, **kwargs)
            assert torch.equal(got.counts, expected.counts) and torch.equal(got.indices, expected.indices)
        with pytest.raises(ValueError, match="searching queries"):
            kernels.select_blocks_from_logits(compact[:, :, 1:], num_queries=num_queries, **kwargs)


@pytest.mark.parametrize("dtype, num_queries", [("bf16", 1), ("fp32", 3)])
def test_decode_select_spans_several_block_chunks(dtype, num_queries):
    """A decode row of 150-odd blocks: its logits come from several programs, the last of which selects."""
    gen = torch.Generator().manual_seed(seed("chunks", dtype, num_queries))
    batch, q_heads, kv_heads, dim, block, top_k = 2, 4, 2, 32, 4, (5, 8)
    length = 611
    kv_start = torch.tensor([0, 9], device=DEVICE)
    num_blocks = ref.num_row_blocks(length, kv_start, block)
    query, summaries, scale = separated_problem(batch, q_heads, kv_heads, num_queries, dim, num_blocks, top_k,
                                                DTYPES[dtype], gen, False)
    kwargs = dict(scale=scale, q_offset=length - num_queries, kv_start=kv_start, block_size=block, top_k=top_k,
                  query_tile=num_queries, head_union=True, sink_blocks=1, key_length=length)
    expected = ref.select_blocks(query, summaries, **kwargs)
    for _ in range(2):  # the second call finds the ticket counters reset by the first
        selection = run_select(query, summaries, **kwargs)
        assert torch.equal(selection.counts, expected.counts)
        assert torch.equal(selection.indices, expected.indices)
    assert num_blocks > 128 and (expected.counts > top_k[0]).all()


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
@pytest.mark.parametrize("phase, batch, q_heads, kv_heads, dim, dtype", [
    ("prefill", 3, 8, 2, 128, "bf16"),
    ("prefill", 1, 8, 1, 64, "fp32"),
    ("decode", 3, 8, 2, 64, "fp16"),
])
def test_select_blocks_random_scores_bounded_mismatch(size, alibi, phase, batch, q_heads, kv_heads, dim, dtype):
    """Random scores (with and without ALiBi slopes): selections may differ only where a score sits within
    rounding of a bisection point."""
    gen = torch.Generator().manual_seed(seed(phase, batch, q_heads, dim, dtype))
    d = dims(size)
    length, block, tile = d["length"], d["block"], d["tile"]
    top_k = (2, 3) if size == "small" else (6, 10)
    num_queries = length if phase == "prefill" else 1
    query = torch.randn(batch, q_heads, num_queries, dim, generator=gen).to(DTYPES[dtype]).to(DEVICE)
    keys = torch.randn(batch, kv_heads, length, dim, generator=gen).to(DEVICE)
    kv_start = left_padding(batch, length, gen).to(DEVICE)
    summaries = ref.block_summaries(keys, None, kv_start, block) * 4.0  # spread the scores
    kwargs = dict(scale=dim ** -0.5, q_offset=length - num_queries, kv_start=kv_start, block_size=block,
                  top_k=top_k, query_tile=tile if phase == "prefill" else 1, head_union=phase == "decode",
                  key_length=length, alibi_slopes=slopes_for(q_heads, block) if alibi else None)
    num_blocks = summaries.shape[2]
    expected = ref.select_blocks(query, summaries, **kwargs).to_mask(num_blocks)
    if alibi:  # the bias really changed the selection
        assert not torch.equal(ref.select_blocks(query, summaries, **{**kwargs, "alibi_slopes": None}).to_mask(num_blocks),
                               expected)
    selection = run_select(query, summaries, **kwargs)
    got = selection.to_mask(num_blocks)
    # format: ascending ids, -1 padding, counts agree with the ids
    width = torch.arange(num_blocks, device=DEVICE)
    valid = width < selection.counts[..., None]
    assert (selection.indices[~valid] == -1).all() and (selection.indices[valid] >= 0).all()
    ids = selection.indices.masked_fill(~valid, num_blocks).double()
    assert (ids[..., 1:] > ids[..., :-1]).logical_or(~valid[..., 1:]).all()
    differing = (got ^ expected).sum().item()
    union = (got | expected).sum().item()
    bound = 0.02 if DEVICE == "cpu" else 0.1
    assert union > 0 and differing / union <= bound, f"{differing} of {union} selected blocks differ"


# -- dispatch ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_queries", [3, 70])
def test_dispatch_runs_triton_and_matches_reference(monkeypatch, num_queries):
    monkeypatch.setenv("HF_SPARSE_BACKEND", "triton")
    gen = torch.Generator().manual_seed(num_queries)
    length, block = 83, 16
    query = torch.randn(2, 4, num_queries, 32, generator=gen).to(DEVICE)
    key = torch.randn(2, 2, length, 32, generator=gen).to(DEVICE)
    value = torch.randn(2, 2, length, 32, generator=gen).to(DEVICE)
    kv_start = torch.tensor([0, 5], device=DEVICE)
    assert kernels.backend_for(query) == "triton"
    summaries = kernels.block_summaries(key, None, kv_start, block)
    torch.testing.assert_close(summaries, ref.block_summaries(key, None, kv_start, block), atol=1e-4, rtol=1e-5)
    kwargs = dict(scale=32 ** -0.5, q_offset=length - num_queries, kv_start=kv_start, block_size=block,
                  top_k=(1000, 1000), query_tile=num_queries if num_queries < 16 else 32,
                  head_union=num_queries < 16)
    selection = kernels.select_blocks(query, summaries, **kwargs)
    expected = ref.select_blocks(query, summaries, **kwargs)
    assert torch.equal(selection.indices, expected.indices)
    out, lse = kernels.sparse_attention(query, key, value, selection, scale=kwargs["scale"],
                                        q_offset=kwargs["q_offset"], kv_start=kv_start)
    expected_out, expected_lse = ref.sparse_attention(query, key, value, expected, scale=kwargs["scale"],
                                                      q_offset=kwargs["q_offset"], kv_start=kv_start)
    assert_attention_close(out, lse, expected_out, expected_lse, torch.float32)
    merged, merged_lse = kernels.merge_lse(torch.stack([out, out]), torch.stack([lse, lse]))
    torch.testing.assert_close(merged, out, atol=1e-5, rtol=1e-5)
    finite = torch.isfinite(lse)
    torch.testing.assert_close(merged_lse[finite], lse[finite] + math.log(2), atol=1e-5, rtol=1e-5)


# -- sparse attention features: logN scaling, per-request skip, int8 K/V ----------------------------------------
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("op, num_queries, splits", [("sparse_prefill", None, None), ("sparse_prefill", "chunk", None),
                                                     ("sparse_decode", 1, None), ("sparse_decode", 3, 2),
                                                     ("sparse_decode", 1, 1)])
@pytest.mark.parametrize("logn, skip_rows, int8, alibi", [(True, False, False, False), (False, True, False, False),
                                                          (False, False, True, False), (False, False, False, True),
                                                          (True, True, True, True)])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[3], (3, 8, 2, 64, 128, "fp16")])
def test_sparse_attention_features(size, op, num_queries, splits, logn, skip_rows, int8, alibi, shape):
    """logN-scaled scores (per query position); skipped rows, whose poisoned outputs must stay poisoned; int8
    K/V with per-token scales, dequantised in the kernel, against the reference on the dequantised values;
    ALiBi bias from per-head slopes."""
    batch, q_heads, kv_heads, dim, dim_v, dtype_name = shape
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed(op, num_queries, splits, logn, skip_rows, int8, alibi, shape))
    d = dims(size)
    length, block = d["length"], d["block"]
    num_queries = {None: length, "chunk": d["chunk"]}.get(num_queries, num_queries)
    q_offset = length - num_queries
    decode = op == "sparse_decode"
    query = bnsd(batch, q_heads, num_queries, dim, dtype, "bnsd", gen) * 2  # sharper softmax: scaling shows
    key = bnsd(batch, kv_heads, length, dim, dtype, "bsnd", gen)
    value = bnsd(batch, kv_heads, length, dim_v, dtype, "bnsd", gen)
    kv_start = left_padding(batch, length, gen).to(DEVICE)
    tile = num_queries if decode else d["tile"]
    tiles = ref.num_query_tiles(num_queries, q_offset, kv_start, tile)
    num_blocks = ref.num_row_blocks(length, kv_start, block)
    selection = random_selection(batch, kv_heads, tiles, num_blocks, block, tile, gen, density=0.4)
    # logn_base below the lengths so that most positions are scaled (m = 16 tokens small, 1024 large)
    logn_base = (16 if size == "small" else 1024) if logn else None
    skip = torch.tensor([i % 2 == 1 for i in range(batch)], device=DEVICE) if skip_rows else None
    scale = dim ** -0.5
    extra = {"splits": splits} if decode else {}
    if alibi:  # the usual geometric slopes 2^(-8 h / H), steeper for small lengths so the bias matters
        extra["alibi_slopes"] = (2.0 ** (-8.0 * torch.arange(1, q_heads + 1) / q_heads) * (4 if size == "small" else 1)).to(DEVICE)
    if int8:
        (key, key_scale), (value, value_scale) = ref.quantize_per_token(key), ref.quantize_per_token(value)
        extra.update(key_scale=key_scale, value_scale=value_scale)
        dequantized = (ref.dequantize_per_token(key, key_scale), ref.dequantize_per_token(value, value_scale))
    expected_out, expected_lse = ref.sparse_attention(query, key, value, selection, scale=scale, q_offset=q_offset,
                                                      kv_start=kv_start, logn_base=logn_base,
                                                      **{k: v for k, v in extra.items() if k != "splits"})
    if int8:  # the reference's int8 path is attention on the dequantised values
        dense_out, dense_lse = ref.sparse_attention(query, *dequantized, selection, scale=scale, q_offset=q_offset,
                                                    kv_start=kv_start, logn_base=logn_base,
                                                    alibi_slopes=extra.get("alibi_slopes"))
        torch.testing.assert_close(expected_out, dense_out)
        torch.testing.assert_close(expected_lse, dense_lse)
    out = torch.full((batch, q_heads, num_queries, dim_v), float("nan"), dtype=dtype, device=DEVICE)
    lse = torch.full((batch, q_heads, num_queries), float("nan"), device=DEVICE)
    getattr(OPS[op], op)(query, key, value, selection, scale=scale, q_offset=q_offset, kv_start=kv_start,
                         logn_base=logn_base, skip=skip, out=out, lse=lse, **extra)
    run = ~skip if skip is not None else torch.ones(batch, dtype=torch.bool, device=DEVICE)
    assert torch.isnan(out[~run]).all() and torch.isnan(lse[~run]).all(), "a skipped row was written"
    assert_attention_close(out[run], lse[run], expected_out[run], expected_lse[run], dtype)
    if logn:  # the reference really scaled: plain attention differs
        plain, _ = ref.sparse_attention(query, key, value, selection, scale=scale, q_offset=q_offset, kv_start=kv_start,
                                        **{k: v for k, v in extra.items() if k != "splits"})
        assert rel_err(plain[run], expected_out[run]) > 3 * REL_TOL[dtype]
    if alibi:  # the bias really changed the result
        plain, _ = ref.sparse_attention(query, key, value, selection, scale=scale, q_offset=q_offset, kv_start=kv_start,
                                        logn_base=logn_base, **{k: v for k, v in extra.items() if k not in ("splits", "alibi_slopes")})
        assert rel_err(plain[run], expected_out[run]) > 3 * REL_TOL[dtype]


# -- sparse attention: softcapping (Gemma 2) and attention sinks (GPT-OSS) ---------------------------------------
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("op, num_queries, splits", [("sparse_prefill", None, None), ("sparse_prefill", "chunk", None),
                                                     ("sparse_decode", 1, None), ("sparse_decode", 3, 2),
                                                     ("sparse_decode", 1, 1)])
@pytest.mark.parametrize("softcap, sinks, others", [(50.0, False, False), (5.0, False, False), (100.0, False, False),
                                                    (None, True, False), (5.0, True, True), (50.0, False, "int8")],
                         ids=["softcap50", "softcap5", "softcap100-running-max", "sinks",
                              "softcap5-sinks-logn-skip-int8-alibi", "softcap50-int8"])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1], (3, 8, 1, 64, 80, "fp32")])
def test_softcap_and_sinks(size, op, num_queries, splits, softcap, sinks, others, shape):
    """Scores capped in the inner loop (``softcap * tanh(s / softcap)`` of the natural-log score), outputs rescaled
    by one sink logit per query head (after the split decode's merge): the reference's result, alone, with int8 K/V,
    and with logN, skipped rows, int8 K/V and ALiBi; with cap 5 and with sinks the result really differs from plain
    attention."""
    batch, q_heads, kv_heads, dim, dim_v, dtype_name = shape
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed("softcap-sinks", op, num_queries, splits, softcap, sinks, others, shape))
    d = dims(size)
    length, block = d["length"], d["block"]
    num_queries = {None: length, "chunk": d["chunk"]}.get(num_queries, num_queries)
    q_offset = length - num_queries
    decode = op == "sparse_decode"
    query = bnsd(batch, q_heads, num_queries, dim, dtype, "bnsd", gen) * 3  # scores of several units: the cap bites
    key = bnsd(batch, kv_heads, length, dim, dtype, "bsnd", gen)
    value = bnsd(batch, kv_heads, length, dim_v, dtype, "bnsd", gen)
    kv_start = left_padding(batch, length, gen).to(DEVICE)
    tile = num_queries if decode else d["tile"]
    tiles = ref.num_query_tiles(num_queries, q_offset, kv_start, tile)
    selection = random_selection(batch, kv_heads, tiles, ref.num_row_blocks(length, kv_start, block), block, tile, gen,
                                 density=0.4)
    extra = {"softcap": softcap}
    skip = None
    if others:  # int8 K/V ("int8": alone, with the constant maximum of capped scores)
        (key, key_scale), (value, value_scale) = ref.quantize_per_token(key), ref.quantize_per_token(value)
        extra.update(key_scale=key_scale, value_scale=value_scale)
    if others is True:
        skip = torch.tensor([i % 2 == 1 for i in range(batch)], device=DEVICE)
        extra.update(logn_base=16 if size == "small" else 1024,
                     alibi_slopes=(2.0 ** (-8.0 * torch.arange(1, q_heads + 1) / q_heads)).to(DEVICE))
    scale = dim ** -0.5
    if sinks:  # logits about each head's median log-sum-exp over the keys, so that the sinks take a real share
        _, plain_lse = ref.sparse_attention(query, key, value, selection, scale=scale, q_offset=q_offset,
                                            kv_start=kv_start, **extra)
        median = plain_lse.masked_fill(~torch.isfinite(plain_lse), float("nan")).transpose(0, 1).flatten(1).nanmedian(1)
        extra["sinks"] = median.values.nan_to_num(0.0) + torch.randn(q_heads, generator=gen).to(DEVICE)
    expected_out, expected_lse = ref.sparse_attention(query, key, value, selection, scale=scale, q_offset=q_offset,
                                                      kv_start=kv_start, **extra)
    out = torch.full((batch, q_heads, num_queries, dim_v), float("nan"), dtype=dtype, device=DEVICE)
    lse = torch.full((batch, q_heads, num_queries), float("nan"), device=DEVICE)
    getattr(OPS[op], op)(query, key, value, selection, scale=scale, q_offset=q_offset, kv_start=kv_start, skip=skip,
                         out=out, lse=lse, **extra, **({"splits": splits} if decode else {}))
    run = ~skip if skip is not None else torch.ones(batch, dtype=torch.bool, device=DEVICE)
    assert torch.isnan(out[~run]).all() and torch.isnan(lse[~run]).all(), "a skipped row was written"
    assert_attention_close(out[run], lse[run], expected_out[run], expected_lse[run], dtype)
    for name in ("softcap", "sinks"):
        if name == "sinks" and sinks or name == "softcap" and softcap == 5.0:  # the feature really changed the result
            plain, plain_lse = ref.sparse_attention(query, key, value, selection, scale=scale, q_offset=q_offset,
                                                    kv_start=kv_start, **{**extra, name: None})
            assert rel_err(plain[run], expected_out[run]) > 3 * REL_TOL[dtype]
            if name == "sinks":  # the lse stays that of the real keys
                torch.testing.assert_close(plain_lse, expected_lse, rtol=0, atol=0)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("op, num_queries, splits", [("sparse_prefill", None, None), ("sparse_decode", 1, 2)])
@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
@pytest.mark.parametrize("ends", ["both", "low"])
def test_capped_scores_at_the_caps_ends_keep_the_constant_maximum_exact(size, op, num_queries, splits, dtype_name,
                                                                        ends):
    """Softcap 50 (a constant in place of the running maximum, ``_common.fixed_max``) with every score saturated:
    at both ends of the cap, and a row whose every score is near ``-cap`` (its largest term ``2^-80``, still a
    normal float): the reference's result."""
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed("softcap-ends", op, dtype_name, ends))
    d = dims(size)
    length, block = d["length"], d["block"]
    num_queries = num_queries or length
    q_offset = length - num_queries
    batch, q_heads, kv_heads, dim = 2, 4, 2, 64
    key = bnsd(batch, kv_heads, length, dim, torch.float32, "bnsd", gen)
    if ends == "low":  # one shared key direction (plus noise) and queries pointing away from it
        direction = torch.randn(dim, generator=gen)
        key = direction.to(DEVICE) + 0.05 * key
        query = -300.0 * direction.expand(batch, q_heads, num_queries, dim).to(DEVICE)
    else:
        query = 300.0 * bnsd(batch, q_heads, num_queries, dim, torch.float32, "bnsd", gen)
    query, key = query.to(dtype), key.to(dtype)
    value = bnsd(batch, kv_heads, length, dim, dtype, "bnsd", gen)
    assert fixed_max(50.0, query, None)
    kv_start = left_padding(batch, length, gen).to(DEVICE)
    tile = num_queries if op == "sparse_decode" else d["tile"]
    tiles = ref.num_query_tiles(num_queries, q_offset, kv_start, tile)
    selection = random_selection(batch, kv_heads, tiles, ref.num_row_blocks(length, kv_start, block), block, tile, gen,
                                 density=0.6)
    args = dict(scale=dim ** -0.5, q_offset=q_offset, kv_start=kv_start, softcap=50.0)
    expected_out, expected_lse = ref.sparse_attention(query, key, value, selection, **args)
    finite = torch.isfinite(expected_lse)
    if ends == "low":  # every score really is near -cap
        assert (expected_lse[finite] < -40.0).all()
    out, lse = getattr(OPS[op], op)(query, key, value, selection, **args,
                                    **({"splits": splits} if op == "sparse_decode" else {}))
    assert_attention_close(out, lse, expected_out, expected_lse, dtype)


def test_fixed_maximum_only_where_the_cap_bounds_every_term():
    """The constant maximum needs a cap of at most ``FIXED_MAX_CAP`` (base 2), no ALiBi bias after the cap and
    probabilities of float32's range (not float16)."""
    bf16, fp16, fp32 = (torch.zeros(1, dtype=dtype) for dtype in (torch.bfloat16, torch.float16, torch.float32))
    assert fixed_max(50.0, bf16, None) and fixed_max(50.0, fp32, None) and fixed_max(1e-3, bf16, None)
    assert not fixed_max(None, bf16, None)
    assert not fixed_max(50.0, fp16, None)
    assert not fixed_max(50.0, bf16, torch.ones(4))
    assert not fixed_max(57.0, bf16, None) and fixed_max(56.8, bf16, None)


def test_softcap_and_sinks_errors():
    """A softcap that is not a positive number and sinks that are not one float per query head get a clear error,
    in the kernels and the reference."""
    query, key, value = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    selection = BlockSelection(torch.zeros(1, 2, 1, 3, dtype=torch.int32), torch.ones(1, 2, 1, dtype=torch.int32),
                               16, 1)
    args = dict(scale=0.25, q_offset=39, kv_start=torch.zeros(1, dtype=torch.int64))
    for op in (ref.sparse_attention, OPS["sparse_decode"].sparse_decode, OPS["sparse_prefill"].sparse_prefill):
        for softcap in (0.0, -1.0, float("inf"), True):
            with pytest.raises(ValueError, match="softcap"):
                op(query, key, value, selection, softcap=softcap, **args)
        for sinks in (torch.zeros(2), torch.zeros(1, 4), torch.zeros(4, dtype=torch.int64)):
            with pytest.raises(ValueError, match="sinks"):
                op(query, key, value, selection, sinks=sinks, **args)


def test_compiled_attention_refuses_blocks_under_16(monkeypatch):
    """Compiled Triton dots need tiles of 16 keys: a selection of smaller blocks gets an error that says so (the
    interpreter, which the small tests use, takes any block)."""
    from hf_sparse.kernels import _common

    query, key, value = (torch.randn(*shape, device=DEVICE) for shape in ((1, 4, 1, 16), (1, 2, 40, 16), (1, 2, 40, 16)))
    selection = BlockSelection(torch.zeros(1, 2, 1, 3, dtype=torch.int32, device=DEVICE),
                               torch.ones(1, 2, 1, dtype=torch.int32, device=DEVICE), 4, 1)
    args = dict(scale=0.25, q_offset=39, kv_start=torch.zeros(1, dtype=torch.int64, device=DEVICE))
    monkeypatch.setattr(_common, "interpreting", lambda: False)
    for op in (OPS["sparse_decode"].sparse_decode, OPS["sparse_prefill"].sparse_prefill):
        with pytest.raises(ValueError, match="blocks of at least 16 tokens.*block_size 4"):
            op(query, key, value, selection, **args)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("op, num_queries", [("sparse_prefill", None), ("sparse_decode", 1), ("sparse_decode", 3)])
@pytest.mark.parametrize("padding", ["none", "shared", "rows"])
@pytest.mark.parametrize("storage_block", [1, 2])
@pytest.mark.parametrize("shape", [SHAPES[2], (3, 8, 2, 128, 64, "bf16")])
def test_blocked_int8_values(size, op, num_queries, padding, storage_block, shape):
    """int8 values stored blocked (the int8 cache's layout, ``reference.blocked_values``), storage blocks of one
    or two selection blocks: the same result as token-major values, with rows that start at one multiple of the
    tile (no padding, or the same padding in every row: contiguous loads) or at any slot (per-slot addresses)."""
    batch, q_heads, kv_heads, dim, dim_v, dtype_name = shape
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed("blocked", op, num_queries, padding, storage_block, shape))
    d = dims(size)
    length, block = d["length"], d["block"]
    num_queries = length if num_queries is None else num_queries
    q_offset = length - num_queries
    decode = op == "sparse_decode"
    query = bnsd(batch, q_heads, num_queries, dim, dtype, "bnsd", gen)
    key, key_scale = ref.quantize_per_token(bnsd(batch, kv_heads, length, dim, dtype, "bsnd", gen))
    value, value_scale = ref.quantize_per_token(bnsd(batch, kv_heads, length, dim_v, dtype, "bnsd", gen))
    kv_start = {"none": torch.zeros(batch, dtype=torch.int64), "shared": torch.full((batch,), 2 * block),
                "rows": left_padding(batch, length, gen)}[padding].to(DEVICE)
    tile = num_queries if decode else d["tile"]
    tiles = ref.num_query_tiles(num_queries, q_offset, kv_start, tile)
    selection = random_selection(batch, kv_heads, tiles, ref.num_row_blocks(length, kv_start, block), block, tile,
                                 gen, density=0.4)
    blocked = ref.blocked_values(value, storage_block * block)
    for slot in range(length, blocked.shape[2] * blocked.shape[4]):  # stored slots past the length: not read as 0
        blocked[:, :, slot // blocked.shape[4], :, slot % blocked.shape[4]] = 127
    assert blocked.shape[2:] == (-(-length // (storage_block * block)), dim_v, storage_block * block)
    torch.testing.assert_close(ref.token_values(blocked, length), value, rtol=0, atol=0)
    scales = dict(scale=dim ** -0.5, q_offset=q_offset, kv_start=kv_start, key_scale=key_scale, value_scale=value_scale)
    expected_out, expected_lse = ref.sparse_attention(query, key, value, selection, **scales)
    reference_out, reference_lse = ref.sparse_attention(query, key, blocked, selection, **scales)
    torch.testing.assert_close(reference_out, expected_out, rtol=0, atol=0)
    out = torch.full((batch, q_heads, num_queries, dim_v), float("nan"), dtype=dtype, device=DEVICE)
    lse = torch.full((batch, q_heads, num_queries), float("nan"), device=DEVICE)
    getattr(OPS[op], op)(query, key, blocked, selection, out=out, lse=lse, **scales)
    assert_attention_close(out, lse, expected_out, expected_lse, dtype)


def test_blocked_values_errors():
    """Blocked values are int8 only and must hold every key slot."""
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(1, 2, 1, 16, generator=gen)
    key, key_scale = ref.quantize_per_token(torch.randn(1, 2, 40, 16, generator=gen))
    value, value_scale = ref.quantize_per_token(torch.randn(1, 2, 40, 16, generator=gen))
    selection = BlockSelection(torch.zeros(1, 2, 1, 3, dtype=torch.int32), torch.ones(1, 2, 1, dtype=torch.int32), 16, 1)
    args = dict(scale=0.25, q_offset=39, kv_start=torch.zeros(1, dtype=torch.int64), key_scale=key_scale,
                value_scale=value_scale)
    with pytest.raises(ValueError, match="shapes do not match"):
        OPS["sparse_decode"].sparse_decode(query, key, ref.blocked_values(value, 16)[:, :, :2], selection, **args)
    with pytest.raises(ValueError, match="int8 only"):
        OPS["sparse_decode"].sparse_decode(query, key, ref.blocked_values(value, 16).float(), selection, **args)


# -- int8 cache append ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype_name", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("dims_kv", [(64, 64), (128, 80)])
@pytest.mark.parametrize("layout", ["tokens", "blocked"])
@pytest.mark.parametrize("tokens, device_start", [(1, True), (37, False), (5, True)])
def test_quantize_append(size, dtype_name, dims_kv, layout, tokens, device_start):
    """New states quantised per token and written at their slots, bit-equal to the reference (ties round to
    even); every other slot of the poisoned storage keeps its contents."""
    dtype = DTYPES[dtype_name]
    dim, dim_v = dims_kv
    gen = torch.Generator().manual_seed(seed("append", size, dtype_name, dims_kv, layout, tokens, device_start))
    batch, heads, slots, block = (3, 2, 96, 16) if size == "small" else (2, 8, 4096, 128)
    start = slots - tokens - 3
    key_states = bnsd(batch, heads, tokens, dim, dtype, "bsnd", gen) * 3
    value_states = bnsd(batch, heads, tokens, dim_v, dtype, "bnsd", gen)
    key_states[0, 0, 0, :4] = torch.tensor([127.0, 2.5, -3.5, 0.5], dtype=dtype)  # scale 1: exact ties
    key_states[1, 0, 0] = 0.0  # an all-zero token: the smallest scale, zeros
    storages = []
    for _ in range(2):
        keys = torch.full((batch, heads, slots, dim), 99, dtype=torch.int8, device=DEVICE)
        values = torch.full((batch, heads, slots, dim_v), 99, dtype=torch.int8, device=DEVICE)
        if layout == "blocked":
            values = ref.blocked_values(values, block)
        scales = [torch.full((batch, heads, slots), float("nan"), device=DEVICE) for _ in range(2)]
        storages.append((keys, values, *scales))
    start_arg = torch.tensor([start], device=DEVICE) if device_start else start
    ref.quantize_append(key_states, value_states, *storages[0], start_arg)
    OPS["quantize_append"].quantize_append(key_states, value_states, *storages[1], start_arg)
    for expected, got in zip(storages[0], storages[1]):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    keys, values, key_scales, value_scales = storages[1]
    quantized, scale = ref.quantize_per_token(key_states)
    torch.testing.assert_close(keys[:, :, start:start + tokens], quantized, rtol=0, atol=0)
    assert keys[0, 0, start, :4].tolist() == [127, 2, -4, 0]
    assert (keys[1, 0, start] == 0).all()
    torch.testing.assert_close(key_scales[:, :, start:start + tokens], scale, rtol=0, atol=0)
    torch.testing.assert_close(ref.token_values(values, slots)[:, :, start:start + tokens],
                               ref.quantize_per_token(value_states)[0], rtol=0, atol=0)
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[start:start + tokens] = False
    assert (keys[:, :, untouched] == 99).all() and (ref.token_values(values, slots)[:, :, untouched] == 99).all()
    assert torch.isnan(key_scales[:, :, untouched]).all() and torch.isnan(value_scales[:, :, untouched]).all()


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype_name", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shape", [(1, 3, 1, 64, 64), (3, 2, 5, 128, 80), (2, 8, 16, 48, 48), (1, 1, 37, 64, 64)])
def test_append_kv(size, dtype_name, shape):
    """States written at the device-side length (one tensor, advanced by the op) and each row's valid block count
    from the new length, equal to the reference; every other slot of the poisoned storage keeps its contents. Shapes: decode (one token), odd head dims, K and V of
    different widths, more rows than one tile (37 tokens x 1 head at 64 columns: one tile; 8 heads x 16 tokens x 2:
    two tiles)."""
    dtype = DTYPES[dtype_name]
    batch, heads, tokens, dim, dim_v = shape
    gen = torch.Generator().manual_seed(seed("append_kv", size, dtype_name, shape))
    slots = 96 if size == "small" else 40000
    start = slots - tokens - 3
    key_states = bnsd(batch, heads, tokens, dim, dtype, "bsnd", gen)  # a transposed view, as models pass
    value_states = bnsd(batch, heads, tokens, dim_v, dtype, "bnsd", gen)
    starts = torch.tensor([0, 5, slots - 2][:batch], device=DEVICE)  # the last: padding past the new length
    block = 16
    results = []
    for op in (ref.append_kv, OPS["append_kv"].append_kv):
        keys = torch.full((batch, heads, slots, dim), 7.0, dtype=dtype, device=DEVICE)
        values = torch.full((batch, heads, slots, dim_v), 7.0, dtype=dtype, device=DEVICE)
        length = torch.tensor([start], device=DEVICE)
        counts = torch.full((batch,), -1, dtype=torch.int32, device=DEVICE)
        op(key_states, value_states, keys, values, length, starts, counts, block)
        results.append((keys, values, length, counts))
    for expected, got in zip(*results):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    keys, values, length, counts = results[1]
    assert length.item() == start + tokens
    assert counts.tolist() == [max(0, -(-(start + tokens - int(s)) // block)) for s in starts]
    torch.testing.assert_close(keys[:, :, start:start + tokens], key_states, rtol=0, atol=0)
    torch.testing.assert_close(values[:, :, start:start + tokens], value_states, rtol=0, atol=0)
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[start:start + tokens] = False
    assert (keys[:, :, untouched] == 7).all() and (values[:, :, untouched] == 7).all()


def test_append_kv_errors():
    """Storage that does not match the states, or a length that is not one device integer, get a clear error."""
    states = torch.randn(1, 2, 4, 16)
    keys, values = torch.zeros(1, 2, 32, 16), torch.zeros(1, 2, 32, 16)
    length = torch.tensor([3])
    with pytest.raises(ValueError, match="token-major storage"):
        kernels.append_kv(states, states, keys[:, :1], values, length)
    with pytest.raises(TypeError, match="storage dtypes"):
        kernels.append_kv(states, states, keys.half(), values, length)
    with pytest.raises(ValueError, match="one-element integer"):
        kernels.append_kv(states, states, keys, values, torch.tensor([3.0]))
    with pytest.raises(ValueError, match="one-element integer"):
        kernels.append_kv(states, states, keys, values, 3)
    with pytest.raises(ValueError, match="counts must be"):
        kernels.append_kv(states, states, keys, values, length, torch.zeros(1, dtype=torch.long), torch.zeros(2), 16)
    with pytest.raises(ValueError, match="block_size"):
        kernels.append_kv(states, states, keys, values, length, torch.zeros(1, dtype=torch.long),
                          torch.zeros(1, dtype=torch.int32), 0)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype_name", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("case", [
    # (rows, K, output sizes, gated, norm, residual, bias): a decode step's q/k/v after the input norm (GQA widths),
    # the output / down product with the residual, the gated MLP after its norm, odd sizes past the tiles
    (1, 64, (48, 16, 16), False, True, False, False), (3, 96, (40,), False, False, True, True),
    (5, 64, (24, 24), True, True, False, False), (17, 80, (33, 7, 9), False, True, False, True),
    (8, 48, (20, 20), True, False, False, True), (64, 32, (16,), False, True, True, False),
    # with the rotary embedding: decode at batch 1; batch 2 x 3 steps with per-row tables; batch 3, shared table
    (1, 64, (48, 16, 16), False, True, False, False, (1, 1, 16, 1), "rotary"),
    (6, 40, (64, 32, 32), False, True, False, True, (2, 3, 32, 2), "rotary"),
    (3, 48, (32, 16, 16), False, False, False, False, (3, 1, 16, 1), "rotary"),
])
def test_decode_linear(size, dtype_name, case):
    """The fused products equal the reference (transformers' eager ops) up to the summation order: rows padded to
    a tile, columns of several weights side by side, the norm's statistics, bias, gated product, residual add."""
    dtype = DTYPES[dtype_name]
    rows, k, sizes, gated, norm, residual, bias = case[:7]
    if size == "large":
        k = k * 12  # SmolLM2's widths: 576 in, 1536 up (whole heads kept where the products rotate)
        sizes = tuple(n * 12 for n in sizes) if case[-1] != "rotary" else tuple(n * 4 for n in sizes)
    gen = torch.Generator().manual_seed(seed("decode_linear", size, dtype_name, case))
    x = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE)
    weights = [(torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype).to(DEVICE) for n in sizes]
    biases = [torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None for n in sizes]
    norm_weight = (1 + torch.randn(k, generator=gen) / 4).to(dtype).to(DEVICE) if norm else None
    outputs = sizes[0] if gated else sum(sizes)
    res = torch.randn(rows, outputs, generator=gen).to(dtype).to(DEVICE) if residual else None
    rotary = None
    if case[-1] == "rotary":  # (B, S, head_dim, B of the tables): queries and keys in whole heads
        batch, steps, head_dim, table_batch = case[-2]
        angles = torch.randn(table_batch, steps, head_dim // 2, generator=gen)
        rotary = tuple(torch.cat([f(angles)] * 2, dim=-1).to(dtype).to(DEVICE) for f in (torch.cos, torch.sin))
    expected = ref.decode_linear(x, weights, biases, norm_weight, 1e-6, res, gated, rotary)
    got = OPS["decode_linear"].decode_linear(x, weights, biases, norm_weight, 1e-6, res, gated, rotary)
    assert got.shape == expected.shape == (rows, outputs) and got.dtype == dtype
    # Triton's CPU interpreter rounds float32 to bfloat16 toward zero (the GPU to nearest; checked on triton 3.9),
    # a bias that the norm, product, activation and gated product's roundings add up: a wider bound there.
    tolerance = 4e-2 if INTERPRETED and dtype == torch.bfloat16 else REL_TOL[dtype]
    assert rel_err(got, expected) <= tolerance
    torch.testing.assert_close(got, kernels.decode_linear(x, weights, biases, norm_weight, 1e-6, res, gated, rotary))


def test_decode_linear_errors():
    """Inputs the op does not take get a clear error naming what is wrong."""
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"\[M, K\] input"):
        kernels.decode_linear(x[None], [w], [None])
    with pytest.raises(ValueError, match="1 to 64 input rows"):
        kernels.decode_linear(torch.randn(65, 16), [w], [None])
    with pytest.raises(ValueError, match="contiguous \\[N, 16\\]"):
        kernels.decode_linear(x, [torch.randn(8, 12)], [None])
    with pytest.raises(ValueError, match="1 to 3 weights"):
        kernels.decode_linear(x, [w] * 4, [None] * 4)
    with pytest.raises(ValueError, match="every weight or for none"):
        kernels.decode_linear(x, [w, w], [torch.zeros(8), None])
    with pytest.raises(ValueError, match="gated product takes two weights of one shape"):
        kernels.decode_linear(x, [w, torch.randn(4, 16)], [None, None], gated=True)
    with pytest.raises(ValueError, match="residual must be"):
        kernels.decode_linear(x, [w], [None], residual=torch.zeros(2, 9))
    with pytest.raises(ValueError, match="norm_weight"):
        kernels.decode_linear(x, [w], [None], norm_weight=torch.ones(15))
    with pytest.raises(TypeError, match="one dtype"):
        kernels.decode_linear(x, [w.half()], [None])
    with pytest.raises(ValueError, match="one product"):
        kernels.decode_linear(x, [w, w], [None, None], residual=torch.zeros(2, 16))
    with pytest.raises(ValueError, match="float16 / bfloat16 / float32"):
        kernels.decode_linear(x.double(), [w.double()], [None])
    table = torch.ones(1, 2, 4)
    with pytest.raises(ValueError, match="first two products"):
        kernels.decode_linear(x, [w], [None], rotary=(table, table))
    with pytest.raises(ValueError, match="whole heads of 4"):
        kernels.decode_linear(x, [w, torch.randn(6, 16)], [None, None], rotary=(table, table))
    with pytest.raises(ValueError, match="rotary takes"):
        kernels.decode_linear(x, [w, w], [None, None], rotary=(torch.ones(1, 3, 4), torch.ones(1, 3, 4)))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("layout", ["tokens", "blocked"])
@pytest.mark.parametrize("start, tokens, clear", [(0, 37, "all"), (0, 1, "all"), (5, 3, "some"), (9, 4, "none"),
                                                  (0, 200, "all"), (6, 0, "all")])
def test_quantize_append_clears_the_scales_past_the_write(size, layout, start, tokens, clear):
    """With ``clear_to`` the write also zeroes the scales of the slots from its end to it (a fresh storage's tail,
    longer or shorter than the write, ending on a run of the kernel's or not), bit-equal to the reference; the
    slots before the write and past ``clear_to`` keep their contents."""
    gen = torch.Generator().manual_seed(seed("append-clear", size, layout, start, tokens, clear))
    batch, heads, slots, block = (2, 3, 208, 16) if size == "small" else (1, 4, 4352, 128)
    end = start + tokens
    clear_to = {"all": slots, "some": slots - 37, "none": end}[clear]
    key_states = bnsd(batch, heads, tokens, 64, torch.bfloat16, "bnsd", gen)
    value_states = bnsd(batch, heads, tokens, 32, torch.bfloat16, "bsnd", gen)
    storages = []
    for _ in range(2):
        values = torch.full((batch, heads, slots, 32), 99, dtype=torch.int8, device=DEVICE)
        storages.append((torch.full((batch, heads, slots, 64), 99, dtype=torch.int8, device=DEVICE),
                         ref.blocked_values(values, block) if layout == "blocked" else values,
                         torch.full((batch, heads, slots), float("nan"), device=DEVICE),
                         torch.full((batch, heads, slots), float("nan"), device=DEVICE)))
    ref.quantize_append(key_states, value_states, *storages[0], start, clear_to)
    OPS["quantize_append"].quantize_append(key_states, value_states, *storages[1], start, clear_to)
    for expected, got in zip(storages[0], storages[1]):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    for scales in storages[1][2:]:
        assert scales[:, :, :start].isnan().all() and scales[:, :, clear_to:].isnan().all()
        assert (scales[:, :, start:end] > 0).all() and (scales[:, :, end:clear_to] == 0).all()


def test_quantize_append_errors():
    """Storage that does not match the states, that is not contiguous, or slots past its end, get a clear error."""
    states = torch.randn(1, 2, 4, 16)
    keys, values = torch.zeros(1, 2, 32, 16, dtype=torch.int8), torch.zeros(1, 2, 32, 16, dtype=torch.int8)
    scales = torch.zeros(1, 2, 32)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.quantize_append(states, states, keys, values, scales, scales.clone(), 30)
    with pytest.raises(ValueError, match="int8 storage"):
        kernels.quantize_append(states, states, keys.float(), values, scales, scales.clone(), 0)
    with pytest.raises(ValueError, match="value_scales"):
        kernels.quantize_append(states, states, keys, values, scales, scales[:, :1], 0)
    strided = torch.zeros(1, 2, 16, 32, dtype=torch.int8).transpose(2, 3)  # [1, 2, 32, 16], not contiguous
    with pytest.raises(ValueError, match="key storage must be contiguous"):
        kernels.quantize_append(states, states, strided, values, scales, scales.clone(), 0)
    with pytest.raises(ValueError, match="value_scales must be contiguous"):
        kernels.quantize_append(states, states, keys, values, scales, torch.zeros(1, 32, 2).transpose(1, 2), 0)
    with pytest.raises(ValueError, match="clear_to must be 0 or from the write's end, 8, to the storage's 32"):
        kernels.quantize_append(states, states, keys, values, scales, scales.clone(), 4, 7)
    with pytest.raises(ValueError, match="clear_to must be 0 or from"):
        kernels.quantize_append(states, states, keys, values, scales, scales.clone(), 4, 33)
    with pytest.raises(ValueError, match="clear_to needs an integer start"):
        kernels.quantize_append(states, states, keys, values, scales, scales.clone(), torch.tensor([4]), 32)
    with pytest.raises(TypeError, match="clear_to must be an integer"):
        kernels.quantize_append(states, states, keys, values, scales, scales.clone(), 4, 32.0)
    with pytest.raises(TypeError, match="clear_to must be an integer"):
        kernels.quantize_append(states, states, keys, values, scales, scales.clone(), 4, torch.tensor(32))
    with pytest.raises(TypeError, match="clear_to must be an integer"):
        kernels.quantize_append(states, states, keys, values, scales, scales.clone(), 4, True)
    with pytest.raises(ValueError, match="clear_to must be 0 or from"):
        kernels.quantize_append(states, states, keys, values, scales, scales.clone(), 4, -1)
    kept = scales.clone()
    for clear_to in (7, 33):  # a refused call writes nothing
        with pytest.raises(ValueError):
            kernels.quantize_append(states, states, keys, values, scales, scales, 4, clear_to)
    torch.testing.assert_close(scales, kept, rtol=0, atol=0)


def test_append_input_checks_pass_and_refuse():
    """``quantize_append``'s input checks (made cheap for the calls they pass) pass token-major and blocked values
    and a host or device start, and refuse every mismatch with an error."""
    import numpy as np

    from hf_sparse.kernels._common import check_append_inputs

    states, wide = torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 8, dtype=torch.bfloat16)
    keys = torch.zeros(1, 2, 32, 16, dtype=torch.int8)
    values, blocked = torch.zeros(1, 2, 32, 8, dtype=torch.int8), torch.zeros(1, 2, 2, 8, 16, dtype=torch.int8)
    key_scales, value_scales = torch.zeros(1, 2, 32), torch.zeros(1, 2, 32)
    good = [(states, wide, keys, values, key_scales, value_scales, 28),
            (states, wide, keys, blocked, key_scales, value_scales, 0),
            (states, wide, keys, values, key_scales, value_scales, np.int64(3)),
            (states, wide, keys, values, key_scales, value_scales, torch.tensor(5)),
            (states, wide, keys, values, key_scales, value_scales, torch.tensor([5], dtype=torch.int32))]
    bad = [(states, wide, keys, values, key_scales, value_scales, 29),
           (states, wide, keys, values, key_scales, value_scales, -1),
           (states, wide, keys, values, key_scales, value_scales, 5.5),
           (states, wide, keys, values, key_scales, value_scales, True),
           (states, wide, keys, values, key_scales, value_scales, torch.tensor([5, 6])),
           (states, wide, keys, values, key_scales, value_scales, torch.tensor(5.0)),
           (states, wide, keys, values, key_scales, value_scales, torch.tensor(True)),
           (states[:, :, :3], wide, keys, values, key_scales, value_scales, 0),
           (states[0], wide, keys, values, key_scales, value_scales, 0),
           (states.int(), wide, keys, values, key_scales, value_scales, 0),
           (states, wide.int(), keys, values, key_scales, value_scales, 0),
           (states, wide, keys.float(), values, key_scales, value_scales, 0),
           (states, wide, keys[:, :1], values, key_scales, value_scales, 0),
           (states, wide, keys, values[..., :4], key_scales, value_scales, 0),
           (states, wide, keys, torch.zeros(1, 2, 1, 8, 16, dtype=torch.int8), key_scales, value_scales, 0),
           (states, wide, keys, torch.zeros(1, 2, 8, 16, 4, dtype=torch.int8), key_scales, value_scales, 0),
           (states, wide, keys, values[None], key_scales, value_scales, 0),
           (states, wide, keys, values, key_scales.double(), value_scales, 0),
           (states, wide, keys, values, key_scales, value_scales[:, :, :16], 0),
           (states, wide, torch.zeros(1, 2, 16, 32, dtype=torch.int8).transpose(2, 3), values, key_scales,
            value_scales, 0),
           (states, wide, keys, values, key_scales, torch.zeros(1, 32, 2).transpose(1, 2), 0)]
    if CUDA:
        bad += [(states, wide, keys, values, key_scales, value_scales, torch.tensor(5, device="cuda")),
                (states, wide, keys, values, key_scales.cuda(), value_scales, 0)]
    for args in good:
        check_append_inputs(*args)
    for number, args in enumerate(bad):
        with pytest.raises((ValueError, TypeError)):
            check_append_inputs(*args)
            pytest.fail(f"bad input {number} passed")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_quantize_append_whole_long_prompt():
    """A prefill appends more tokens than a CUDA grid's second axis holds (65535): all of them are written."""
    gen = torch.Generator().manual_seed(seed("append-long"))
    tokens = 70001
    key_states = bnsd(1, 2, tokens, 64, torch.bfloat16, "bnsd", gen)
    value_states = bnsd(1, 2, tokens, 64, torch.bfloat16, "bnsd", gen)
    storages = [(torch.zeros(1, 2, tokens + 127, 64, dtype=torch.int8, device=DEVICE),
                 ref.blocked_values(torch.zeros(1, 2, tokens + 127, 64, dtype=torch.int8, device=DEVICE), 128),
                 torch.zeros(1, 2, tokens + 127, device=DEVICE), torch.zeros(1, 2, tokens + 127, device=DEVICE))
                for _ in range(2)]
    ref.quantize_append(key_states, value_states, *storages[0], 0)
    OPS["quantize_append"].quantize_append(key_states, value_states, *storages[1], 0)
    for expected, got in zip(storages[0], storages[1]):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.skipif(os.environ.get("HF_SPARSE_DIRECT_LAUNCH") == "0", reason="HF_SPARSE_DIRECT_LAUNCH=0")
def test_quantize_append_direct_launches_equal_the_reference(monkeypatch):
    """Each call launches once, through Triton's JIT or directly (:class:`hf_sparse.kernels._launch.Launcher`), and
    directly when the call before had its specialisation, and writes what the reference writes: starts that are 1,
    multiples of 16 and neither, keys and values at addresses that are and are not multiples of 16, bf16 and float32,
    token-major and blocked values, a host and a device start (int64 and int32)."""
    from hf_sparse.kernels._launch import Launcher

    class Counted:  # the JIT function, counting the launches that go through it
        def __init__(self, kernel):
            self.kernel, self.calls = kernel, 0

        def __getitem__(self, grid):
            self.calls += 1
            return self.kernel[grid]

        def __getattr__(self, name):
            return getattr(self.kernel, name)

    module = OPS["quantize_append"]
    launcher = Launcher(Counted(module._LAUNCH.kernel))
    monkeypatch.setattr(module, "_LAUNCH", launcher)
    gen = torch.Generator().manual_seed(seed("append-direct"))
    slots, block = 512, 128
    for dtype in (torch.bfloat16, torch.float32):
        wide = bnsd(2, 3, 80, 72, dtype, "bsnd", gen)
        for blocked in (False, True):
            storages = []
            for _ in range(2):
                values = torch.full((2, 3, slots, 64), 99, dtype=torch.int8, device=DEVICE)
                storages.append((torch.full((2, 3, slots, 64), 99, dtype=torch.int8, device=DEVICE),
                                 ref.blocked_values(values, block) if blocked else values,
                                 torch.full((2, 3, slots), float("nan"), device=DEVICE),
                                 torch.full((2, 3, slots), float("nan"), device=DEVICE)))
            for start, tokens, shift in [(0, 33, 0), (1, 7, 0), (16, 16, 1), (40, 5, 0), (45, 5, 0), (50, 5, 3),
                                         (55, 5, 3), (64, 1, 0), (65, 1, 0), (66, 1, 1), (67, 1, 2)]:
                key_states = wide[:, :, :tokens, shift:shift + 64]  # shift 1, 2 or 3: not 16-byte aligned
                value_states = wide[:, :, tokens:2 * tokens, 8 - shift:72 - shift]
                start_arg = (torch.tensor([start], device=DEVICE, dtype=torch.int32 if start % 2 else torch.int64)
                             if start >= 64 else start)
                ref.quantize_append(key_states, value_states, *storages[0], start_arg)
                for repeat in range(2):  # the second call has the first's specialisation
                    before = launcher.launches, launcher.kernel.calls
                    module.quantize_append(key_states, value_states, *storages[1], start_arg)
                    direct, jit = launcher.launches - before[0], launcher.kernel.calls - before[1]
                    assert direct + jit == 1 and (direct == 1 or not repeat)
                for expected, got in zip(storages[0], storages[1]):
                    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
