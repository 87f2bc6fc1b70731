"""benchmarks/quality_tasks.py and benchmarks/quality_stats.py: the task prompts hold what they say where they say
it, at the exact length, the same for a seed and never the demo's or the training data's text; answers are scored
as stated; the intervals cover a known mean and behave at the edges."""
import random
import re
import sys
from pathlib import Path

import pytest
import torch

import hf_sparse.tools.eval as hf_eval
import hf_sparse.tools.long_documents as lc
from conftest import trained_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import quality_stats as qs  # noqa: E402
import quality_tasks as qt  # noqa: E402

def task_tokenizer(chat_template: bool = True):
    """A tokenizer of 400 ids trained on the tasks' own wording (no download)."""
    texts = [qt.REGISTRY_INSTRUCTION, qt.TRACKING_INSTRUCTION, qt.WORDS_INSTRUCTION, qt.REGISTRY_QUESTION,
             qt.REGISTRY_VALUES_QUESTION, qt.TRACKING_QUESTION, qt.WORDS_QUESTION, qt.REGISTRY_NOTE,
             qt.TRACKING_FIRST, qt.TRACKING_NEXT, qt.REGISTRY_CUE, qt.REGISTRY_VALUES_CUE, qt.TRACKING_CUE,
             qt.WORDS_CUE, " ".join(qt.made_up_words(300, 0)), *qt.neutral_sentences(300, 0),
             hf_eval.PASSKEY_FILLER, hf_eval.PASSKEY_INSTRUCTION, hf_eval.PASSKEY_QUESTION]
    return trained_tokenizer(texts, 400, chat_template)


@pytest.fixture(scope="module")
def tokenizer():
    return task_tokenizer()


@pytest.fixture(scope="module")
def suite(tokenizer):
    return qt.TaskSuite(tokenizer, seed=3)


def haystack_text(tokenizer, prompt: qt.TaskPrompt) -> str:
    """The prompt's text between the instruction and the question, without its statements."""
    ids = prompt.input_ids[0].tolist()
    pieces, cursor = [], prompt.haystack_start
    for start, text in prompt.statements:
        pieces.append(tokenizer.decode(ids[cursor:start]))
        cursor = start + len(tokenizer(" " + text, add_special_tokens=False).input_ids)
    pieces.append(tokenizer.decode(ids[cursor:prompt.context_length]))
    return "".join(pieces)


# -- prompts -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", list(qt.TASKS))
@pytest.mark.parametrize("length", [700, 1500])
def test_prompt_has_the_length_and_each_statement_where_it_says(tokenizer, suite, task, length):
    prompt = suite.prompt(task, length, 2)
    ids = prompt.input_ids[0].tolist()
    assert prompt.input_ids.shape == (1, length) and prompt.task == task and prompt.index == 2
    assert prompt.statements, "every task places statements"
    previous = -1
    for start, text in prompt.statements:
        statement = tokenizer(" " + text, add_special_tokens=False).input_ids
        assert ids[start: start + len(statement)] == statement, (start, text)
        assert start > previous and start + len(statement) <= prompt.context_length  # in order, before the question
        previous = start
    tail = tokenizer.decode(ids[prompt.context_length:])
    assert tail.startswith("\n\n" + prompt.question) and tail.endswith("<s>assistant\n" + prompt.cue)
    head = tokenizer.decode(ids[:prompt.haystack_start])
    assert head.startswith("<s>user\n") and head.rstrip().endswith("after it.")
    texts = " ".join(text for _, text in prompt.statements)
    for expected in prompt.answers:  # every answer is stated in the haystack
        assert (expected in texts) if task != "cwe" else (texts.split().count(expected) >= 4)
    for value in prompt.distractors:
        assert value in texts and value not in prompt.answers
    if task == "multikey":
        asked = re.search(r"labelled (\S+)\?", prompt.question).group(1)
        notes = [text for _, text in prompt.statements if asked in text]
        assert notes == [qt.REGISTRY_NOTE.format(key=asked, value=prompt.answers[0])], "one note of the asked key"
        assert len(prompt.distractors) == qt.NEEDLE_KEYS - 1 and len(set(prompt.distractors)) == 3


