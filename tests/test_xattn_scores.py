"""The Triton XAttention scoring kernel against ``reference.antidiagonal_block_scores``.

Like tests/test_kernels.py: without CUDA it runs in Triton's CPU interpreter at tiny sizes
(``TRITON_INTERPRET=1 pytest tests/test_xattn_scores.py``) and skips otherwise; ``-m gpu`` runs a 4K case on CUDA.
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
    pytest.skip("needs CUDA or the interpreter: run `TRITON_INTERPRET=1 pytest tests/test_xattn_scores.py`",
                allow_module_level=True)
DEVICE = "cuda" if CUDA else "cpu"

from hf_sparse.kernels import xattn_scores  # noqa: E402  (imports triton.language)

# Absolute bound on a block mass (masses are sums of probabilities, up to block_size / stride).
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def launch_shape(monkeypatch, rows: int, columns: int, split_steps: int) -> None:
    """Query groups x key groups per program step and key steps per split, for this test only."""
    monkeypatch.setattr(xattn_scores, "_ROWS", rows)
    monkeypatch.setattr(xattn_scores, "_COLUMNS", columns)
    monkeypatch.setattr(xattn_scores, "_SPLIT_STEPS", split_steps)


def small_inputs(seed: int, q_heads: int, kv_heads: int, head_dim: int, stride: int, q_offset: int, dtype,
                 query_scale: float = 1.0):
    """(query, key, kwargs) of 83 keys (not a multiple of the block size or the stride), two rows (the second
    left-padded by 13), block size 16; the key a transposed BSND buffer (the kernel must honour strides)."""
    generator = torch.Generator().manual_seed(seed)
    length = 83
    query = (torch.randn(2, q_heads, length - q_offset, head_dim, generator=generator) * query_scale).to(DEVICE, dtype)
    key = torch.randn(2, length, kv_heads, head_dim, generator=generator).to(DEVICE, dtype).transpose(1, 2)
    kwargs = dict(scale=head_dim**-0.5, q_offset=q_offset, kv_start=torch.tensor([0, 13], device=DEVICE),
                  block_size=16, stride=stride)
    return query, key, kwargs


@pytest.mark.parametrize("q_heads, kv_heads, head_dim, stride, q_offset, dtype", [
    (4, 2, 16, 4, 0, torch.float32),
    (4, 4, 32, 1, 21, torch.float32),
    (6, 2, 64, 8, 0, torch.float16),
    (4, 1, 32, 2, 10, torch.bfloat16),
])
@pytest.mark.parametrize("rows, columns, scratch, split_steps", [
    (64, 128, None, 8),
    (16, 16, None, 8),  # several programs and key steps
    (16, 16, None, 1),  # each key step its own split: the masses merge the splits' normalisers
    (16, 16, 1, 3),  # scratch for one program per launch: the tiles in several launches; a partial last split
])
@pytest.mark.parametrize("int8", [False, True], ids=["float_key", "int8_key"])
def test_scores_match_reference_small(q_heads, kv_heads, head_dim, stride, q_offset, dtype, rows, columns, scratch,
                                      split_steps, int8, monkeypatch):
    """Also with int8 keys and per-token scales (the int8 SparseCache), against the reference's dequantised
    scoring."""
    launch_shape(monkeypatch, rows, columns, split_steps)
    if scratch is not None:
        monkeypatch.setattr(xattn_scores, "SCRATCH_BYTES", scratch)
    query, key, kwargs = small_inputs(q_heads * 100 + head_dim + stride + q_offset, q_heads, kv_heads, head_dim,
                                      stride, q_offset, dtype)
    if int8:
        key, kwargs["key_scale"] = ref.quantize_per_token(key)
        dequantized = ref.dequantize_per_token(key, kwargs["key_scale"])
        torch.testing.assert_close(ref.antidiagonal_block_scores(query, key, **kwargs),
                                   ref.antidiagonal_block_scores(query.float(), dequantized, **{
                                       k: v for k, v in kwargs.items() if k != "key_scale"}))
    expected = ref.antidiagonal_block_scores(query, key, **kwargs)
    out = xattn_scores.antidiagonal_block_scores(query, key, **kwargs)
    torch.testing.assert_close(out, expected, atol=ATOL[dtype], rtol=0)
    part = xattn_scores.antidiagonal_block_scores(query, key, **kwargs, first_tile=2, num_tiles=2)
    torch.testing.assert_close(part, expected[:, :, 2:4], atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("q_heads, kv_heads, head_dim, stride, q_offset, dtype", [
    (4, 2, 16, 4, 0, torch.float32),
    (4, 1, 32, 2, 10, torch.bfloat16),
])
@pytest.mark.parametrize("rows, columns, split_steps", [(64, 128, 8), (16, 16, 1)])
@pytest.mark.parametrize("softcap", [2.0, 30.0])
def test_softcapped_scores_match_reference(q_heads, kv_heads, head_dim, stride, q_offset, dtype, rows, columns,
                                           split_steps, softcap, monkeypatch):
    """Gemma 2's softcapping: the scaled antidiagonal scores capped before the softmax (in the kernel's base 2),
    as the reference caps them; a small cap really changes the masses."""
    launch_shape(monkeypatch, rows, columns, split_steps)
    query, key, kwargs = small_inputs(q_heads * 100 + head_dim + stride + q_offset + int(softcap), q_heads, kv_heads,
                                      head_dim, stride, q_offset, dtype, query_scale=3.0)
    expected = ref.antidiagonal_block_scores(query, key, softcap=softcap, **kwargs)
    out = xattn_scores.antidiagonal_block_scores(query, key, softcap=softcap, **kwargs)
    torch.testing.assert_close(out, expected, atol=ATOL[dtype], rtol=0)
    if softcap == 2.0:
        plain = ref.antidiagonal_block_scores(query, key, **kwargs)
        assert (plain - expected).abs().max() > 20 * ATOL[dtype]
    with pytest.raises(ValueError, match="softcap"):
        xattn_scores.antidiagonal_block_scores(query, key, softcap=0.0, **kwargs)


@pytest.mark.parametrize("q_heads, kv_heads, head_dim, stride, q_offset, dtype, int8", [
    (4, 2, 16, 4, 0, torch.float32, False),
    (4, 4, 32, 1, 21, torch.float32, False),
    (6, 2, 64, 8, 0, torch.float16, True),
    (4, 1, 32, 2, 10, torch.bfloat16, False),
])
@pytest.mark.parametrize("rows, columns, split_steps", [(64, 128, 8), (16, 16, 1)])
def test_max_pooled_scores_match_reference(q_heads, kv_heads, head_dim, stride, q_offset, dtype, int8, rows,
                                           columns, split_steps, monkeypatch):
    """``pool="max"``: each antidiagonal's largest product, as the reference pools it; the masses differ from the
    mean's (stride > 1)."""
    launch_shape(monkeypatch, rows, columns, split_steps)
    query, key, kwargs = small_inputs(q_heads * 10 + head_dim + stride + q_offset + 7, q_heads, kv_heads, head_dim,
                                      stride, q_offset, dtype)
    if int8:
        key, kwargs["key_scale"] = ref.quantize_per_token(key)
    expected = ref.antidiagonal_block_scores(query, key, pool="max", **kwargs)
    out = xattn_scores.antidiagonal_block_scores(query, key, pool="max", **kwargs)
    torch.testing.assert_close(out, expected, atol=ATOL[dtype], rtol=0)
    part = xattn_scores.antidiagonal_block_scores(query, key, pool="max", **kwargs, first_tile=1, num_tiles=3)
    torch.testing.assert_close(part, expected[:, :, 1:4], atol=ATOL[dtype], rtol=0)
    if stride > 1:
        assert (ref.antidiagonal_block_scores(query, key, **kwargs) - expected).abs().max() > 20 * ATOL[dtype]
    with pytest.raises(ValueError, match="pool"):
        xattn_scores.antidiagonal_block_scores(query, key, pool="sum", **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("int8", [False, True], ids=["float_key", "int8_key"])
@pytest.mark.parametrize("split_steps", [8, 2])
@pytest.mark.parametrize("pool", ["max", "mean"])
def test_scores_match_reference_4k(dtype, int8, split_steps, pool, monkeypatch):
    monkeypatch.setattr(xattn_scores, "_SPLIT_STEPS", split_steps)
    generator = torch.Generator().manual_seed(5)
    query = torch.randn(1, 8, 4096 + 77, 128, generator=generator).to(DEVICE, dtype)
    key = torch.randn(1, 2, 4096 + 77, 128, generator=generator).to(DEVICE, dtype)
    kwargs = dict(scale=128**-0.5, q_offset=0, kv_start=torch.tensor([0], device=DEVICE), block_size=128, stride=8,
                  pool=pool)
    if int8:
        key, kwargs["key_scale"] = ref.quantize_per_token(key)
    expected = ref.antidiagonal_block_scores(query, key, **kwargs, key_chunk=1024)
    out = xattn_scores.antidiagonal_block_scores(query, key, **kwargs)
    torch.testing.assert_close(out, expected, atol=ATOL[dtype], rtol=0)


def test_scores_need_a_positive_scale():
    """The kernel keeps maxima of scaled scores, which needs a positive softmax scale: others get a clear error."""
    query, key = torch.randn(1, 2, 40, 16, device=DEVICE), torch.randn(1, 2, 40, 16, device=DEVICE)
    with pytest.raises(ValueError, match="scale must be positive"):
        xattn_scores.antidiagonal_block_scores(query, key, scale=0.0, q_offset=0,
                                               kv_start=torch.zeros(1, dtype=torch.int64), block_size=16, stride=4)
