"""The kept studies' helpers (studies/): probe_layers' decision cells and refusals, fidelity_curves' averaging,
block_scorers' scorers and specs, decode_share_passkeys' ranges, first_call_memory's trace replay, launch_cost's
refusal without a GPU, profile_model's host differences."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "studies"))


def test_probe_layers_names_each_decision():
    """studies/probe_layers.py's cell: a sparse layer's density, and the density the attention function's dense
    reasons name (the probe's, the full selection's), or D for a dense layer by configuration."""
    from probe_layers import cell

    from hf_sparse.recording import LayerRecord

    assert cell(LayerRecord(3, "prefill", None, 40.0, 100.0)) == "3:0.40"
    probe = "probe density 0.712 (1024 queries in 8 runs) >= 0.670 (dense_above_density 0.75 less the selection ...)"
    assert cell(LayerRecord(8, "prefill", probe)) == "8:P0.712"
    assert cell(LayerRecord(9, "prefill", "density 0.801 >= dense_above_density 0.75")) == "9:F0.801"
    assert cell(LayerRecord(29, "prefill", "dense_layers")) == "29:D"


def test_probe_layers_cpu_runs_the_default_model_only(monkeypatch):
    """``probe_layers.py --cpu`` refuses another model before loading anything, naming what it runs."""
    import probe_layers

    monkeypatch.setattr(sys, "argv", ["probe_layers.py", "--cpu", "--model", "smollm2-random"])
    with pytest.raises(SystemExit, match="--cpu runs the default model only"):
        probe_layers.main()


def test_probe_layers_refuses_dense_configs(monkeypatch, capsys):
    """``probe_layers.py --configs`` names plas / xattn configurations; sdpa is refused, not skipped."""
    import probe_layers

    monkeypatch.setattr(sys, "argv", ["probe_layers.py", "--configs", "plas", "sdpa"])
    with pytest.raises(SystemExit):
        probe_layers.main()
    assert "sdpa and sdpa-static make no sparse decisions" in capsys.readouterr().err


def test_fidelity_curves_average_each_setting_per_length_over_its_windows():
    """``fidelity_curves.averaged``: one row per (input length, setting), the mean of each number over the windows
    with their range; the same setting at another length stays its own row."""
    from fidelity_curves import averaged, family

    def row(tokens, setting, kl, window):
        return {"tokens": tokens, "setting": setting, "family": family(setting), "density": 0.5, "kl": kl,
                "kl_last": 2 * kl, "top1": 0.9, "window": window}
    rows = [row(8192, "star-block_size=1024", 0.1, 0), row(8192, "star-block_size=1024", 0.3, 1),
            row(32768, "star-block_size=1024", 1.0, 0)]
    merged = averaged(rows)
    assert [(r["tokens"], r["windows"]) for r in merged] == [(8192, 2), (32768, 1)]
    assert merged[0]["kl"] == pytest.approx(0.2) and merged[0]["kl_min"] == 0.1 and merged[0]["kl_max"] == 0.3
    assert merged[0]["kl_last"] == pytest.approx(0.4) and merged[1]["kl"] == 1.0
    assert family("star-block_size=1024-query_tokens=256") == "star-query_tokens=256"
    assert family("plas-prefill_top_k=[8:10]") == "plas (other fields default)"


def _scorer_inputs(seed=0, q_heads=6, kv_heads=2, queries=40, keys=203, dim=16):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, q_heads, queries, dim, generator=generator)
    key = torch.randn(1, kv_heads, keys, dim, generator=generator)
    return query, key, torch.arange(keys - queries, keys)


def test_block_scorers_oracle_and_max_logit_pool_the_reference_logits():
    from block_scorers import max_logit, oracle

    from hf_sparse.kernels import reference

    query, key, slots = _scorer_inputs()
    for pool, scorer in (("sum", oracle), ("max", max_logit)):
        expected = reference.pooled_block_logits(query, key, 32, 0.25, int(slots[0]), pool)
        assert torch.equal(scorer(query, key, 32, 0.25, slots).isfinite(), expected.isfinite())
        torch.testing.assert_close(scorer(query, key, 32, 0.25, slots).nan_to_num(neginf=0),
                                   expected.nan_to_num(neginf=0))


def test_causal_logits_take_the_slots_of_queries_picked_out_of_order():
    from hf_sparse.kernels import reference

    query, key, slots = _scorer_inputs(seed=2)
    picked = torch.tensor([0, 7, 3, 39])
    expected = reference.causal_logits(query, key, 0.25, int(slots[0]))[:, :, picked]
    torch.testing.assert_close(reference.causal_logits(query[:, :, picked], key, 0.25, slots[picked]), expected)


def test_low_rank_max_in_every_direction_is_the_largest_logit_and_the_bound_lies_above_it():
    from block_scorers import bounds, low_rank_max, max_logit

    query, key, slots = _scorer_inputs(seed=1)
    exact = max_logit(query, key, 32, 0.25, slots)
    full = low_rank_max(lambda k: torch.eye(k.shape[-1]).expand(k.shape[1], -1, -1))(query, key, 32, 0.25, slots)
    torch.testing.assert_close(full, exact)
    visible = exact.isfinite()
    assert (bounds(query, key, 32, 0.25, slots)[visible] >= exact[visible] - 1e-5).all()
    half = low_rank_max(lambda k: torch.eye(k.shape[-1])[: k.shape[-1] // 2].expand(k.shape[1], -1, -1))
    assert not torch.allclose(half(query, key, 32, 0.25, slots)[visible], exact[visible])


@pytest.mark.parametrize("spec, message", [("foo:64", "unknown scorer 'foo'"), ("low-rank:64", "low-rank:BLOCK:R"),
                                           ("oracle:64:2", "oracle:BLOCK"), ("norm-keys:0:4", "positive integers"),
                                           ("subblock-max:64:24", "24 does not divide")])
def test_block_scorer_specs_name_the_problem(spec, message):
    from block_scorers import parse_spec

    with pytest.raises(ValueError, match=message):
        parse_spec(spec)
    assert parse_spec("fitted-low-rank:128:16") == ("fitted-low-rank", 128, 16)


@pytest.mark.parametrize("stride", [1, 3, 8])
def test_scored_selection_with_mean_keys_is_plas_selection_with_its_query_stride(stride):
    """The scored-selection hook ranking by ``q . mean key`` selects what PLAS's reference selects from mean
    summaries with the same ``query_stride`` (tiles of 48 over 200 queries: the last is short)."""
    from block_scorers import mean_key, scored_select_prefill

    from hf_sparse.config import PLASConfig
    from hf_sparse.kernels import reference
    from hf_sparse.methods.plas import PLASMethod

    gen = torch.Generator().manual_seed(stride)
    query, key = torch.randn(1, 4, 200, 16, generator=gen), torch.randn(1, 2, 200, 16, generator=gen)
    key = key.repeat_interleave(2, dim=1)  # the hook sees keys per query head
    config = PLASConfig(block_size=16, query_union=48, prefill_top_k=(2, 3), query_stride=stride, sink_blocks=1)
    kv_start = torch.zeros(1, dtype=torch.long)
    got = scored_select_prefill(PLASMethod(config), mean_key, stride, query, None, key, scale=0.25, q_offset=0,
                                kv_start=kv_start)
    summaries = reference.block_summaries(key, None, kv_start, 16)
    expected = reference.select_blocks(query, summaries, scale=0.25, q_offset=0, kv_start=kv_start, block_size=16,
                                       top_k=(2, 3), query_tile=48, head_union=False, sink_blocks=1,
                                       search_steps=config.search_steps, query_stride=stride)
    assert torch.equal(got.to_mask(13), expected.to_mask(13))


def test_decode_share_passkeys_reads_decode_ranges():
    """studies/decode_share_passkeys.py's --decode-top-k: LEFT:RIGHT (or one count), anything else a clear error."""
    import argparse

    import decode_share_passkeys

    assert decode_share_passkeys._range("8:10") == (8, 10)
    assert decode_share_passkeys._range("16") == (16, 16)
    with pytest.raises(argparse.ArgumentTypeError, match="LEFT:RIGHT"):
        decode_share_passkeys._range("eight")


