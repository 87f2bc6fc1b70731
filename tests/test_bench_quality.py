"""benchmarks/bench_quality.py and the pass-key helpers of hf_sparse.tools.eval: the figures against float32 on answers
known by hand or by construction (a row against itself, a dense-running method, the all-blocks floor, bf16's
floor), Star's per-position predictions against Star itself, the budget on constructed rows, and tiny end-to-end
runs of the CLI (a random model; the real SmolLM2, slow)."""
import copy
import json
import math
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import build, tiny_config, trained_tokenizer
from test_quality_tasks import task_tokenizer

import hf_sparse
import hf_sparse.tools.eval as hf_eval
from hf_sparse.tools.eval import PASSKEY_QUESTION, filler_ids, passkey_found, passkey_prompt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_quality as bq  # noqa: E402


def tiny_tokenizer(chat_template: bool = True):
    """A tokenizer of 300 ids trained on the pass-key texts (no download)."""
    return trained_tokenizer([hf_eval.PASSKEY_FILLER, hf_eval.PASSKEY_INSTRUCTION, PASSKEY_QUESTION,
                              hf_eval.passkey_needle("12345")], 300, chat_template)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture
def one_thread():
    """One torch thread for a test that runs many small forwards: the test workers share two cores, and more threads
    only contend (a tiny run took 40x longer with two threads per worker beside a busy neighbour)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return build(tiny_config(layers=2), "sdpa")


def random_text(tokens: int = 3000, vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(1))


SETTINGS = {"resamples": 200, "confidence": 0.95, "seed": 0}


# -- figures against float32 ---------------------------------------------------------------------------------------


def _hand_window():
    """Text 0 1 0 0: positions 0 and 1 spread (next tokens 1 and 0), position 2 predicts the target 0."""
    ids = torch.tensor([[0, 1, 0, 0]])
    return bq.Window(ids, torch.tensor([0, 1, 2]), torch.tensor([0, 1]), torch.tensor([2]), torch.tensor([0]), 0)


def test_position_figures_by_hand():
    """float32 (0.6, 0.4) / (0.9, 0.1) / (0.5, 0.5), the row (0.3, 0.7) / (0.9, 0.1) / (0.25, 0.75): KL at the
    first position 0.6 ln 2 + 0.4 ln(4/7), none at the second; the row's top-1 differs from float32's at the first
    only and is the text's next token at both; the target's -log p is ln 4."""
    window = _hand_window()
    reference = torch.tensor([[0.6, 0.4], [0.9, 0.1], [0.5, 0.5]]).log()
    row = torch.tensor([[0.3, 0.7], [0.9, 0.1], [0.25, 0.75]]).log()
    stats = bq.position_stats(reference, row, window)
    assert stats.kl.tolist() == pytest.approx([0.6 * math.log(2) + 0.4 * math.log(4 / 7), 0.0], abs=1e-7)
    assert stats.disagree.tolist() == [1.0, 0.0] and stats.correct.tolist() == [1.0, 1.0]
    assert stats.target_nll.tolist() == pytest.approx([math.log(4)])
    floor = bq.position_stats(reference, reference, window)
    figures = bq.text_figures(stats, floor, floor, SETTINGS)
    assert figures["excess_kl"]["value"] == pytest.approx(stats.kl.mean().item())
    assert figures["excess_top1"]["value"] == 0.5 and figures["top1_disagreement"]["value"] == 0.5
    assert figures["ppl"]["value"] == pytest.approx(4.0) and figures["ppl_ratio"]["value"] == pytest.approx(2.0)
    assert figures["accuracy"]["value"] == 1.0 and figures["accuracy_change"]["value"] == 0.5
    with pytest.raises(ValueError, match="shape"):
        bq.position_stats(reference, row[:2], window)


def test_float32_against_itself_has_no_kl_and_no_excess():
    logits = torch.randn(40, 50, generator=torch.Generator().manual_seed(0))
    text = torch.randint(0, 50, (3000,), generator=torch.Generator().manual_seed(1))
    window = bq.scoring_window(text, 2000, 64, 8, 32, 4)
    reference = torch.log_softmax(logits[:window.kept.numel()], -1)
    stats = bq.position_stats(reference, reference, window)
    assert stats.kl.abs().max() == 0.0 and stats.disagree.max() == 0.0
    figures = bq.text_figures(stats, stats, stats, SETTINGS)
    assert figures["kl"] == {"value": 0.0, "low": 0.0, "high": 0.0}
    assert figures["excess_kl"] == figures["excess_top1"] == {"value": 0.0, "low": 0.0, "high": 0.0}
    assert figures["ppl_ratio"] == {"value": 1.0, "low": 1.0, "high": 1.0}
    no_floor = bq.text_figures(stats, None, None, SETTINGS)
    assert no_floor["excess_kl"] is None and no_floor["ppl_ratio"] is None and no_floor["positions"] == 32


@pytest.mark.parametrize("chunk", [64, 100, 4096])
def test_the_float32_reference_in_chunks_is_one_forward(model, chunk):
    """The reference's chunked prefill over a KV cache gives one forward's log-probabilities (float32 rounding)."""
    window = bq.scoring_window(random_text(), 2000, 320, 32, 48, 16)
    with torch.no_grad():
        whole = torch.log_softmax(model(window.input_ids, use_cache=False, logits_to_keep=window.kept).logits[0], -1)
    chunked = bq.reference_log_probs(model, window, chunk=chunk)
    assert chunked.shape == (window.kept.numel(), model.config.vocab_size)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)


def test_bf16_has_a_floor_that_full_density_sparse_kernels_keep(model):
    """The same model in bfloat16 moves away from float32 (positive KL: the floor); the sparse kernels at full
    density in float32 do not (every block: equal to sdpa to rounding). The LM head is scaled up so that the
    random model's next-token distributions are peaked, as a trained model's are."""
    peaked = copy.deepcopy(model)
    with torch.no_grad():
        peaked.lm_head.weight.mul_(40.0)
    window = bq.scoring_window(random_text(), 2000, 320, 32, 64, 32)
    reference = bq.reference_log_probs(peaked, window)
    bf16 = copy.deepcopy(peaked).to(torch.bfloat16)
    floor = bq.position_stats(reference, bq.score_method(bf16, window, "sdpa").log_probs, window)
    assert floor.kl.mean() > 1e-4 and floor.kl.min() > -1e-6
    full = bq.score_method(peaked, window, bq.ALL_BLOCKS_CONFIG)
    assert full.density == 1.0  # every layer sparse, every block
    kernels = bq.position_stats(reference, full.log_probs, window)
    assert kernels.kl.abs().max() < floor.kl.mean() / 100 and kernels.disagree.max() == 0.0


def test_window_scores_the_same_targets_at_every_length():
    text = random_text()
    short, long = (bq.scoring_window(text, 2000, length, 40, 24, 64) for length in (256, 640))
    assert torch.equal(short.targets, long.targets) and torch.equal(short.targets, text[1960:2000])
    for window in (short, long):
        assert torch.equal(window.kept[window.predictions], torch.arange(window.length - 41, window.length - 1))
        spread = window.kept[window.spread]
        assert spread.numel() == 24 and spread[0] == min(64, window.length // 2) and spread[-1] == window.length - 2
        assert torch.equal(window.spread_labels, window.input_ids[0, spread + 1])
        logits_target = window.input_ids[0, window.kept[window.predictions] + 1]
        assert torch.equal(logits_target, window.targets)  # row i predicts target i
    with pytest.raises(ValueError, match="text holds"):
        bq.scoring_window(text, 4000, 256, 40, 24, 64)


@pytest.mark.parametrize("method", ["sdpa", "plas", "star-block_size=64"])
def test_a_method_that_runs_dense_matches_sdpa_exactly(model, method):
    """sdpa against itself, and PLAS / Star below their dense thresholds (bit-equal to sdpa): no KL, no top-1
    disagreement, the same target log-probabilities, exactly."""
    window = bq.scoring_window(random_text(), 2000, 320, 32, 32, 64)
    dense = bq.score_method(model, window, "sdpa")
    scored = bq.score_method(model, window, method, dense)
    assert scored.density is None  # every layer ran dense
    stats, own = bq.position_stats(dense.log_probs, scored.log_probs, window), bq.position_stats(
        dense.log_probs, dense.log_probs, window)
    assert stats.kl.abs().max() == 0.0 and stats.disagree.max() == 0.0
    assert torch.equal(stats.target_nll, own.target_nll) and torch.equal(stats.correct, own.correct)


def test_a_sparse_method_moves_the_distribution(model):
    window = bq.scoring_window(random_text(), 2000, 512, 32, 32, 64)
    dense = bq.score_method(model, window, "sdpa")
    scored = bq.score_method(model, window, "plas-block_size=16-dense_below=0-noprobe-prefill_top_k=[2:3]", dense)
    assert 0.0 < scored.density < 1.0
    assert bq.position_stats(dense.log_probs, scored.log_probs, window).kl.mean() > 0.0


@pytest.mark.parametrize("query_tokens", [1, 5])
def test_star_scores_each_position_as_star_predicts_it(model, query_tokens):
    """Each position p before the targets: the log-probabilities of a plain Star forward over the window up to p
    whose last query_tokens tokens are the query (the tri-shape when more than one), on both sides of Star's
    dense_above_density rule (judged on the context before that query); the targets: Star's query of one forward
    over the window, from query_tokens - 1 tokens before their first prediction."""
    window = bq.scoring_window(random_text(), 2000, 320, 24, 12, 32)
    dense = bq.score_method(model, window, "sdpa")
    name = f"star-block_size=32-anchor_size=16-query_tokens={query_tokens}"
    scored = bq.score_method(model, window, name, dense)
    config = bq.sparse_config(name)
    assert config.query_tokens == query_tokens
    early = [(row, p) for row, p in enumerate(window.kept.tolist()) if p < window.first_prediction]
    sides = {runs_dense: [item for item in early
                          if bq.star_context_runs_dense(config, item[1] + 1 - query_tokens) == runs_dense]
             for runs_dense in (True, False)}
    assert len(sides[True]) >= 2 and len(sides[False]) >= 2
    assert scored.extra["star_positions_phase1"] == len(sides[False])
    hf_sparse.configure(model, config)
    with torch.no_grad():
        for row, position in sides[True][-2:] + sides[False][:2] + sides[False][-1:]:
            with hf_sparse.record_sparsity() as recorder:
                reference = torch.log_softmax(model(window.input_ids[:, :position + 1]).logits[0, -1], -1)
            ran_dense = all(record.dense_reason is not None for record in recorder.records if record.phase == "context")
            assert ran_dense == bq.star_context_runs_dense(config, position + 1 - query_tokens)
            torch.testing.assert_close(scored.log_probs[row], reference, atol=1e-5, rtol=1e-5)
        targets_query = window.length - window.first_prediction + query_tokens - 1
        hf_sparse.configure(model, replace(config, query_tokens=targets_query))
        query = torch.log_softmax(model(window.input_ids).logits[0, window.kept[window.predictions]], -1)
    torch.testing.assert_close(scored.log_probs[window.predictions], query, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(scored.log_probs[window.spread], dense.log_probs[window.spread], atol=1e-3)
    model.set_attn_implementation("sdpa")


# -- pass keys of hf_sparse.tools.eval (the demo's; the benchmark's tasks are quality_tasks.py) ----------------------------


def test_passkey_found_reads_the_digits():
    assert passkey_found("The pass key is 12345.", "12345")
    assert passkey_found("12,345", "12345") and passkey_found("1 2 3 4 5", "12345")
    assert not passkey_found("The pass key is 1234.", "12345") and not passkey_found("", "12345")
    assert not passkey_found("54321", "12345")
    with pytest.raises(ValueError, match="digits"):
        passkey_found("12345", "12a45")


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("length", [300, 1000])
def test_passkey_prompt_has_the_length_and_the_key_at_the_depth(tokenizer, length, depth):
    haystack = filler_ids(tokenizer, 2000)
    prompt = passkey_prompt(tokenizer, haystack, length, depth, "12345")
    ids = prompt.input_ids[0]
    assert prompt.input_ids.shape == (1, length)
    needle = tokenizer(" " + hf_eval.passkey_needle("12345").strip(), add_special_tokens=False).input_ids
    assert ids[prompt.needle_start: prompt.needle_start + len(needle)].tolist() == needle
    room = prompt.context_length - len(needle) - prompt.haystack_start  # haystack tokens
    assert prompt.depth == (prompt.needle_start - prompt.haystack_start) / room
    assert abs(prompt.depth - depth) <= 0.02 + 1 / room  # a sentence start within 2% of the haystack
    assert ids[prompt.haystack_start:prompt.needle_start].tolist() == haystack[:prompt.needle_start
                                                                               - prompt.haystack_start].tolist()
    assert tokenizer.decode(ids[:prompt.needle_start]).endswith((".", "\n\n"))
    question = tokenizer.decode(ids[prompt.context_length:])
    assert question.startswith(PASSKEY_QUESTION) and question.endswith("<s>assistant\n")
    assert tokenizer.decode(ids).startswith("<s>user\n" + hf_eval.PASSKEY_INSTRUCTION)


def test_passkey_prompt_without_a_chat_template_ends_in_the_cue():
    plain = tiny_tokenizer(chat_template=False)
    prompt = passkey_prompt(plain, filler_ids(plain, 500), 200, 0.5, "777")
    assert prompt.input_ids.shape == (1, 200)
    assert plain.decode(prompt.input_ids[0]).endswith(PASSKEY_QUESTION + hf_eval.PASSKEY_CUE)


def test_passkey_prompt_names_what_is_too_short(tokenizer):
    with pytest.raises(ValueError, match="no room for a haystack"):
        passkey_prompt(tokenizer, filler_ids(tokenizer, 100), 20, 0.5, "12345")
    with pytest.raises(ValueError, match="at least"):
        passkey_prompt(tokenizer, filler_ids(tokenizer, 100), 500, 0.5, "12345")
    with pytest.raises(ValueError, match="depth"):
        passkey_prompt(tokenizer, filler_ids(tokenizer, 100), 500, 1.5, "12345")


# -- budget --------------------------------------------------------------------------------------------------------


def _figures(ppl_ratio=1.0, accuracy_change=0.0, excess_kl=0.0, excess_top1=0.0):
    def point(value):
        return {"value": value, "low": value, "high": value}

    return {"ppl": point(2.0 * ppl_ratio), "ppl_ratio": point(ppl_ratio), "accuracy": point(0.5),
            "accuracy_change": point(accuracy_change), "kl": point(0.01 + excess_kl), "excess_kl": point(excess_kl),
            "top1_disagreement": point(0.02 + excess_top1), "excess_top1": point(excess_top1),
            "density": None if ppl_ratio == 1.0 else 0.4}


def _row(method, right=50, prose=None, document=None, instances=50):
    """A row at 1024 tokens: its figures per text (keyword arguments of _figures) and the needle task, ``right``
    of ``instances`` answers right (sdpa's all right)."""
    scores = [1.0] * right + [0.0] * (instances - right)
    return {"length": 1024, "method": method, "texts": {"prose": _figures(**(prose or {})),
                                                        "document": _figures(**(document or {}))},
            "density": None if method == "sdpa" else 0.4,
            "tasks": {"needle": {"scores": scores, "accuracy": {"value": right / instances, "low": 0.0, "high": 1.0},
                                 "answers": [""] * instances, "expected": [["1"]] * instances}}}


def test_budget_marks_each_row_against_dense():
    rows = [_row(bq.REFERENCE), _row("sdpa"), _row("plas", prose={"ppl_ratio": 1.009, "accuracy_change": -0.004,
                                                                   "excess_kl": 0.019, "excess_top1": 0.019}),
            _row("xattn", document={"ppl_ratio": 1.011}), _row("xattn-a", prose={"accuracy_change": -0.006}),
            _row("xattn-b", prose={"excess_kl": 0.021}), _row("xattn-c", document={"excess_top1": 0.0201}),
            _row("star", right=48), _row("star-b", right=30)]
    rows[0]["tasks"] = {}
    bq.judge(rows, bq.Budget(), SETTINGS)
    assert [row["budget"] for row in rows] == [
        "reference (float32)", "reference", "pass", "fail: PPL document", "fail: accuracy prose", "fail: KL prose",
        "fail: top-1 document", "pass", "fail: needle"]
    # 2 of 50 lost: -4 points, but the paired interval reaches above -3 points; 20 lost: wholly below
    star, star_b = rows[7]["tasks"]["needle"]["change"], rows[8]["tasks"]["needle"]["change"]
    assert star["value"] == pytest.approx(-0.04) and star["high"] >= -0.03
    assert star_b["value"] == pytest.approx(-0.4) and star_b["high"] < -0.03
    assert rows[2]["tasks"]["needle"]["change"] == {"value": 0.0, "low": 0.0, "high": 0.0}
    bq.judge(rows, bq.Budget.parse("none"), SETTINGS)
    assert {row["budget"] for row in rows[2:]} == {"pass"}
    bq.judge(rows, bq.Budget.parse("tasks=50"), SETTINGS)
    assert rows[8]["budget"] == "pass" and rows[6]["budget"] == "pass"


def test_budget_parses_points_and_refuses_nonsense():
    assert bq.Budget.parse("top1=1.5,tasks=5") == bq.Budget(None, None, None, 0.015, 0.05)
    assert bq.Budget.parse("ppl=1.02,accuracy=1,kl=0.01") == bq.Budget(1.02, 0.01, 0.01, None, None)
    assert bq.Budget() == bq.Budget.parse("ppl=1.01,accuracy=0.5,kl=0.02,top1=2,tasks=3")
    assert "wholly below -3 points" in bq.Budget().describe() and bq.Budget.parse("none").describe() == "none"
    for bad, message in (("ppl=0.9", "PPL ratio"), ("top1=-1", "points"), ("kl=x", "nats"), ("keys=dense", "one of"),
                         ("tasks=nan", "points")):
        with pytest.raises(Exception, match=message):
            bq.Budget.parse(bad)


def _runs(tmp_path):
    """Two quality runs (each with its own float32 and sdpa rows), an old-format run and a bench_generate run, as
    JSON files."""
    def run(name, rows):
        data = {"environment": {"device": "GPU", "date": "2026-11-28 10:00 UTC"}, "title": name, "model": "tiny",
                "texts": {"prose": "p", "document": "d"},
                "settings": {**SETTINGS, "positions": 16, "targets": 16, "skip": 0, "text_end": 2048, "instances": 50,
                             "dtype": "bfloat16"},
                "rows": rows}
        (tmp_path / name).write_text(json.dumps(data))
        return str(tmp_path / name)

    first = run("a.json", [_row(bq.REFERENCE), _row("sdpa"), _row("plas", prose={"ppl_ratio": 1.005})])
    second = run("b.json", [_row(bq.REFERENCE), _row("sdpa", right=40),
                            _row("xattn", right=10, prose={"ppl_ratio": 1.005})])
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"environment": {"device": "GPU", "date": "2026-11-28"}, "settings": {},
                               "rows": [{"length": 1024, "method": "sdpa", "ppl": 2.0, "top1": 1.0}]}))
    speed = tmp_path / "speed.json"
    speed.write_text(json.dumps({"rows": [{"length": 1024, "method": "sdpa", "ttft_s": 2.0},
                                          {"length": 1024, "method": "sdpa-static", "ttft_s": 2.0},
                                          {"length": 1024, "method": "plas", "ttft_s": 0.5}]}))
    return first, second, str(old), str(speed)


