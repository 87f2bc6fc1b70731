"""Continuous batching (transformers' generate_batch): "plas" and "xattn" run each packed request as generate()
runs it alone (rule `packed`); "star" is refused; sdpa is untouched; unpatch() restores transformers' name check."""
from __future__ import annotations

import inspect

import pytest
import torch
from conftest import build, tiny_config
from transformers import GenerationConfig

import hf_sparse
from hf_sparse import integration, plan

continuous_api = pytest.importorskip("transformers.generation.continuous_batching.continuous_api",
                                     reason="this transformers has no continuous batching")
ContinuousBatchingConfig = pytest.importorskip("transformers.generation.configuration_utils").ContinuousBatchingConfig
Manager = continuous_api.ContinuousBatchingManager

#: Prompts of 5, 11 and 70 tokens: with dense_below 40 the first two run dense, the third sparse (5 blocks of 16).
PROMPTS = [list(range(3, 8)), [(7 * i + 5) % 120 + 3 for i in range(11)], [(5 * i + 3) % 120 + 3 for i in range(70)]]
NEW_TOKENS = 5
CONFIGS = {
    "plas": hf_sparse.PLASConfig(block_size=16, prefill_top_k=(2, 3), decode_top_k=(2, 3), dense_below=40,
                                 dense_layers=()),
    "xattn": hf_sparse.XAttnConfig(block_size=16, stride=4, threshold=0.5, decode_threshold=0.5, dense_below=40,
                                   dense_last=0, dense_layers=()),
}


def cb_config(**kwargs) -> ContinuousBatchingConfig:
    """A small CPU cache, no CUDA graphs, no prefix sharing (each request's tokens its own). 5.17 names the page
    size ``block_size``."""
    page = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
    return ContinuousBatchingConfig(**{page: 16}, num_blocks=32, max_memory_percent=0.5, use_cuda_graph=False,
                                    allow_block_sharing=False, **kwargs)


def generation_config() -> GenerationConfig:
    return GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)


def alone(model, prompts) -> list[list[int]]:
    """Each prompt through generate() alone (batch 1): the tokens it adds."""
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), generation_config=generation_config())[0, len(p):].tolist()
                for p in prompts]


def batched(model, prompts, **kwargs) -> list[list[int]]:
    """The prompts through continuous batching (generate_batch), in prompt order."""
    with torch.no_grad():
        results = model.generate_batch(inputs=prompts, generation_config=generation_config(),
                                       continuous_batching_config=cb_config(**kwargs), warmup=False)
    assert len(results) == len(prompts)
    return [result.generated_tokens for result in results.values()]


@pytest.fixture(scope="module")
def models():
    built = {}
    for method, config in CONFIGS.items():
        model = build(tiny_config("llama", 4, 2), method)
        hf_sparse.configure(model, config)
        built[method] = model
    return built


def alone_chunked(model, prompts, chunk: int) -> list[list[int]]:
    """Each prompt through generate() alone with its prefill in chunks of ``chunk`` tokens."""
    config = generation_config()
    config.prefill_chunk_size = chunk
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), generation_config=config)[0, len(p):].tolist() for p in prompts]


def sparse_and_dense_calls(recorder) -> None:
    """The long request attended sparsely (some blocks skipped), the short ones densely by length."""
    assert any(r.dense_reason is None for r in recorder.records)
    assert recorder.density() < 1.0
    assert any("< dense_below 40" in (r.dense_reason or "") for r in recorder.records)


@pytest.mark.parametrize("method", list(CONFIGS))
def test_generate_batch_equals_generate_alone(models, method):
    """Rule `packed`: three requests of 5, 11 and 70 tokens in one continuous batch (prefilled together, then
    decoded together) give each request's tokens of generate() alone; the long one attends sparsely in its
    prefill and decode, the short ones densely."""
    model = models[method]
    expected = alone(model, PROMPTS)
    names = []
    hook = model.register_forward_pre_hook(lambda module, args: names.append(module.config._attn_implementation))
    try:
        with hf_sparse.record_sparsity() as recorder:
            got = batched(model, PROMPTS)
    finally:
        hook.remove()
    # kept (5.17: under its paged| name), not swapped for flash nor refused; restored after
    assert set(names) == {integration._PAGED + method if integration._CB_UPDATES_IN_FUNCTION else method}
    assert model.config._attn_implementation == method
    assert got == expected
    assert {r.phase for r in recorder.records if r.dense_reason is None} == {"prefill", "decode"}
    sparse_and_dense_calls(recorder)