def test_first_call_memory_replays_the_trace_to_its_peak():
    """studies/first_call_memory.py: the allocations alive at the most-live moment of an allocator trace, summed
    per innermost hf_sparse / transformers site; frees of allocations made before the trace are ignored."""
    import first_call_memory as study

    def frames(*names):
        return [{"filename": f"/x/{name}", "line": 1, "name": "f"} for name in names]

    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": frames("torch/a.py", "transformers/m.py")},
        {"action": "free_completed", "addr": 99, "size": 500, "frames": []},  # allocated before the trace
        {"action": "alloc", "addr": 2, "size": 50, "frames": frames("hf_sparse/cache.py")},
        {"action": "free_requested", "addr": 1, "size": 100, "frames": []},  # not yet free
        {"action": "alloc", "addr": 3, "size": 30, "frames": frames("hf_sparse/cache.py")},
        {"action": "free_completed", "addr": 1, "size": 100, "frames": []},
        {"action": "alloc", "addr": 4, "size": 60, "frames": frames("other.py")},
    ]
    best, alive = study.live_at_peak(trace)
    assert best == 180 and sorted(alive) == [1, 2, 3]
    assert study.by_site(alive.values()) == [("m.py:1:f", 100), ("cache.py:1:f", 80)]
    assert study.site(frames("other.py", "torch/b.py")) == "other.py:1:f"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_launch_cost_refuses_without_cuda(monkeypatch):
    """studies/launch_cost.py times CUDA launches only: without a GPU it stops with a message naming what it needs."""
    import launch_cost

    monkeypatch.setattr(sys, "argv", ["launch_cost.py", "--tokens", "16"])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        launch_cost.main()


def test_profile_model_host_differences_rank_what_a_method_adds():
    """studies/profile_model.py --host-diff: each method's own host time per function against the first method's,
    the total, the functions that add the most and those that save the most, with their calls per call."""
    import profile_model

    times = {"sdpa": {"a.py:1(f)": (2, 1.0), "b.py:2(g)": (1, 0.5)},
             "plas": {"a.py:1(f)": (2, 1.25), "c.py:3(h)": (30, 2.0)}}
    text = profile_model.host_differences(times, rows=2, calls=20)
    lines = text.splitlines()
    assert "cProfile over 20 calls" in lines[0]
    assert lines[1] == "plas: 3.25 against sdpa's 1.50 (+1.75)"
    assert lines[2] == " adds:"
    assert lines[3].split() == ["+2.000", "0", "->", "30", "calls", "c.py:3(h)"]
    assert lines[4].split() == ["+0.250", "2", "->", "2", "calls", "a.py:1(f)"]
    assert lines[5] == " saves:" and lines[6].split() == ["-0.500", "1", "->", "0", "calls", "b.py:2(g)"]
    assert len(lines) == 7