def test_replot_merges_runs_each_judged_against_its_own_dense(tmp_path, capsys):
    first, second, old, speed = _runs(tmp_path)
    rows = bq.main(["--replot", first, second])
    assert [(row["method"], row["budget"]) for row in rows] == [
        (bq.REFERENCE, "reference (float32)"), ("sdpa", "reference"), ("plas", "pass"), ("xattn", "fail: needle")]
    assert rows[3]["tasks"]["needle"]["change"]["value"] == pytest.approx(-0.6)  # against b.json's sdpa (40 right)
    printed = capsys.readouterr().out
    assert "2 runs (GPU 2026-11-28)" in printed and re.search(r"\|\s+needle\s+\|", printed)
    assert bq.speed_ups([speed]) == {(1024, "plas"): 4.0}
    with pytest.raises(SystemExit, match="before its float32 reference"):
        bq.main(["--replot", old])
    with pytest.raises(SystemExit):
        bq.parse_args(["--tradeoff", "x.png"])


def test_tradeoff_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    first, second, _, speed = _runs(tmp_path)
    png = tmp_path / "tradeoff.png"
    bq.main(["--replot", first, second, "--tradeoff", str(png), "--speed", speed, "--png", str(tmp_path / "q.png")])
    assert png.read_bytes()[:4] == b"\x89PNG" and (tmp_path / "q.png").read_bytes()[:4] == b"\x89PNG"


