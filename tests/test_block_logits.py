"""The Triton pooled-block-logit kernel (gate distillation's targets) against ``reference.pooled_block_logits``.

Without CUDA it runs in Triton's CPU interpreter (``TRITON_INTERPRET=1 pytest tests/test_block_logits.py``,
part of ``make test``) and skips otherwise; ``-m gpu`` adds an 8K-token case and the distillation loss on CUDA.
"""
from __future__ import annotations

import os

import pytest
import torch

from hf_sparse.kernels import reference as ref

pytest.importorskip("triton")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and not INTERPRETED
if not CUDA and not INTERPRETED:
    pytest.skip("needs CUDA or the interpreter: run `TRITON_INTERPRET=1 pytest tests/test_block_logits.py`",
                allow_module_level=True)
DEVICE = "cuda" if CUDA else "cpu"

from hf_sparse import kernels  # noqa: E402
from hf_sparse.tools import gate_objective
from hf_sparse.kernels import block_logits as op  # noqa: E402  (imports triton.language)


def inputs(batch, q_heads, kv_heads, num_queries, key_length, dim, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, q_heads, num_queries, dim, generator=generator).to(DEVICE, dtype)
    key = torch.randn(batch, kv_heads, key_length, dim, generator=generator).to(DEVICE, dtype)
    return query, key