@pytest.mark.parametrize("task", list(qt.TASKS))
def test_haystack_is_neither_the_demo_nor_the_training_text(tokenizer, suite, task):
    prompt = suite.prompt(task, 1500, 0)
    text = tokenizer.decode(prompt.input_ids[0]).lower()
    haystack = haystack_text(tokenizer, prompt)
    for sentence in filter(None, (part.strip().lower() for part in hf_eval.PASSKEY_FILLER.split("."))):
        assert sentence not in text, sentence
    assert "pass key" not in text and hf_eval.PASSKEY_INSTRUCTION.strip().lower() not in text
    templates = lc.RETRIEVAL_STATEMENTS + lc.RETRIEVAL_QUESTIONS
    fragments = [piece.strip().lower() for template in templates for piece in re.split(r"\{\w+\}", template)]
    for fragment in filter(lambda piece: len(piece) >= 8, fragments):
        assert fragment not in text, fragment
    for key in lc.RETRIEVAL_KEYS:
        assert key not in text, key
    assert not re.search(r"\d", haystack), "numbers are only in the statements"
    words = set(re.findall(r"[a-z]+", haystack.lower()))
    assert not words & {word.lower() for word in qt.KEY_FIRST + qt.KEY_SECOND}, "key words only in the statements"


def test_tasks_are_deterministic_and_the_same_instance_at_every_length(tokenizer, suite):
    again = qt.TaskSuite(tokenizer, seed=3)
    other = qt.TaskSuite(tokenizer, seed=4)
    for task in qt.TASKS:
        first, second = suite.prompt(task, 900, 5), again.prompt(task, 900, 5)
        assert torch.equal(first.input_ids, second.input_ids) and first.answers == second.answers
        assert first.answers != other.prompt(task, 900, 5).answers
        assert first.answers != suite.prompt(task, 900, 6).answers
        longer = suite.prompt(task, 1500, 5)
        assert longer.answers == first.answers and longer.question == first.question


def test_depths_spread_over_the_haystack(suite):
    """Single needles of 40 instances land all over the haystack, not at one place."""
    starts = []
    for index in range(40):
        prompt = suite.prompt("needle", 1200, index)
        ((start, _),) = prompt.statements
        starts.append(start / prompt.context_length)
    assert min(starts) < 0.25 and max(starts) > 0.75


def test_variable_tracking_states_each_chain_in_order(tokenizer, suite):
    prompt = suite.prompt("vartrack", 900, 1)
    value = re.search(r"equal to (\d+)", prompt.question).group(1)
    texts = [text for _, text in prompt.statements]
    chain = [prompt.answers[0]]
    assert f"Let {chain[0]} be {value}." in texts
    for name in prompt.answers[1:]:  # each name is set from the one before it, after it
        statement = qt.TRACKING_NEXT.format(name=name, previous=chain[-1])
        assert texts.index(statement) > texts.index(next(t for t in texts if t.startswith(f"Let {chain[-1]} ")))
        chain.append(name)
    others = [text for text in texts if not any(f"Let {name} " in text for name in chain)]
    assert len(others) == qt.CHAIN_NAMES and value not in " ".join(others), "a second chain with another number"


@pytest.mark.parametrize("length", [700, 4000])
def test_common_words_occur_more_often_than_any_other(tokenizer, suite, length):
    prompt = suite.prompt("cwe", length, 0)
    words = re.findall(r"[a-z]+", haystack_text(tokenizer, prompt) + " " +
                       " ".join(text for _, text in prompt.statements))
    counts = {word: words.count(word) for word in set(words)}
    common = [counts[word] for word in prompt.answers]
    rare = [count for word, count in counts.items() if word not in prompt.answers]
    assert len(prompt.answers) == qt.COMMON_WORDS and len(set(common)) == 1
    assert min(common) > max(rare) and max(rare) <= qt.RARE_COUNT
    if length == 4000:
        assert common[0] == qt.COMMON_COUNT and max(rare) == qt.RARE_COUNT


def test_without_a_chat_template_the_prompt_is_plain_text():
    plain = task_tokenizer(chat_template=False)
    prompt = qt.TaskSuite(plain, 0).prompt("needle", 600, 0)
    text = plain.decode(prompt.input_ids[0])
    assert prompt.input_ids.shape == (1, 600) and text.startswith(qt.REGISTRY_INSTRUCTION)
    assert text.endswith(prompt.question + "\n\n" + prompt.cue)


def test_too_short_a_prompt_is_refused(suite):
    with pytest.raises(ValueError, match="no room for a haystack"):
        suite.prompt("vartrack", 60, 0)
    with pytest.raises(ValueError, match="unknown task"):
        suite.prompt("qa", 600, 0)


# -- scoring -------------------------------------------------------------------------------------------------------


def _prompt(task, answers, distractors=()):
    return qt.TaskPrompt(task, 0, torch.zeros(1, 1, dtype=torch.long), 0, 0, answers, distractors, (), "", "")