# -- the command ---------------------------------------------------------------------------------------------------


class _Document:
    """A stand-in for a held-out ``hf_sparse.tools.long_documents.Document``."""

    name, paths, root = "code:example#0", ("a.py", "b.py"), "site-packages"

    def read(self) -> str:
        return "def answer(question):\n    return registry[question]\n\n\nregistry = {}\n" * 200


def test_cli_writes_every_row(tmp_path, monkeypatch, capsys, one_thread):
    """A tiny random model with a tiny tokenizer at two lengths in bfloat16 against float32, with the floors, a
    sparse PLAS and Star and every task: the JSON holds every row with every number, float32 has no KL, sdpa's
    floor is positive and its excess none, every method answers the same prompts, and the tables come last."""
    from transformers import AutoModelForCausalLM

    tokenizer = task_tokenizer()
    config = tiny_config(layers=2)
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    monkeypatch.setattr(hf_eval, "stdlib_prose", lambda: "Prose to score. The sentences go on and on.\n" * 400)
    monkeypatch.setattr(bq, "held_out_document", lambda name: _Document())
    out = tmp_path / "quality.json"
    methods = ["sdpa", "all-blocks", "plas-block_size=16-dense_below=0-noprobe-prefill_top_k=[2:3]-query_union=16",
               "star-block_size=64"]
    rows = bq.main(["--model", str(tmp_path / "model"), "--lengths", "640", "768", "--targets", "16", "--positions",
                    "24", "--skip", "64", "--text-end", "1024", "--instances", "2", "--resamples", "100",
                    "--dtype", "bfloat16", "--json", str(out), "--methods", *methods[1:]])
    data = json.loads(out.read_text())
    names = [bq.REFERENCE] + methods
    assert [(row["length"], row["method"]) for row in data["rows"]] == [(length, method) for length in (640, 768)
                                                                      for method in names]
    assert data["rows"] == json.loads(json.dumps(rows))
    assert data["settings"]["positions"] == 24 and set(data["texts"]) == {"prose", "document", "tasks"}
    for row in data["rows"]:
        assert set(row["texts"]) == {"prose", "document"}
        for figures in row["texts"].values():
            assert figures["positions"] == 24 and figures["targets"] == 16 and figures["ppl"]["value"] > 1
            for key in ("ppl", "accuracy", "kl", "top1_disagreement"):
                assert figures[key]["low"] <= figures[key]["value"] <= figures[key]["high"]
        assert row["budget"] in ("reference", "reference (float32)", "pass") or row["budget"].startswith("fail")
    by_method = {(row["length"], row["method"]): row for row in data["rows"]}
    for length in (640, 768):
        reference, dense = by_method[(length, bq.REFERENCE)], by_method[(length, "sdpa")]
        plas, star = by_method[(length, methods[2])], by_method[(length, methods[3])]
        for text in ("prose", "document"):
            assert reference["texts"][text]["kl"]["value"] == 0.0 and reference["texts"][text]["excess_kl"] is None
            assert dense["texts"][text]["kl"]["value"] > 0.0, "bfloat16 against float32: a floor"
            assert dense["texts"][text]["excess_kl"]["value"] == 0.0 and dense["texts"][text]["ppl_ratio"]["value"] == 1
            assert 0 < plas["texts"][text]["density"] < 1
        assert by_method[(length, "all-blocks")]["density"] == 1.0 and not by_method[(length, "all-blocks")]["tasks"]
        assert not reference["tasks"] and set(dense["tasks"]) == set(bq.quality_tasks.TASKS)
        for task, result in dense["tasks"].items():
            assert len(result["scores"]) == 2 and all(0.0 <= score <= 1.0 for score in result["scores"])
            for other in (plas, star):  # the same prompts for every method
                assert other["tasks"][task]["expected"] == result["expected"] and "change" in other["tasks"][task]
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-10].split("|")[1].strip() == "tokens" and printed[-1].split("|")[2].strip() == methods[3]
    # --replot: the same tables from the file, judged by another budget
    replotted_rows = bq.main(["--replot", str(out), "--budget", "none"])
    assert [row["budget"] for row in replotted_rows if row["method"] not in ("sdpa", bq.REFERENCE)] == ["pass"] * 6
    replotted = capsys.readouterr().out.strip().splitlines()
    assert [line.split("|")[1:-2] for line in replotted[-8:]] == [line.split("|")[1:-2] for line in printed[-8:]]
    monkeypatch.undo()
    with pytest.raises(SystemExit, match="--document 'code:nothing#0' is not a held-out document"):
        bq.main(["--model", str(tmp_path / "model"), "--document", "code:nothing#0"])
    monkeypatch.setattr(hf_eval, "stdlib_prose", lambda: "Prose to score. The sentences go on and on.\n" * 400)
    monkeypatch.setattr(bq, "held_out_document", lambda name: _Document())
    with pytest.raises(SystemExit, match="--lengths 64: a needle prompt of 64 tokens leaves no room"):
        bq.main(["--model", str(tmp_path / "model"), "--lengths", "64", "--targets", "4", "--positions", "4",
                 "--text-end", "1024", "--methods", "sdpa", "--tasks", "needle"])


