"""benchmarks/bench_quality.py and the pass-key helpers of hf_sparse.eval: metrics against answers known by hand or
by construction, Star's per-position predictions against Star itself, and a tiny end-to-end run of the CLI."""
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import build, tiny_config

import hf_sparse
import hf_sparse.eval as hf_eval
from hf_sparse.eval import (PASSKEY_QUESTION, filler_ids, passkey_found, passkey_prompt)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_quality as bq  # noqa: E402

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def tiny_tokenizer(chat_template: bool = True):
    """A byte-level BPE tokenizer of 300 ids trained on the pass-key texts (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([hf_eval.PASSKEY_FILLER, hf_eval.PASSKEY_INSTRUCTION, PASSKEY_QUESTION,
                                   hf_eval.passkey_needle("12345")], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model():
    return build(tiny_config(layers=2), "sdpa")


def random_text(tokens: int = 3000, vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(1))


# -- metrics -------------------------------------------------------------------------------------------------------


def test_metrics_by_hand():
    """Two positions, two tokens: dense (0.6, 0.4) / (0.9, 0.1), method (0.3, 0.7) / (0.9, 0.1).
    KL = (0.6 ln 2 + 0.4 ln(4/7) + 0) / 2; top-1 agrees at the second position only; the targets (token 0 twice)
    have method probabilities 0.3 and 0.9: PPL = (0.3 * 0.9) ** -1/2."""
    dense = torch.tensor([[0.6, 0.4], [0.9, 0.1]]).log()
    method = torch.tensor([[0.3, 0.7], [0.9, 0.1]]).log()
    kl, top1 = bq.next_token_agreement(dense, method)
    assert kl == pytest.approx((0.6 * math.log(2) + 0.4 * math.log(4 / 7)) / 2, rel=1e-6)
    assert top1 == 0.5
    assert bq.perplexity(method, torch.tensor([0, 0])) == pytest.approx((0.3 * 0.9) ** -0.5, rel=1e-6)
    assert bq.next_token_agreement(dense, dense) == (0.0, 1.0)
    with pytest.raises(ValueError, match="vocab"):
        bq.perplexity(method, torch.tensor([0, 0, 1]))


def test_window_scores_the_same_targets_at_every_length():
    text = random_text()
    short, long = (bq.scoring_window(text, 2000, length, 40, 24, 64) for length in (256, 640))
    assert torch.equal(short.targets, long.targets) and torch.equal(short.targets, text[1960:2000])
    for window in (short, long):
        assert torch.equal(window.kept[window.predictions], torch.arange(window.length - 41, window.length - 1))
        spread = window.kept[window.spread]
        assert spread.numel() == 24 and spread[0] == min(64, window.length // 2) and spread[-1] == window.length - 2
        logits_target = window.input_ids[0, window.kept[window.predictions] + 1]
        assert torch.equal(logits_target, window.targets)  # row i predicts target i
    with pytest.raises(ValueError, match="text holds"):
        bq.scoring_window(text, 4000, 256, 40, 24, 64)


@pytest.mark.parametrize("method", ["sdpa", "plas", "star-block_size=64"])
def test_a_method_that_runs_dense_matches_sdpa_exactly(model, method):
    """sdpa against itself, and PLAS / Star below their dense thresholds (bit-equal to sdpa): KL 0, top-1 1, PPL
    ratio 1, exactly."""
    window = bq.scoring_window(random_text(), 2000, 320, 32, 32, 64)
    dense = bq.score_method(model, window, "sdpa")
    scored = bq.score_method(model, window, method, dense)
    assert scored.density is None  # every layer ran dense
    assert bq.next_token_agreement(dense.log_probs, scored.log_probs) == (0.0, 1.0)
    ppl = bq.perplexity(scored.log_probs[window.predictions], window.targets)
    assert ppl / bq.perplexity(dense.log_probs[window.predictions], window.targets) == 1.0


def test_a_sparse_method_moves_the_distribution(model):
    window = bq.scoring_window(random_text(), 2000, 512, 32, 32, 64)
    dense = bq.score_method(model, window, "sdpa")
    scored = bq.score_method(model, window, "plas-block_size=16-dense_below=0-noprobe-prefill_top_k=[2:3]", dense)
    assert 0.0 < scored.density < 1.0
    kl, _ = bq.next_token_agreement(dense.log_probs, scored.log_probs)
    assert kl > 0.0


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


# -- pass keys -----------------------------------------------------------------------------------------------------


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


def _row(method, ppl, top1, found):
    keys = [{"depth": depth, "found": hit} for depth, hit in zip((0.1, 0.5, 0.9), found)]
    return {"length": 1024, "method": method, "ppl": ppl, "top1": top1, "passkeys": {"filler": keys, "prose": keys}}


def test_budget_marks_each_row_against_dense():
    rows = [_row("sdpa", 10.0, 1.0, (True, False, True)), _row("plas", 10.09, 0.98, (True, True, True)),
            _row("xattn", 10.2, 0.96, (True, False, False)), _row("star", 10.0, 0.99, (True, False, True))]
    bq.judge(rows, bq.Budget.parse("ppl=1.01,top1=0.97,keys=dense"))
    assert [row["budget"] for row in rows] == ["reference", "pass", "fail: ppl, top-1, key filler 0.9, key prose 0.9",
                                               "pass"]
    assert rows[1]["ppl_ratio"] == pytest.approx(1.009)
    bq.judge(rows, bq.Budget.parse("none"))
    assert rows[2]["budget"] == "pass"
    assert bq.Budget.parse("top1=0.9") == bq.Budget(None, 0.9, False)
    for bad, message in (("ppl=0.9", "PPL ratio"), ("top1=2", r"\[0, 1\]"), ("keys=all", "dense"), ("kl=1", "one of")):
        with pytest.raises(Exception, match=message):
            bq.Budget.parse(bad)


def _runs(tmp_path):
    """Two quality runs (each with its own sdpa row) and a bench_generate run, as JSON files."""
    def run(name, rows):
        for row in rows:
            row.update(density=None if row["method"] == "sdpa" else 0.4, kl=0.0, found={"filler": 1, "prose": 1})
        data = {"environment": {"device": "GPU", "date": "2026-11-28 10:00 UTC"}, "title": name, "model": "tiny",
                "texts": {"targets": "t"},
                "settings": {"positions": 16, "skip": 0, "depths": [0.5], "answer_tokens": 2},
                "rows": rows}
        (tmp_path / name).write_text(json.dumps(data))
        return str(tmp_path / name)

    first = run("a.json", [_row("sdpa", 10.0, 1.0, (True,) * 3), _row("plas", 10.05, 0.98, (True,) * 3)])
    second = run("b.json", [_row("sdpa", 20.0, 1.0, (True,) * 3), _row("xattn", 20.5, 0.99, (True,) * 3)])
    speed = tmp_path / "speed.json"
    speed.write_text(json.dumps({"rows": [{"length": 1024, "method": "sdpa", "ttft_s": 2.0},
                                          {"length": 1024, "method": "sdpa-static", "ttft_s": 2.0},
                                          {"length": 1024, "method": "plas", "ttft_s": 0.5}]}))
    return first, second, str(speed)


def test_replot_merges_runs_each_judged_against_its_own_dense(tmp_path, capsys):
    first, second, speed = _runs(tmp_path)
    rows = bq.main(["--replot", first, second])
    assert [(row["method"], row["budget"]) for row in rows] == [("sdpa", "reference"), ("plas", "pass"),
                                                               ("xattn", "fail: ppl")]
    assert rows[2]["ppl_ratio"] == pytest.approx(1.025)  # against b.json's sdpa (20.0), not a.json's
    assert "2 runs (GPU 2026-11-28)" in capsys.readouterr().out
    assert bq.speed_ups([speed]) == {(1024, "plas"): 4.0}
    with pytest.raises(SystemExit):
        bq.parse_args(["--tradeoff", "x.png"])


def test_tradeoff_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    first, second, speed = _runs(tmp_path)
    png = tmp_path / "tradeoff.png"
    bq.main(["--replot", first, second, "--tradeoff", str(png), "--speed", speed])
    assert png.read_bytes()[:4] == b"\x89PNG"


# -- the command ---------------------------------------------------------------------------------------------------


def test_cli_writes_every_row(tmp_path, monkeypatch, capsys):
    """A tiny random model with the tiny tokenizer at two lengths, sdpa and a sparse PLAS and Star: the JSON holds
    every row with every number, sdpa's ratios are 1, and the table comes last."""
    from transformers import AutoModelForCausalLM

    tokenizer = tiny_tokenizer()
    config = tiny_config(layers=2)
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    monkeypatch.setattr(hf_eval, "stdlib_prose", lambda: "Prose to score. The sentences go on and on.\n" * 120)
    out = tmp_path / "quality.json"
    methods = ["sdpa", "plas-block_size=16-dense_below=0-noprobe-prefill_top_k=[2:3]-query_union=16",
               "star-block_size=64"]
    rows = bq.main(["--model", str(tmp_path / "model"), "--lengths", "192", "256", "--targets", "16", "--positions",
                    "16", "--skip", "64", "--text-end", "1024", "--depths", "0.5", "--answer-tokens", "2",
                    "--json", str(out), "--methods", *methods[1:]])
    data = json.loads(out.read_text())
    assert [(row["length"], row["method"]) for row in data["rows"]] == [(length, method) for length in (192, 256)
                                                                      for method in methods]
    assert data["rows"] == json.loads(json.dumps(rows))
    for row in data["rows"]:
        assert row["ppl"] > 1 and 0 <= row["top1"] <= 1 and row["kl"] >= -1e-6 and row["positions"] == 16
        assert set(row["found"]) == {"filler", "prose"} and len(row["passkeys"]["prose"]) == 1
        assert row["budget"] in ("reference", "pass") or row["budget"].startswith("fail")
    dense = [row for row in data["rows"] if row["method"] == "sdpa"]
    assert all(row["ppl_ratio"] == 1.0 and row["kl"] == 0.0 and row["top1"] == 1.0 for row in dense)
    assert 0 < data["rows"][1]["density"] < 1
    assert "Prose" not in data["texts"]["targets"] and "stdlib_prose" in data["texts"]["targets"]
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-8].split("|")[1].strip() == "tokens" and printed[-1].split("|")[2].strip() == methods[2]
    # --replot: the same table from the file, judged by another budget
    assert bq.main(["--replot", str(out), "--budget", "none"]) == [
        {**row, "budget": "reference" if row["method"] == "sdpa" else "pass"} for row in data["rows"]]
    replotted = capsys.readouterr().out.strip().splitlines()
    assert [line.split("|")[1:10] for line in replotted[-6:]] == [line.split("|")[1:10] for line in printed[-6:]]


def test_cli_refuses_what_it_cannot_run():
    with pytest.raises(SystemExit):
        bq.parse_args(["--methods", "sdpa-static"])
    with pytest.raises(SystemExit):
        bq.parse_args(["--long-context", "--rope-scaling", "yarn"])
    with pytest.raises(SystemExit):
        bq.parse_args(["--rope-scaling", "yarn:0.5"])
    assert bq.parse_args(["--methods", "star", "plas"]).methods == ["sdpa", "star", "plas"]
