"""The benchmark scripts' helpers that shape what they report: method names and the token comparison."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from _common import round_orders, sparse_config  # noqa: E402
from bench_generate import add_ratios  # noqa: E402


@pytest.mark.parametrize("value", ["False", "false"])
def test_sparse_config_reads_python_and_json_booleans(value):
    config = sparse_config(f"plas-decode_fused_layers={value}")
    assert config.decode_fused_layers is False
    assert sparse_config("plas-decode_fused_layers=True").decode_fused_layers is True
    assert sparse_config("plas-prefill_top_k=[40:48]").prefill_top_k == (40, 48)
    assert sparse_config("xattn-threshold=0.8").threshold == 0.8
    assert sparse_config("sdpa") is None


def _row(method, tokens, tpot=None):
    return {"method": method, "tokens": tokens, "ttft_s": 1.0, "peak_gib": 1.0, "tpot_ms": tpot or {}}


def test_tokens_compared_with_eager_sdpa_when_it_decoded():
    rows = [_row("sdpa", [1, 2, 3, 4]), _row("sdpa-static", [1, 2, 9, 9], {4: 2.0}), _row("plas", [1, 2, 3, 5], {4: 1.0})]
    add_ratios(rows, [4])
    plas = rows[2]
    assert (plas["same_tokens_as_sdpa"], plas["same_tokens_reference"]) == (3, "sdpa")
    assert plas["tpot_vs_sdpa_static"] == 2.0


def test_tokens_compared_with_static_when_sdpa_timed_ttft_only():
    rows = [_row("sdpa", []), _row("sdpa-static", [1, 2, 9, 9], {4: 2.0}), _row("plas", [1, 2, 3, 5], {4: 1.0})]
    add_ratios(rows, [4])
    assert (rows[2]["same_tokens_as_sdpa"], rows[2]["same_tokens_reference"]) == (2, "sdpa-static")


def test_replot_merges_files_and_keeps_the_methods_asked_for(capsys):
    """--replot of two measured files: the rows of both lengths, the option variants left out unless asked for, each
    TTFT ratio from its own file (the 128K rows from the trim run: plas 1.49x sdpa's)."""
    import argparse

    from bench_generate import replot

    runs = Path(__file__).resolve().parents[1] / "docs" / "runs"
    files = [str(runs / "dense_above_density_32k_64k_h100.json"), str(runs / "trim_131072_h100.json")]
    replot(argparse.Namespace(replot=files, methods=["sdpa", "plas", "xattn"], plot=None))
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert not any("dense_above_density" in line or "trim_last_layer" in line for line in table)
    plas = {line.split("|")[1].strip(): line for line in table if line.split("|")[2].strip() == "plas"}
    assert set(plas) == {"32768", "65536", "131072"} and "1.49x" in plas["131072"]
    replot(argparse.Namespace(replot=files[1:], methods=["plas", "plas-trim_last_layer=False"], plot=None))
    assert "plas-trim_last_layer=False" in capsys.readouterr().out


def test_replot_pairs_tpot_within_one_file(capsys):
    """A TPOT ratio holds only between rows of one file: plas's 32K TPOT from a run of sdpa-static and plas alone is
    compared with that run's sdpa-static (3.39x), xattn's from another file's has none."""
    import argparse

    from bench_generate import replot

    runs = Path(__file__).resolve().parents[1] / "docs" / "runs"
    files = [str(runs / "gen_merge_after_4k_32k_h100.json"), str(runs / "gen_4k_32k_h100.json")]
    replot(argparse.Namespace(replot=files, methods=["sdpa", "sdpa-static", "plas", "xattn"], plot=None))
    rows = {(line.split("|")[1].strip(), line.split("|")[2].strip()): line
            for line in capsys.readouterr().out.splitlines() if line.startswith("|")}
    assert "3.39x" in rows[("32768", "plas")] and "3.14x" not in rows[("32768", "xattn")]
    assert "3.02x" in rows[("16384", "plas")]  # 16K only in the second file: its own pairing


def test_probe_layers_names_each_decision():
    """benchmarks/probe_layers.py's cell: a sparse layer's density, and the density the attention function's dense
    reasons name (the probe's, the full selection's), or D for a dense layer by configuration."""
    from probe_layers import cell

    from hf_sparse.recording import LayerRecord

    assert cell(LayerRecord(3, "prefill", None, 40.0, 100.0)) == "3:0.40"
    probe = "probe density 0.712 (1024 queries in 8 runs) >= 0.670 (dense_above_density 0.75 less the selection ...)"
    assert cell(LayerRecord(8, "prefill", probe)) == "8:P0.712"
    assert cell(LayerRecord(9, "prefill", "density 0.801 >= dense_above_density 0.75")) == "9:F0.801"
    assert cell(LayerRecord(29, "prefill", "dense_layers")) == "29:D"


@pytest.mark.parametrize("methods", [["sdpa", "plas"], ["sdpa", "plas", "xattn"],
                                     ["sdpa", "sdpa-static", "plas", "xattn"], ["a", "b", "c", "d", "e"]])
def test_round_orders_balance_predecessors_and_positions(methods):
    count = len(methods)
    period = count if count % 2 == 0 else 2 * count
    orders = round_orders(methods, 2 * period)
    assert orders[:period] == orders[period:]  # the design repeats
    assert all(sorted(order) == sorted(methods) for order in orders)
    before = {(a, b): 0 for a in methods for b in methods if a != b}
    for order in orders[:period]:
        for a, b in zip(order, order[1:]):
            before[(a, b)] += 1
    assert set(before.values()) == {period * (count - 1) // len(before)}, before
    for square in (orders[:count], orders[count:period]):  # each method at each position once per square
        assert all(sorted(order[i] for order in square) == sorted(methods) for i in range(count) if square)


def test_interleaved_switches_to_each_method_before_its_call_in_round_order(monkeypatch):
    """Each call runs with the model switched to its own method, the calls in :func:`round_orders`' order, and
    each method's times come back in its rounds' order."""
    import _common

    switched, calls = [], []
    monkeypatch.setattr(_common, "use_method", lambda model, method: switched.append(method))

    def call(method):
        calls.append(method)
        assert switched[-1] == method
        return float(len(calls))

    methods = ["sdpa", "plas", "xattn"]
    times = _common.interleaved(object(), methods, 4, call)
    order = [method for round_ in round_orders(methods, 4) for method in round_]
    assert calls == switched == order
    assert times == {method: [float(i + 1) for i, m in enumerate(order) if m == method] for method in methods}


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


def test_bench_attention_query_stride_spec():
    """``--query-stride S[:SCALE]``: a stride and a top-k scale, bad ones refused with the spec named."""
    import argparse

    from bench_attention import stride_spec

    assert stride_spec("8") == (8, 1.0) and stride_spec("16:1.5") == (16, 1.5)
    for bad in ("0", "8:0.5", "x", "8:y", "999"):
        with pytest.raises(argparse.ArgumentTypeError, match=bad.replace(".", r"\.")):
            stride_spec(bad)


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
