"""hf_sparse.plan: each rule of a call's plan, by name; a padded batch's rows run what they run alone; calls that
are not causal-plus-padding (packed sequences, custom 4D masks) run dense, equal to sdpa; torch.compile."""
from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import types

import pytest
import torch
from conftest import MODEL_DEVICES, build, full_density, tiny_config

import hf_sparse
from hf_sparse import SparseCache, density, plan
from hf_sparse.plan import ALL_BLOCKS, DENSE, SPARSE, Call
from hf_sparse.selection import RowLayout

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1"))]


@pytest.fixture(scope="module")
def model():
    return build(tiny_config("llama", 4, 2, layers=3), "plas")


def call_of(model, config=None, num_queries=200, key_length=None, mask=None, layer=None, layer_idx=0, dropout=0.0,
            query_dtype=torch.float32, method="plas", **kwargs) -> Call:
    """A Call of ``model``'s layer ``layer_idx`` with random queries and keys (batch of the mask's, else 1)."""
    key_length = num_queries if key_length is None else key_length
    batch = mask.shape[0] if mask is not None else 1
    config = config or hf_sparse.PLASConfig(block_size=16, dense_below=100)
    module = model.model.layers[layer_idx].self_attn
    query = torch.randn(batch, 4, num_queries, 16, dtype=query_dtype)
    return Call(method, config, module, query, torch.randn(batch, 2, key_length, 16), mask, layer, kwargs, dropout)


def test_every_rule_has_a_test_that_names_it():
    names = {name for name, _ in plan.RULES}
    text = "".join(path.read_text() for path in pathlib.Path(__file__).parent.glob("test_*.py"))
    named = set(re.findall(r"[Rr]ule `(\w+)`", text))
    assert names <= named, names - named


def test_rule_inputs(model):
    """Rule `inputs`: a dtype, a feature the method does not compute, non-causal attention: clear errors."""
    with pytest.raises(TypeError, match="float32/float16/bfloat16"):
        plan.plan_call(call_of(model, query_dtype=torch.float64))
    with pytest.raises(NotImplementedError, match="position_bias"):
        plan.plan_call(call_of(model, position_bias=torch.zeros(1)))
    module = model.model.layers[0].self_attn
    module.is_causal = False
    try:
        with pytest.raises(NotImplementedError, match="causal"):
            plan.plan_call(call_of(model))
    finally:
        module.is_causal = True


def test_rule_mask_window_dense_layer_length(model):
    """Rule `mask` (a 4D mask), rule `window`, rule `dense_layer`, rule `length`: DENSE, in that order."""
    assert plan.plan_call(call_of(model, mask=torch.ones(1, 1, 200, 200, dtype=torch.bool))).rule == "mask"
    assert plan.plan_call(call_of(model, sliding_window=64)).rule == "window"
    config = hf_sparse.PLASConfig(block_size=16, dense_below=100, dense_layers=(-1,))
    decided = plan.plan_call(call_of(model, config, layer_idx=2, num_queries=50))
    assert (decided.path, decided.rule) == (DENSE, "dense_layer")
    decided = plan.plan_call(call_of(model, num_queries=99))
    assert (decided.path, decided.rule, decided.why()) == (DENSE, "length", "length 99 < dense_below 100")
    assert plan.plan_call(call_of(model)).path == SPARSE


def test_rule_length_in_a_static_decode_step_reads_every_block(model, monkeypatch):
    """Rule `length` and rule `dense_layer` in a static decode step on the Triton path: ALL_BLOCKS (a CUDA graph
    replays it; sdpa would take the host's length)."""
    monkeypatch.setattr(hf_sparse.kernels, "backend_for", lambda tensor: "triton")
    layer = types.SimpleNamespace(static=True, row_layout=RowLayout.uniform(1), block_size=16, quantized=False)
    decided = plan.plan_call(call_of(model, num_queries=1, key_length=50, layer=layer))
    assert (decided.path, decided.rule) == (ALL_BLOCKS, "length")
    config = hf_sparse.PLASConfig(block_size=16, dense_below=0, dense_layers=(0,))
    assert plan.plan_call(call_of(model, config, num_queries=1, key_length=50, layer=layer)).path == ALL_BLOCKS


def test_rule_padding_and_dropout(model):
    """Rule `padding` (a mask that is not left padding) and rule `dropout`: DENSE."""
    mask = torch.ones(2, 200, dtype=torch.long)
    mask[1, -5:] = 0
    assert plan.plan_call(call_of(model, mask=mask)).rule == "padding"
    assert plan.plan_call(call_of(model, dropout=0.1)).rule == "dropout"


def test_rule_sparse_gives_short_rows_every_block(model):
    """Rule `sparse`: rows that alone run dense (shorter than dense_below) are the plan's full rows."""
    mask = torch.ones(3, 200, dtype=torch.long)
    mask[1, :150] = 0  # 50 tokens: alone, dense
    mask[2, :60] = 0  # 140 tokens: alone, sparse
    decided = plan.plan_call(call_of(model, mask=mask))
    assert (decided.path, decided.rule) == (SPARSE, "sparse")
    assert decided.full_rows.tolist() == [False, True, False]
    mask[1, :150] = 1
    assert plan.plan_call(call_of(model, mask=mask)).full_rows is None  # every row sparse alone


