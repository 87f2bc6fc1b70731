"""The Triton threshold-selection kernel against ``reference.cumulative_threshold_select``: equal, bit for bit.

Like tests/test_xattn_scores.py: without CUDA it runs in Triton's CPU interpreter at small sizes
(``TRITON_INTERPRET=1 pytest tests/test_threshold_select.py``) and skips otherwise; ``-m gpu`` runs a 128K-token
case (32 heads x 1024 tiles x 1024 blocks) on CUDA.
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
    pytest.skip("needs CUDA or the interpreter: run `TRITON_INTERPRET=1 pytest tests/test_threshold_select.py`",
                allow_module_level=True)
DEVICE = "cuda" if CUDA else "cpu"

from hf_sparse import kernels  # noqa: E402
from hf_sparse.kernels import threshold_select  # noqa: E402  (imports triton.language)

THRESHOLDS = (0.8, 0.9, 0.95, 1.0)


def causal_rows(batch: int, tiles: int, num_blocks: int, generator: torch.Generator):
    """(available, forced) ``[B, 1, T, nb]`` as XAttention prefill builds them: each tile sees the blocks up
    to a random last one (-1: nothing, as a tile of padding queries), the sink and its last block forced."""
    last = torch.randint(-1, num_blocks, (batch, tiles, 1), generator=generator)
    block_ids = torch.arange(num_blocks)
    available = block_ids <= last
    forced = ((block_ids == 0) | (block_ids == last)) & available
    return available[:, None].to(DEVICE), forced[:, None].to(DEVICE)


def assert_same(mass, available, forced, threshold):
    expected = ref.cumulative_threshold_select(mass, available, forced, threshold)
    got = threshold_select.cumulative_threshold_select(mass, available, forced, threshold)
    assert got.dtype == torch.bool and got.shape == expected.shape
    assert torch.equal(got, expected), f"{(got != expected).sum().item()} blocks differ at threshold {threshold}"
    return got


@pytest.mark.parametrize("batch, heads, tiles, num_blocks", [
    (1, 1, 1, 1), (2, 3, 5, 7), (1, 2, 9, 37), (2, 2, 3, 100), (1, 1, 4, 129), (1, 1, 2, 1000),
])
@pytest.mark.parametrize("spread", ["uniform", "softmax"])
def test_matches_reference_on_random_masses(batch, heads, tiles, num_blocks, spread):
    generator = torch.Generator().manual_seed(batch * 1000 + heads * 100 + tiles * 10 + num_blocks)
    if spread == "uniform":
        mass = torch.rand(batch, heads, tiles, num_blocks, generator=generator) ** 4
    else:  # peaked, as real block masses: a few large, many tiny (down to the fixed point's resolution)
        logits = torch.randn(batch, heads, tiles, num_blocks, generator=generator) * 6
        mass = torch.softmax(logits, -1) * 16
    available, forced = causal_rows(batch, tiles, num_blocks, generator)
    for threshold in THRESHOLDS:
        chosen = assert_same(mass.to(DEVICE), available, forced, threshold)
        assert not (chosen & ~available).any() and not (forced & ~chosen).any()


def test_exact_ties_fall_to_the_lower_block_id():
    generator = torch.Generator().manual_seed(7)
    # Few distinct values (zeros included): most candidates tie with others, also at the cut.
    mass = torch.randint(0, 4, (3, 4, 6, 45), generator=generator).float() / 4
    available, forced = causal_rows(3, 6, 45, generator)
    for threshold in THRESHOLDS + (0.3, 0.5):
        assert_same(mass.to(DEVICE), available, forced, threshold)
    # Hand-checked row: 4 equal blocks, threshold 0.5 needs 2 of them, the two lowest ids.
    row = torch.ones(1, 6, device=DEVICE)
    row[0, 0] = 0.0
    available = torch.tensor([[False, True, True, True, True, False]], device=DEVICE)
    got = assert_same(row, available, torch.zeros_like(available), 0.5)
    assert got.tolist() == [[False, True, True, False, False, False]]


def test_forced_blocks_zero_rows_and_fixed_point_resolution():
    generator = torch.Generator().manual_seed(11)
    num_blocks = 33
    mass = torch.rand(8, num_blocks, generator=generator)
    mass[0] = 0.0  # available but massless: only the forced blocks
    mass[1, 5:] = 0.0
    mass[2] = mass[2] * 1e-30  # tiny row: the fixed point is relative to the row's maximum
    mass[3] = 1e-40  # subnormal float32 everywhere: exponent clamped at -126
    mass[4, ::2] = 1.0 + 2.0**-23  # next float32 above 1: stays distinct from 1.0 in the fixed point
    mass[4, 1::2] = 1.0
    mass[5, 1::3] = 0.5 * (1 + 2.0**-40)  # float32 rounds this to 0.5: exact ties
    mass[6] = -mass[6]  # negative masses count as zero
    available = torch.ones(8, num_blocks, dtype=torch.bool)
    available[7] = False  # nothing available: nothing chosen, forced or not
    forced = torch.zeros(8, num_blocks, dtype=torch.bool)
    forced[:, [0, 17, 32]] = True
    forced[4] |= mass[4] > 1  # forced blocks holding most of the mass: nothing else needed at low thresholds
    for threshold in THRESHOLDS + (0.3,):
        chosen = assert_same(mass.to(DEVICE), available.to(DEVICE), forced.to(DEVICE), threshold)
        assert not chosen[7].any()
        if threshold < 1:
            assert torch.equal(chosen[0].cpu(), forced[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_masses(dtype):
    generator = torch.Generator().manual_seed(13)
    mass = (torch.rand(2, 2, 5, 19, generator=generator) ** 3).to(DEVICE, dtype)
    available, forced = causal_rows(2, 5, 19, generator)
    for threshold in THRESHOLDS:
        assert_same(mass, available, forced, threshold)


def test_strided_and_broadcast_inputs():
    """BSND-like transposed masses, availability shared by heads (stride 0), decode-shaped forced rows, and
    row shapes of 1, 2 and 5 dims."""
    generator = torch.Generator().manual_seed(17)
    mass = (torch.rand(2, 7, 3, 21, generator=generator) ** 2).to(DEVICE).transpose(1, 2)  # [2, 3, 7, 21]
    available, _ = causal_rows(2, 7, 21, generator)
    forced = torch.zeros(2, 1, 1, 21, dtype=torch.bool, device=DEVICE)
    forced[..., 0] = True
    for threshold in (0.8, 0.95):
        assert_same(mass, available, forced, threshold)
        assert_same(mass[0, 0, 0], available[0, 0, 0], forced[0, 0, 0], threshold)
        assert_same(mass[0, 0], available[0, 0], forced[0, 0, 0], threshold)
        assert_same(mass[:, None].expand(2, 2, 3, 7, 21), available[:, None], forced, threshold)


def test_dispatch_and_validation(monkeypatch):
    generator = torch.Generator().manual_seed(19)
    mass = torch.rand(1, 2, 3, 40, generator=generator).to(DEVICE)
    available, forced = causal_rows(1, 3, 40, generator)
    expected = ref.cumulative_threshold_select(mass, available, forced, 0.9)
    assert kernels.backend_for(mass) == "triton"
    assert torch.equal(kernels.cumulative_threshold_select(mass, available, forced, 0.9), expected)
    monkeypatch.setattr(threshold_select, "MAX_BLOCKS", 32)  # wider rows: the reference
    assert torch.equal(kernels.cumulative_threshold_select(mass, available, forced, 0.9), expected)
    with pytest.raises(ValueError, match="exceed"):
        threshold_select.cumulative_threshold_select(mass, available, forced, 0.9)
    monkeypatch.undo()
    with pytest.raises(TypeError):
        threshold_select.cumulative_threshold_select(mass.double(), available, forced, 0.9)
    with pytest.raises(TypeError):
        threshold_select.cumulative_threshold_select(mass, available.int(), forced, 0.9)
    with pytest.raises(ValueError):
        threshold_select.cumulative_threshold_select(mass, available, forced, 0.0)
    with pytest.raises(RuntimeError):  # not broadcastable
        threshold_select.cumulative_threshold_select(mass, available[..., :3], forced, 0.9)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("threshold", [0.9, 0.95])
def test_matches_reference_128k(threshold):
    """XAttention prefill at 128K tokens, block 128: 32 heads x 1024 tiles x 1024 blocks, causal."""
    generator = torch.Generator(device=DEVICE).manual_seed(23)
    heads, tiles = 32, 1024
    logits = torch.randn(1, heads, tiles, tiles, generator=generator, device=DEVICE) * 4
    block_ids = torch.arange(tiles, device=DEVICE)
    causal = block_ids[None, :] <= block_ids[:, None]
    mass = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1) * 16
    available = causal[None, None]
    forced = available & ((block_ids == 0) | (block_ids[None, :] == block_ids[:, None]))
    got = assert_same(mass, available, forced, threshold)
    assert 0 < got.sum() < available.sum() * heads