@pytest.mark.parametrize("method", list(CONFIGS))
def test_chunked_prefill_equals_generate_with_the_same_chunks(models, method):
    """Rule `packed` with chunked prefill (max_batch_tokens=16): the 70-token request, first in line, is prefilled
    in chunks of 16, 16, 16, 16 and 6 tokens, the last packed with the 5-token prompt and the first 5 tokens of
    the 11-token one, whose other 6 come with two decode tokens: each request's tokens are those of generate()
    alone with prefill_chunk_size=16. (A sparse method selects per call, so a prefill in chunks may differ from
    one in a single call: XAttention's does here in chunks of 14.)"""
    model = models[method]
    prompts = [PROMPTS[2], PROMPTS[0], PROMPTS[1]]
    expected = alone_chunked(model, prompts, 16)
    with hf_sparse.record_sparsity() as recorder:
        got = batched(model, prompts, max_batch_tokens=16)
    assert got == expected
    sparse_and_dense_calls(recorder)


def test_packed_requests_split_by_cumulative_lengths():
    """Rule `packed`: the requests with queries, their query and key slices; no split with a mask or without
    cumulative lengths."""
    kwargs = {"cu_seq_lens_q": torch.tensor([0, 1, 1, 7], dtype=torch.int32),
              "cu_seq_lens_k": torch.tensor([0, 9, 12, 30], dtype=torch.int32)}
    requests = plan.packed_requests(None, kwargs)
    assert requests == [plan.PackedRequest(slice(0, 1), slice(0, 9)), plan.PackedRequest(slice(1, 7), slice(12, 30))]
    assert plan.packed_requests(torch.ones(1, 30), kwargs) is None
    assert plan.packed_requests(None, {}) is None
    with pytest.raises(ValueError, match="queries but only"):
        plan.packed_requests(None, {"cu_seq_lens_q": torch.tensor([0, 5]), "cu_seq_lens_k": torch.tensor([0, 4])})


def test_star_is_refused_before_any_step():
    model = build(tiny_config("llama", 4, 2), "star")
    with pytest.raises(NotImplementedError, match="star.*continuous batching.*context and query"):
        model.generate_batch(inputs=[[3, 4, 5]], generation_config=generation_config(),
                             continuous_batching_config=cb_config(), warmup=False)
    assert model.config._attn_implementation == "star"


def test_sdpa_unchanged_and_unpatch_restores():
    """sdpa under continuous batching still equals generate() with hf_sparse imported; unpatch() puts transformers'
    name check back (which refuses "plas" again on releases with the check) and patch() reinstalls ours."""
    model = build(tiny_config("llama", 4, 2), "sdpa")
    assert batched(model, PROMPTS[:2]) == alone(model, PROMPTS[:2])
    assert model.config._attn_implementation == "sdpa"
    ours = Manager.switch_to_cb_friendly_attn
    hf_sparse.unpatch()
    try:
        assert Manager.switch_to_cb_friendly_attn is not ours
        assert "cb_attn" not in integration._ORIGINAL
        if not integration._CB_UPDATES_IN_FUNCTION:  # 5.25's check refuses names it does not know
            plas = build(tiny_config("llama", 4, 2), "plas")
            with pytest.raises(ValueError, match="not supported for continuous batching"):
                plas.generate_batch(inputs=[[3, 4, 5]], generation_config=generation_config(),
                                    continuous_batching_config=cb_config(), warmup=False)
    finally:
        hf_sparse.patch()
        hf_sparse.patch()  # idempotent
    assert Manager.switch_to_cb_friendly_attn is ours