def test_answers_are_scored_as_stated():
    needle = _prompt("needle", ("1234567",))
    assert qt.score(needle, " 1234567.") == 1.0 and qt.score(needle, "1,234,567") == 0.0
    assert qt.score(needle, "11234567") == 0.0 and qt.score(needle, "") == 0.0
    multikey = _prompt("multikey", ("1234567",), ("7654321",))
    assert qt.score(multikey, "1234567") == 1.0 and qt.score(multikey, "1234567 or 7654321") == 0.0
    multivalue = _prompt("multivalue", ("1111111", "2222222", "3333333", "4444444"))
    assert qt.score(multivalue, "1111111, 3333333 and 5555555") == 0.5
    tracking = _prompt("vartrack", ("ABCDE", "FGHIJ"))
    assert qt.score(tracking, "abcde, FGHIJ") == 1.0 and qt.score(tracking, "ABCDEF") == 0.0
    words = _prompt("cwe", ("bralo", "tendu", "fimoka", "zuli", "pesa"))
    assert qt.score(words, "Bralo, tendu; fimo") == 0.4


def test_made_up_words_are_distinct_and_seeded():
    words = qt.made_up_words(5000, 1)
    assert len(set(words)) == 5000 and words[:10] == qt.made_up_words(10, 1) and words != qt.made_up_words(5000, 2)
    assert all(re.fullmatch(r"[a-z]{6}", word) for word in words)


# -- intervals -----------------------------------------------------------------------------------------------------


def test_bootstrap_covers_a_known_mean():
    """95% intervals of the mean of 200 draws from an exponential (mean 1, skewed) hold the true mean in about 95%
    of 300 samples (binomial sd 1.3%: 90-99% allowed)."""
    generator = torch.Generator().manual_seed(0)
    covered = 0
    for trial in range(300):
        values = torch.empty(200).exponential_(1.0, generator=generator)
        estimate = qs.bootstrap(values, resamples=500, seed=trial)
        assert estimate.low <= estimate.value <= estimate.high
        covered += estimate.low <= 1.0 <= estimate.high
    assert 0.90 <= covered / 300 <= 0.99


def test_bootstrap_at_the_edges():
    assert qs.bootstrap(torch.tensor([0.25])) == qs.Estimate(0.25, 0.25, 0.25)
    assert qs.bootstrap(torch.full((50,), 2.0)) == qs.Estimate(2.0, 2.0, 2.0)
    assert qs.bootstrap(torch.zeros(2048)) == qs.Estimate(0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="no values"):
        qs.bootstrap(torch.tensor([]))
    with pytest.raises(ValueError, match="confidence"):
        qs.bootstrap(torch.ones(3), confidence=1.0)
    values = torch.rand(300, generator=torch.Generator().manual_seed(1))
    assert qs.bootstrap(values, seed=7) == qs.bootstrap(values, seed=7) != qs.bootstrap(values, seed=8)
    wide, narrow = qs.bootstrap(values, confidence=0.99), qs.bootstrap(values, confidence=0.5)
    assert wide.low < narrow.low <= narrow.high < wide.high
    ppl = qs.bootstrap(values, transform=torch.exp)  # a transform maps the mean and both ends
    plain = qs.bootstrap(values)
    assert ppl.value == pytest.approx(torch.exp(values.double().mean()).item())
    assert (ppl.low, ppl.high) == pytest.approx((float(torch.exp(torch.tensor(plain.low))),
                                                 float(torch.exp(torch.tensor(plain.high)))))


def test_paired_differences_cancel_what_rows_share():
    """Two rows that differ by a constant on shared noisy items: the interval of their paired differences is that
    constant; the unpaired intervals overlap."""
    noise = torch.randn(500, generator=torch.Generator().manual_seed(2))
    first, second = noise, noise + 0.01
    paired = qs.bootstrap(second - first)
    assert paired.low == pytest.approx(0.01) and paired.high == pytest.approx(0.01)
    assert qs.bootstrap(second).low < qs.bootstrap(first).high


def test_wilson_by_hand_and_at_the_edges():
    z = 1.959963984540054
    low = (0.5 + z * z / 20 - z * (0.25 / 10 + z * z / 400) ** 0.5) / (1 + z * z / 10)
    assert qs.wilson(0.5, 10).low == pytest.approx(low) and qs.wilson(0.5, 10).value == 0.5
    none, every = qs.wilson(0.0, 50), qs.wilson(1.0, 50)
    assert none.low == 0.0 and 0.05 < none.high < 0.08 and every.high == 1.0
    assert every.low == pytest.approx(1 - none.high)
    assert qs.wilson(0.3, 1000).high - qs.wilson(0.3, 1000).low < qs.wilson(0.3, 50).high - qs.wilson(0.3, 50).low
    with pytest.raises(ValueError):
        qs.wilson(0.5, 0)
    with pytest.raises(ValueError):
        qs.wilson(1.5, 10)


def test_wilson_covers_a_known_share():
    rng = random.Random(0)
    covered = 0
    for _ in range(400):
        estimate = qs.wilson(sum(rng.random() < 0.8 for _ in range(50)) / 50, 50)
        covered += estimate.low <= 0.8 <= estimate.high
    assert 0.91 <= covered / 400 <= 0.99