@pytest.fixture
def by_density(monkeypatch):
    """The density fallback applied as on CUDA, the selection's share of dense time 0, no floor."""
    monkeypatch.setattr(density, "falls_back_by_density", lambda query: True)
    monkeypatch.setattr(hf_sparse.methods.PLASMethod, "selection_share", lambda self, num_queries, head_dim: 0.0)
    monkeypatch.setattr(hf_sparse.methods.PLASMethod, "density_floor", lambda self, num_queries, key_length: 0.0)
    return monkeypatch


def test_rule_floor_and_remembered(model, by_density):
    """Rule `floor` (the sparsest selection reaches the threshold) and rule `remembered` (an earlier call's
    decision for this layer and length bucket)."""
    by_density.setattr(hf_sparse.methods.PLASMethod, "density_floor", lambda self, num_queries, key_length: 0.8)
    assert plan.plan_call(call_of(model)).rule == "floor"
    by_density.setattr(hf_sparse.methods.PLASMethod, "density_floor", lambda self, num_queries, key_length: 0.0)
    call = call_of(model)
    decided = plan.plan_call(call)
    assert (decided.path, decided.measure, decided.probe) == (SPARSE, True, False)
    density.remember(call.module, call.config, 200, 200, True, "density 0.900 >= dense_above_density 0.75")
    try:
        decided = plan.plan_call(call_of(model, call.config))
        assert (decided.rule, decided.why()) == ("remembered", "density 0.900 >= dense_above_density 0.75; "
                                                 "remembered for this length")
    finally:
        density.forget_decisions(model)


def test_rule_probe_and_measured(model, by_density):
    """Rule `probe` and rule `measured`: every row at the threshold: DENSE; some rows: those get every block."""
    mask = torch.ones(2, 200, dtype=torch.long)
    config = hf_sparse.PLASConfig(block_size=16, dense_below=100, density_memory=False)
    call = call_of(model, config, mask=mask)
    decided = plan.plan_call(call)
    dense = plan.after_probe(call, decided, torch.tensor([0.8, 0.9], dtype=torch.float64))
    assert (dense.path, dense.rule) == (DENSE, "probe") and dense.why().startswith("probe density 0.800")
    mixed = plan.after_probe(call, decided, torch.tensor([0.2, 0.9], dtype=torch.float64))
    assert (mixed.path, mixed.rule, mixed.full_rows.tolist(), mixed.measure) == (SPARSE, "probe", [False, True], True)
    measured = plan.after_selection(call, mixed, torch.tensor([0.76, 1.0], dtype=torch.float64))
    assert (measured.path, measured.rule, measured.why()) == (DENSE, "measured",
                                                             "density 0.760 >= dense_above_density 0.75")
    kept = plan.after_selection(call, decided, torch.tensor([0.2, 0.3], dtype=torch.float64))
    assert kept is decided


def test_star_rules(model):
    """Rule `forward` (Star too: test_equivalence's test_first_layer_decides_a_dense_forward) and Star's own:
    query, dense_layer, length, pattern, context."""
    config = hf_sparse.StarConfig(block_size=64, anchor_size=64, query_tokens=8, dense_below=128,
                                  dense_above_density=0.7)
    star = lambda **kw: plan.plan_star(call_of(model, config, method="star", **kw), None)  # noqa: E731
    assert star(num_queries=1, key_length=300).rule == "query"
    assert star(num_queries=100).rule == "length"
    assert star(num_queries=300, layer_idx=2).rule == "context"
    assert star(num_queries=200).rule == "pattern"  # 3 context blocks: the pattern keeps 0.83 of them
    dense_layer = dataclasses.replace(config, dense_layers=(0,))
    assert plan.plan_star(call_of(model, dense_layer, method="star", num_queries=300), None).rule == "dense_layer"


# -- a padded batch's rows ------------------------------------------------------------------------------------------
def method_config(method: str):
    """A config whose dense_below (prefill and decode) lies between the batch's two rows: the short row runs dense
    alone, the long one sparse."""
    if method == "plas":
        return hf_sparse.PLASConfig(block_size=16, prefill_top_k=(3, 4), decode_top_k=(3, 4), query_union=16,
                                    dense_layers=(), dense_below=(128, 128))
    if method == "xattn":
        return hf_sparse.XAttnConfig(block_size=16, stride=4, threshold=0.5, decode_threshold=0.5, dense_last=0,
                                     dense_layers=(), dense_below=(128, 128))
    return hf_sparse.StarConfig(block_size=32, anchor_size=16, query_tokens=8, dense_below=120,
                                dense_above_density=None)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method, cache", [("plas", "dynamic"), ("plas", "static"), ("xattn", "dynamic"),
                                           ("xattn", "static"), ("star", "dynamic")])  # (Star decodes globally)
