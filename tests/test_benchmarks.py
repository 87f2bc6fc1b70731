"""The benchmark scripts' helpers that shape what they report: method names, the token comparison, the ratios,
the first call's and the later calls' peak memory."""
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_generate  # noqa: E402
from _common import round_orders, sparse_config  # noqa: E402
from bench_generate import add_ratios  # noqa: E402
from conftest import build, tiny_config  # noqa: E402


@pytest.mark.parametrize("value", ["False", "false"])
def test_sparse_config_reads_python_and_json_booleans(value):
    config = sparse_config(f"plas-decode_fused_layers={value}")
    assert config.decode_fused_layers is False
    assert sparse_config("plas-decode_fused_layers=True").decode_fused_layers is True
    assert sparse_config("plas-prefill_top_k=[40:48]").prefill_top_k == (40, 48)
    assert sparse_config("xattn-threshold=0.8").threshold == 0.8
    assert sparse_config("sdpa") is None


def _row(method, tokens, tpot=None, first_peak=2.0, peak=1.0):
    return {"method": method, "tokens": tokens, "ttft_s": 1.0, "first_peak_gib": first_peak, "peak_gib": peak,
            "tpot_ms": tpot or {}}


def test_tokens_compared_with_eager_sdpa_when_it_decoded():
    rows = [_row("sdpa", [1, 2, 3, 4]), _row("sdpa-static", [1, 2, 9, 9], {4: 2.0}), _row("plas", [1, 2, 3, 5], {4: 1.0})]
    add_ratios(rows, [4])
    plas = rows[2]
    assert (plas["same_tokens_as_sdpa"], plas["same_tokens_reference"]) == (3, "sdpa")
    assert plas["tpot_vs_sdpa_static"] == 2.0


def test_both_peaks_against_sdpas_and_none_where_a_peak_is_not_measured():
    """First-call and later peaks each against sdpa's own; no ratio where either is missing (off CUDA, or a file
    written before the first call's peak was measured)."""
    rows = [_row("sdpa", [], first_peak=2.0, peak=1.0), _row("plas", [], first_peak=3.0, peak=0.9),
            _row("xattn", [], first_peak=None, peak=None)]
    del rows[2]["first_peak_gib"]  # an older file's row
    add_ratios(rows, [])
    assert rows[1]["first_peak_vs_sdpa"] == 1.5 and rows[1]["peak_vs_sdpa"] == pytest.approx(0.9)
    assert rows[2]["first_peak_vs_sdpa"] is None and rows[2]["peak_vs_sdpa"] is None
    rows = [_row("sdpa", [], first_peak=None, peak=None), _row("plas", [], first_peak=3.0, peak=0.9)]
    add_ratios(rows, [])
    assert rows[1]["first_peak_vs_sdpa"] is None and rows[1]["peak_vs_sdpa"] is None


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


def _measured(methods, tpot_tokens):
    """``bench_generate.measure`` of each method on a one-layer tiny Llama on the CPU (40 prompt tokens, one repeat:
    TPOT over one pair of calls when ``tpot_tokens`` is 64), with the ratios."""
    model = build(tiny_config(layers=1), "sdpa")
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    rows = [bench_generate.measure(model, ids, method, list(tpot_tokens), repeats=1) for method in methods]
    add_ratios(rows, list(tpot_tokens))
    return rows


def test_measure_on_the_cpu_leaves_both_peaks_unmeasured(capsys):
    """Off CUDA there are no allocator statistics: both peaks and their ratios are None and the table prints "-"
    for them; everything else is measured."""
    rows = _measured(["sdpa", "plas"], [64])
    for row in rows:
        assert row["first_peak_gib"] is None and row["peak_gib"] is None
        assert row["first_peak_vs_sdpa"] is None and row["peak_vs_sdpa"] is None
        # (TPOT is a difference of two wall times: on a busy CPU with a tiny model its noise can make it negative)
        assert row["ttft_s"] > 0 and math.isfinite(row["tpot_ms"][64]) and len(row["tokens"]) == 64
    assert rows[1]["same_tokens_as_sdpa"] == 64  # a 40-token prompt runs dense: plas's tokens are sdpa's
    bench_generate.print_table(rows, [64], {"device": "cpu", "date": "today"}, "tiny Llama", 1)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    titles = [title.strip() for title in lines[0].split("|")]
    first = titles.index("first call GiB")
    assert titles[first + 1: first + 4] == ["vs sdpa", "peak GiB", "vs sdpa"]
    for line in lines[2:]:
        assert [cell.strip() for cell in line.split("|")][first: first + 4] == ["-"] * 4