def assert_close(got, expected):
    assert got.shape == expected.shape and got.dtype == torch.float32
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(got), finite), "-inf where the reference has a logit, or the reverse"
    assert torch.equal(got[~finite], expected[~finite])
    assert not got.isnan().any()
    torch.testing.assert_close(got[finite], expected[finite], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("batch, q_heads, kv_heads, num_queries, key_length, dim, block", [
    (1, 1, 1, 1, 1, 16, 16),        # one query, one key
    (1, 2, 2, 37, 37, 32, 16),      # odd length, MHA
    (2, 6, 2, 70, 70, 64, 32),      # GQA 3, partial last block
    (1, 4, 1, 129, 129, 64, 64),    # MQA, one slot past a block edge
    (1, 3, 3, 100, 300, 80, 128),   # queries are the last 100 of 300 slots, head dim not a power of two
    (2, 8, 2, 65, 200, 16, 64),     # GQA 4, batch 2
    (1, 2, 1, 100, 40, 32, 16),     # more queries than keys: the last 60 see every key
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pool", ["max", "sum"])
def test_matches_reference_on_random_inputs(batch, q_heads, kv_heads, num_queries, key_length, dim, block, dtype,
                                            pool):
    query, key = inputs(batch, q_heads, kv_heads, num_queries, key_length, dim, dtype, seed=num_queries + dim)
    q_offset = max(0, key_length - num_queries)
    scale = dim ** -0.5
    expected = ref.pooled_block_logits(query, key, block, scale, q_offset, pool)
    assert_close(op.pooled_block_logits(query, key, block, scale, q_offset, pool), expected)
    assert expected.shape == (batch, q_heads, num_queries, -(-key_length // block))


def test_offsets_strides_and_dispatch():
    """Queries at an offset with keys past them (only keys up to each query's slot count), transposed (BSND-like)
    inputs, and the dispatching ``kernels.pooled_block_logits``."""
    query, key = inputs(1, 4, 2, 50, 160, 32, torch.float32, seed=3)
    expected = ref.pooled_block_logits(query, key, 32, 0.3, q_offset=40)
    assert torch.isinf(expected[:, :, 0, 2:]).all() and torch.isfinite(expected[:, :, 0, :2]).all()  # slot 40
    assert_close(op.pooled_block_logits(query, key, 32, 0.3, q_offset=40), expected)
    bsnd_q = query.transpose(1, 2).contiguous().transpose(1, 2)
    bsnd_k = key.transpose(1, 2).contiguous().transpose(1, 2)
    assert_close(op.pooled_block_logits(bsnd_q, bsnd_k, 32, 0.3, q_offset=40), expected)
    assert kernels.backend_for(query) == "triton"
    assert_close(kernels.pooled_block_logits(query, key, 32, 0.3, 40), expected)
    # "sum" pools mass: a softmax over a row's blocks is the dense attention mass of each block.
    pooled = op.pooled_block_logits(query, key, 32, 0.3, 40, "sum")
    probs = torch.softmax(ref.causal_logits(query, key, 0.3, 40), -1)
    mass = probs.unflatten(-1, (5, 32)).sum(-1)
    torch.testing.assert_close(torch.softmax(pooled, -1), mass, rtol=1e-4, atol=1e-6)


def test_validation():
    query, key = inputs(1, 3, 2, 8, 8, 16, torch.float32, seed=5)
    with pytest.raises(ValueError, match="multiple"):
        op.pooled_block_logits(query, key, 16, 1.0)
    query, key = inputs(1, 2, 1, 8, 8, 16, torch.float32, seed=5)
    with pytest.raises(ValueError, match="power of two"):
        op.pooled_block_logits(query, key, 24, 1.0)
    with pytest.raises(ValueError, match="positive"):
        op.pooled_block_logits(query, key, 16, 0.0)
    with pytest.raises(ValueError, match="dtype"):
        op.pooled_block_logits(query, key.double(), 16, 1.0)
    with pytest.raises(TypeError, match="unsupported"):
        op.pooled_block_logits(query.double(), key.double(), 16, 1.0)
    with pytest.raises(ValueError, match="pool"):
        op.pooled_block_logits(query, key, 16, 1.0, pool="mean")


@pytest.mark.parametrize("sink_blocks", [1, None])
@pytest.mark.parametrize("pool", ["max", "sum"])
def test_distillation_loss_and_gradient_equal_the_reference_path(monkeypatch, sink_blocks, pool):
    """``gate_distillation_loss`` through the kernel (one chunk) equals the PyTorch path (chunks of 7 queries)."""
    query, key = inputs(1, 6, 2, 83, 83, 16, torch.float32, seed=9)
    generator = torch.Generator().manual_seed(1)
    gate = (torch.rand(2, 16, 16, generator=generator) / 16).to(DEVICE).requires_grad_()
    results = []
    for backend in ("triton", "torch"):
        monkeypatch.setenv("HF_SPARSE_BACKEND", backend)
        gate.grad = None
        loss = gate_objective.gate_distillation_loss(query, key, gate, 16, 0.25, query_chunk=7, sink_blocks=sink_blocks,
                                               pool=pool)
        loss.backward()
        results.append((loss.detach(), gate.grad.clone()))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-4, atol=1e-7)
    assert results[0][0] > 0 and results[0][1].abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_long_bf16_sequence_on_the_gpu():
    query, key = inputs(1, 9, 3, 8192, 8192, 64, torch.bfloat16, seed=11)
    for block in (64, 128):
        for pool in ("max", "sum"):
            assert_close(op.pooled_block_logits(query, key, block, 0.125, 0, pool),
                         ref.pooled_block_logits(query, key, block, 0.125, 0, pool))


@pytest.mark.parametrize("pool", ["max", "sum"])
def test_each_query_at_its_own_slot(pool):
    """``q_offset`` as a tensor of slots (the key scorer's searching queries, one in a few, with repeats and out of
    order): each query pooled up to its own slot, as the reference does; slots that are not integers, not one per
    query or negative are refused."""
    query, key = inputs(2, 4, 2, 9, 200, 16, torch.bfloat16, seed=5)
    slots = torch.tensor([199, 3, 63, 64, 127, 127, 130, 0, 150])
    expected = ref.pooled_block_logits(query, key, 32, 0.5, slots, pool)
    assert_close(op.pooled_block_logits(query, key, 32, 0.5, slots, pool), expected)
    assert torch.isinf(expected[:, :, 1, 1:]).all() and torch.isfinite(expected[:, :, 0]).all()
    for bad, message in [(slots.float(), "integer slots"), (slots[:3], r"\[Sq=9\]"), (slots - 5, ">= 0")]:
        with pytest.raises(ValueError, match=message):
            op.pooled_block_logits(query, key, 32, 0.5, bad, pool)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_slots_of_a_long_bf16_sequence_on_the_gpu():
    """The key scorer's call on the GPU: one searching query in four of an 8K prefill, each at its own slot."""
    query, key = inputs(1, 9, 3, 2048, 8192, 16, torch.bfloat16, seed=12)
    slots = torch.arange(3, 8192, 4, device=DEVICE)
    for block in (64, 128):
        assert_close(op.pooled_block_logits(query, key, block, 0.125, slots, "max"),
                     ref.pooled_block_logits(query, key, block, 0.125, slots, "max"))