def test_cli_refuses_what_it_cannot_run():
    for bad in (["--methods", "sdpa-static"], ["--long-context", "--rope-scaling", "yarn"],
                ["--rope-scaling", "yarn:0.5"], ["--instances", "-1"], ["--confidence", "1"],
                ["--tasks", "qa"], ["--budget", "top1=0.97x"], ["--lengths", "1024", "--text-end", "512"],
                ["--answer-tokens", "0"]):
        with pytest.raises(SystemExit):
            bq.parse_args(bad)
    assert bq.parse_args(["--methods", "star", "all-blocks", "plas"]).methods == ["sdpa", "star", "all-blocks", "plas"]
    defaults = bq.parse_args([])
    assert defaults.positions >= 2048 and defaults.targets >= 2048 and defaults.instances >= 50
    assert defaults.lengths == [16384, 32768, 65536, 131072] and defaults.methods[:2] == ["sdpa", "all-blocks"]
    assert bq.sparse_config(bq.ALL_BLOCKS_CONFIG).dense_layers == ()


@pytest.mark.slow
def test_cli_on_the_real_model(capsys, one_thread):
    """The embedded SmolLM2 at 640 tokens in float32 (the rows' model is the reference: no floor), sdpa and a
    sparse PLAS, the real held-out texts and one needle: sdpa predicts the prose far better than chance and equals
    float32; PLAS moves off it."""
    sparse = "plas-block_size=64-dense_below=0-noprobe-prefill_top_k=[3:4]"
    rows = bq.main(["--lengths", "640", "--targets", "64", "--positions", "64", "--skip", "128", "--text-end", "4096",
                    "--instances", "1", "--tasks", "needle", "--methods", "sdpa", sparse, "--dtype", "float32",
                    "--device", "cpu"])
    reference, dense, plas = rows
    assert [row["method"] for row in rows] == [bq.REFERENCE, "sdpa", sparse]
    for text in ("prose", "document"):
        assert dense["texts"][text]["kl"]["value"] == 0.0 and dense["texts"][text]["accuracy"]["value"] > 0.3
        assert reference["texts"][text]["accuracy"] == dense["texts"][text]["accuracy"]
        assert plas["texts"][text]["kl"]["value"] > 0.0 and 0 < plas["texts"][text]["density"] < 1
    assert len(plas["tasks"]["needle"]["answers"]) == 1 and "torchgen" in capsys.readouterr().out