def test_first_peak_covers_the_first_call_alone_from_a_released_state(monkeypatch):
    """``first_peak_gib`` is the peak over a method's first generate() at that length, its statistics reset after
    what earlier methods kept is released; ``peak_gib`` the peak over the timed calls after it (the first call left
    out, as before). Fake allocator statistics on the CPU: each call peaks at 5 GiB if it is its method's first, at
    2 GiB if not; TTFT calls only (the timed calls after the first)."""
    events, peak = [], {"now": 0.0}
    original = bench_generate.timed_generate

    def timed_generate(model, ids, new_tokens, **kwargs):
        first = events[-1] == "reset" and events[-2] == "release"
        events.append("generate")
        peak["now"] = max(peak["now"], 5.0 if first else 2.0)
        return original(model, ids, new_tokens, **kwargs)

    def reset_peak(device):
        events.append("reset")
        peak["now"] = 0.0

    monkeypatch.setattr(bench_generate.graphs, "release", lambda model: events.append("release"))
    monkeypatch.setattr(bench_generate, "reset_peak", reset_peak)
    monkeypatch.setattr(bench_generate, "peak_gib", lambda device: peak["now"])
    monkeypatch.setattr(bench_generate, "timed_generate", timed_generate)
    rows = _measured(["sdpa", "plas"], [])
    for row in rows:
        assert (row["first_peak_gib"], row["peak_gib"]) == (5.0, 2.0)
        assert row["first_peak_vs_sdpa"] == row["peak_vs_sdpa"] == 1.0
    assert events[:5] == ["release", "reset", "generate", "reset", "generate"]
    assert events.count("release") == 2 and events.count("reset") == 4


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


def test_bench_attention_query_stride_spec():
    """``--query-stride S[:SCALE]``: a stride and a top-k scale, bad ones refused with the spec named."""
    import argparse

    from bench_attention import stride_spec

    assert stride_spec("8") == (8, 1.0) and stride_spec("16:1.5") == (16, 1.5)
    for bad in ("0", "8:0.5", "x", "8:y", "999"):
        with pytest.raises(argparse.ArgumentTypeError, match=bad.replace(".", r"\.")):
            stride_spec(bad)


def test_bench_attention_key_scorer_rows(monkeypatch, capsys):
    """``--key-scorer``: a mean-pooling row and a key-scorer row per length, each with its density, selection,
    attention and total, and ``--query-stride``'s rows timed the same way (the GPU timers replaced by a call count;
    the selections run on the CPU)."""
    import bench_attention

    calls = []
    monkeypatch.setattr(bench_attention, "median_ms", lambda fn: calls.append(fn()) or float(len(calls)))
    monkeypatch.setattr(bench_attention, "best_sdpa", lambda *args, **kwargs: (100.0, "cpu"))
    monkeypatch.setattr(bench_attention, "SHAPE", bench_attention.SMOLLM2_ATTENTION)
    monkeypatch.setattr(bench_attention, "Q_HEADS", 9)
    monkeypatch.setattr(bench_attention, "KV_HEADS", 3)
    monkeypatch.setattr(bench_attention, "HEAD_DIM", 64)
    pooled, scored = bench_attention.key_scorer_rows(640, 4, None, device="cpu")
    assert pooled["scorer"] == "mean pooling" and scored["scorer"] == "key scorer, rank 4"
    assert "scan_ms" in scored and "scan_ms" not in pooled and len(calls) == 7
    assert 0 < pooled["density"] <= 1 and 0 < scored["density"] <= 1
    directions = bench_attention.random_directions(4)
    assert directions.shape == (3, 4, 64)
    assert torch.allclose(directions @ directions.mT, torch.eye(4).expand(3, 4, 4), atol=1e-5)
    bench_attention.print_key_scorer([pooled, scored])
    assert "key scorer, rank 4" in capsys.readouterr().out
    calls.clear()  # the --query-stride study times its selections the same way
    strided = bench_attention.query_stride_rows(640, [(4, 1.1)], None, device="cpu")
    assert [row["stride"] for row in strided] == [1, 4] and len(calls) == 6
    assert all(row["select_ms"] < row["attend_ms"] < row["total_ms"] for row in strided)
    bench_attention.print_query_strides(strided)
    assert "SDPA / total" in capsys.readouterr().out
    for rank in ("0", "65"):  # SmolLM2's head dim is 64: refused before anything needs a GPU
        monkeypatch.setattr(sys, "argv", ["bench_attention.py", "--shape", "smollm2", "--key-scorer", rank])
        with pytest.raises(SystemExit) as refused:
            bench_attention.main()
        assert refused.value.code == 2 and f"--key-scorer {rank}: the rank must be in [1, 64]" in capsys.readouterr().err