def test_padded_batch_rows_equal_their_single_runs(method, cache, backend, monkeypatch):
    """Each row of a left-padded batch gives the tokens and logits it gives alone (prefill and decode) when the
    rows decide differently alone: the short row (under dense_below) runs dense alone and gets every causal block
    in the batch; the long row runs sparse either way."""
    monkeypatch.setenv("HF_SPARSE_BACKEND", backend)
    model = build(tiny_config("llama", 4, 2), method)
    model.generation_config.eos_token_id = None  # every run makes all its steps
    hf_sparse.configure(model, method_config(method))
    gen = torch.Generator().manual_seed(11)
    long_ids, short_ids = torch.randint(3, 128, (1, 160), generator=gen), torch.randint(3, 128, (1, 100), generator=gen)
    batch = torch.zeros(2, 160, dtype=torch.long)
    mask = torch.zeros_like(batch)
    batch[0], mask[0] = long_ids[0], 1
    batch[1, 60:], mask[1, 60:] = short_ids[0], 1
    steps = 6

    def run(ids, attention_mask=None):
        kwargs = {}
        if cache == "static":
            kwargs[hf_sparse.cache.CACHE_KWARG] = SparseCache(model.config, max_cache_len=ids.shape[1] + steps)
        return model.generate(ids, attention_mask=attention_mask, max_new_tokens=steps, do_sample=False,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True, **kwargs)

    with torch.no_grad(), hf_sparse.record_sparsity() as rec:
        together = run(batch, mask)
    with torch.no_grad():
        alone = [run(long_ids), run(short_ids)]
    assert rec.density() < 0.9, "the long row ran sparse"
    for row, single in enumerate(alone):
        assert torch.equal(together.sequences[row, 160:], single.sequences[0, -steps:]), row
        for step, (batched, expected) in enumerate(zip(together.logits, single.logits)):
            torch.testing.assert_close(batched[row], expected[0], atol=2e-5, rtol=1e-4, msg=f"row {row} step {step}")


# -- masks that are not causal plus padding -------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["plas", "xattn", "star"])
def test_packed_sequences_equal_their_documents_alone(method):
    """Rule `mask`: documents packed in one row (position_ids restarting, no mask) attend within their document, as
    under sdpa (transformers builds a 4D mask for them, and the call runs dense): never across documents."""
    config = tiny_config("llama", 4, 2)
    sparse, dense = build(config, method), build(config, "sdpa")
    hf_sparse.configure(sparse, full_density() if method == "plas" else
                        dataclasses.replace(method_config(method), dense_below=0))
    gen = torch.Generator().manual_seed(2)
    docs = [torch.randint(3, 128, (1, n), generator=gen) for n in (37, 50, 29)]
    packed = torch.cat(docs, dim=1)
    positions = torch.cat([torch.arange(d.shape[1]) for d in docs])[None]
    with torch.no_grad():
        # no cache: what transformers detects packing under (a training forward)
        out = sparse(packed, position_ids=positions, use_cache=False).logits
        expected = dense(packed, position_ids=positions, use_cache=False).logits
        alone = torch.cat([dense(d).logits for d in docs], dim=1)
    torch.testing.assert_close(expected, alone, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("device", MODEL_DEVICES)
def test_custom_4d_mask_runs_dense_equal_to_sdpa(device):
    """Rule `mask`: a custom 4D mask (here a block-diagonal one over two segments) runs dense, equal to sdpa."""
    config = tiny_config("llama", 4, 2)
    sparse, dense = build(config, "plas").to(device), build(config, "sdpa").to(device)
    hf_sparse.configure(sparse, full_density())
    ids = torch.randint(3, 128, (1, 64), device=device)
    causal = torch.tril(torch.ones(64, 64, dtype=torch.bool, device=device))
    segment = torch.arange(64, device=device) >= 30
    mask = (causal & (segment[:, None] == segment[None, :]))[None, None]
    with torch.no_grad():
        torch.testing.assert_close(sparse(ids, attention_mask=mask).logits, dense(ids, attention_mask=mask).logits,
                                   atol=2e-5, rtol=1e-4)


# -- torch.compile ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method, dynamic", [("plas", False), ("plas", True), ("xattn", True), ("star", False)],
                         ids=["plas-static-shapes", "plas-dynamic", "xattn-dynamic", "star-static-shapes"])
def test_compiled_forward_generates_what_eager_does(method, dynamic):
    """``model.forward = torch.compile(model.forward)`` on a sparse model: the attention calls and the cache's
    writes run eagerly inside the compiled forward (graph breaks), so generate() equals eager generate()."""
    config = tiny_config("llama", 4, 2)
    model = build(config, method)
    hf_sparse.configure(model, full_density() if method == "plas" else
                        dataclasses.replace(method_config(method), dense_below=0))
    ids = torch.randint(3, 128, (1, 90), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        eager = model.generate(ids, max_new_tokens=3, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)
        torch._dynamo.reset()
        model.forward = torch.compile(model.forward, dynamic=dynamic)
        compiled = model.generate(ids, max_new_tokens=3, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True)
    assert torch.equal(compiled.sequences, eager.sequences)
    for a, b in zip(compiled.logits, eager.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