def test_long_context_curve_summarises_a_training_log(tmp_path):
    """bench_training.py --loss-curve LOG.jsonl: the long-context run's summary (steps, tokens, 20-step means)."""
    pytest.importorskip("matplotlib")
    import json

    import bench_training

    log = tmp_path / "adapter.log.jsonl"
    rows = [{"step": i + 1, "tokens": (i + 1) * 100, "loss": 3.0 - 0.01 * i, "lr": 1e-4, "seconds": i + 1.0,
             "tokens_per_second": 100.0, "seq_length": 100 if i % 2 else 200} for i in range(30)]
    log.write_text("".join(json.dumps(row) + "\n" for row in rows))
    summary = bench_training.long_context_curve(str(log), str(tmp_path / "curve.png"))
    assert (summary["steps"], summary["tokens"]) == (30, 3000) and (tmp_path / "curve.png").is_file()
    assert summary["first_mean"] == pytest.approx(3.0 - 0.01 * 9.5) and summary["last_mean"] == pytest.approx(
        3.0 - 0.01 * 19.5)
    assert bench_training.moving_mean([1.0, 2.0, 3.0], 2) == [1.0, 1.5, 2.5]


def test_gate_log_curve_summarises_a_gate_training_log(tmp_path):
    """bench_training.py --loss-curve OUT/gate_training.log.jsonl: loss means and the held-out KL of each
    evaluation, in order."""
    pytest.importorskip("matplotlib")
    import json

    import bench_training

    log = tmp_path / "gate_training.log.jsonl"
    rows = [{"step": 0, "tokens": 0, "eval": {"kl": 0.9, "recall": 0.5}}]
    for i in range(60):
        rows.append({"step": i + 1, "tokens": (i + 1) * 64, "loss": 1.0 - 0.01 * i, "lr": 1e-3, "seconds": i + 1.0,
                     "tokens_per_second": 64.0})
        if (i + 1) % 30 == 0:
            rows.append({"step": i + 1, "tokens": (i + 1) * 64, "eval": {"kl": 0.9 - 0.1 * (i + 1) / 30,
                                                                         "recall": 0.6}})
    log.write_text("".join(json.dumps(row) + "\n" for row in rows))
    summary = bench_training.gate_log_curve(str(log), str(tmp_path / "gates.png"))
    assert (summary["steps"], summary["tokens"]) == (60, 3840) and (tmp_path / "gates.png").is_file()
    assert summary["first_mean"] == pytest.approx(1.0 - 0.01 * 24.5)
    assert summary["held_out_kl"] == [(0, 0.9), (30, pytest.approx(0.8)), (60, pytest.approx(0.7))]


@pytest.mark.parametrize("model, gguf", [("llama3-8b-random", None), ("smollm2", Path("model.gguf"))])
def test_long_context_takes_the_default_model_only(model, gguf):
    """--long-context is load_default_model(long_context=True): another --model or a --gguf is refused before
    anything loads, in every tool that loads through _common."""
    import argparse

    import _common

    args = argparse.Namespace(model=model, gguf=gguf, long_context=True, layers=None)
    with pytest.raises(SystemExit, match="--long-context"):
        _common.load_model(args)
